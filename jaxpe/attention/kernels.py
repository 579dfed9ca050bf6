"""Attention backends: one entry point, ``attention(..., impl=...)``, for XLA and fused kernels.

Backends (``impl``):

- ``xla``: ``jaxpe.attention.dot_product_attention`` (einsum, float32 logits; the reference). Takes
  a dense bias, any mask, the KV cache. A causal ``AttentionMask`` longer than ``XLA_CAUSAL_BLOCK``
  runs in query blocks that skip the keys after each block (``causal_block``).
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN flash attention,
  NVIDIA GPU). q, k, v go in as bf16 (float16 when the values are float16).
- ``splash``: ``jax.experimental.pallas.ops.tpu.splash_attention`` (TPU; ``interpret=True`` runs it
  on CPU for tests). q is pre-scaled (the kernel has no scale argument).
- ``pallas_gpu``: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton, GPU; ``interpret=True``
  on CPU).
- ``auto``: splash on TPU, cudnn on NVIDIA GPU, else xla.

Fused kernels take no bias tensor (cuDNN takes a dense one, which costs O(T^2) memory and is not used
here). ALiBi reaches them through its bias-free emulation (``AlibiSpec``): the ``exact`` augmented
form (``jaxpe.bf16_exact.exact_alibi_dims``) or the ``rotated`` form of order k
(``jaxpe.emulation.apply_rope_alibi``); the trailing float32 emulation dims of ``rope_alibi``
(``precise_dims``) are split into bf16-exact products (``jaxpe.bf16_exact.split_product_dims``).
The emulation dims go first, then the content dims, then zero padding to the kernel's head-dim
multiple (v is padded to the same dim and the output sliced back to H).

Masks: fused kernels take an ``AttentionMask`` (self-attention: causal, padding, packed segments);
padding and segments become segment ids (padding tokens get their own id), grouped-query heads are
kept where the kernel has them (splash, cudnn) and repeated for ``pallas_gpu``. Rows of padding
queries return zeros on the fused kernels (on ``xla`` they return what the dense mask gives: zeros
for left padding). KV-cache decoding stays on ``xla``. The Pallas kernels get T padded to whole blocks
(``kernel_length``: padding tokens, sliced off), so any T runs.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import reference as attention_lib
from jaxpe.emulation import bf16_exact
from jaxpe.emulation import core as emulation
from jaxpe.ops import alibi
from jaxpe.ops import checks as _checks

Backend = Literal["xla", "cudnn", "splash", "pallas_gpu"]
BACKENDS: tuple[str, ...] = ("xla", "cudnn", "splash", "pallas_gpu")
IMPLEMENTATIONS: tuple[str, ...] = (*BACKENDS, "auto")
# Head-dim multiple each kernel wants (pallas_gpu pads to the next power of two internally).
HEAD_DIM_MULTIPLE: dict[str, int] = {"xla": 1, "cudnn": 8, "splash": 128, "pallas_gpu": 0}
# Query block of the ``xla`` backend's causal self-attention (``dot_product_attention(causal_block=)``):
# each block of queries meets only the keys up to its end. Measured on CPU (B 8, T 512, N 8, H 64,
# forward + backward): 64 and 128 ran 1.7-2.1x the dense path, 32 slower (small matmuls).
XLA_CAUSAL_BLOCK = 128
# Largest head dim (after the emulation dims and padding) cuDNN's flash attention accepts.
CUDNN_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class AlibiSpec:
  """ALiBi for ``attention``: native bias on ``xla``, bias-free emulation on fused kernels.

  Checked by ``attention`` (every backend) against q and k, not at construction.

  Attributes:
    slopes: ``[N]`` concrete float slopes (numpy or Python), finite, >= 0 (0 = no ALiBi on that
      head); traced slopes raise ValueError.
    q_positions: ``[B, T]`` integer token indices of the queries, >= 0.
    k_positions: ``[B, S]`` integer token indices of the keys, >= 0.
    max_position: static bound on positions: the exact form uses base-256 digits enough for
      positions below it (2 digits up to 65536, 3 up to 2^24); on a fused kernel with the exact
      form, concrete positions at or above it raise ValueError, traced ones cannot be checked (their high digits would be dropped), so
      give a bound that holds for every position (the decoder uses at least 65536). The rotated
      form's context for theta when ``theta`` is None.
      An int in 1..2^24 on every backend (``xla`` does not use it).
    form: ``"exact"`` (augmented, bf16-exact, no truncation error) or ``"rotated"`` (order k).
    order: k of the rotated form, an int 1..8.
    theta: radians per token of the rotated form, a finite number > 0, or None (``max_phase`` 0.1
      over ``max_position``).

  Source: ALiBi, Press et al., arXiv 2108.12409; the emulations in ``jaxpe.bf16_exact`` and
  ``jaxpe.emulation``.
  """

  slopes: np.ndarray
  q_positions: jax.Array
  k_positions: jax.Array
  max_position: int
  form: Literal["exact", "rotated"] = "exact"
  order: int = 1
  theta: float | None = None


def platform_backends() -> tuple[str, ...]:
  """Backends that run natively on the default JAX platform (``xla`` always)."""
  platform = jax.default_backend()
  if platform == "gpu":
    return ("xla", "cudnn", "pallas_gpu")
  if platform == "tpu":
    return ("xla", "splash")
  return ("xla",)


def available_backends(*, interpret: bool = False) -> tuple[str, ...]:
  """Backends usable here: the platform's, plus the Pallas ones in interpret mode when asked."""
  names = list(platform_backends())
  if interpret:
    names += [b for b in ("splash", "pallas_gpu") if b not in names]
  return tuple(names)


def resolve_backend(impl: str, *, interpret: bool = False) -> str:
  """The backend ``impl`` names here (``auto``: splash on TPU, cudnn on GPU, else xla).

  Raises:
    ValueError: unknown name, or a backend this platform cannot run; the message lists what is
      available (and that the Pallas kernels run on CPU with ``interpret=True``).
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
  if impl == "auto":
    native = platform_backends()
    return "splash" if "splash" in native else "cudnn" if "cudnn" in native else "xla"
  available = available_backends(interpret=interpret)
  if impl not in available:
    hint = "" if interpret else "; the Pallas kernels (splash, pallas_gpu) run on CPU with interpret=True"
    raise ValueError(
      f"attention impl {impl!r} is not available on platform {jax.default_backend()!r} "
      f"(interpret={interpret}); available: {available}{hint}"
    )
  return impl


def emulation_dim_count(
  impl: str, *, alibi_form: str | None = None, order: int = 1, max_position: int = 1
) -> int:
  """Extra q/k dims the emulation costs on ``impl`` (before head-dim padding).

  ``xla``: 0 for native ALiBi, 2k float32 dims for ``rope_alibi``. Fused kernels: the exact form
  ``exact_alibi_dim_count(max_position)`` (18 below 65536), the rotated form 18k (9 bf16-exact
  products per float32 dim).
  """
  if alibi_form is None:
    return 0
  if alibi_form == "exact":
    return 0 if impl == "xla" else bf16_exact.exact_alibi_dim_count(max_position)
  return 2 * order * (1 if impl == "xla" else 3 * bf16_exact.PARTS)


def padded_head_dim(impl: str, dim: int) -> int:
  """Head dim the kernel computes with for ``dim`` q/k/v dims (multiple or next power of two)."""
  multiple = HEAD_DIM_MULTIPLE[impl]
  if multiple == 0:
    return 1 << max(dim - 1, 0).bit_length()
  return -(-dim // multiple) * multiple


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: attention_lib.AttentionMask | jax.Array | None = None,
  bias: jax.Array | None = None,
  alibi_spec: AlibiSpec | None = None,
  precise_dims: int = 0,
  impl: str = "xla",
  interpret: bool = False,
) -> jax.Array:
  """``softmax(q.k * scale + bias + ALiBi, masked) . v`` on the chosen backend.

  Args:
    q: ``[B, T, N, Hq]`` float queries (``Hq = H + precise_dims``).
    k: ``[B, S, K, Hq]`` float keys.
    v: ``[B, S, K, H]`` float values.
    scale: score scale, usually ``1/sqrt(H)``; finite, > 0.
    mask: an ``AttentionMask`` (every backend), a dense bool mask ``[B, 1|N, T, S]`` (``xla``
      only), or None (no mask).
    bias: dense float bias ``[B, N, T, S]`` (``xla`` only).
    alibi_spec: ALiBi: native bias on ``xla``, its bias-free emulation on fused kernels.
    precise_dims: trailing float32 dims of q and k that carry an emulation (``rope_alibi``):
      contracted at ``precision=HIGHEST`` on ``xla``, split into bf16-exact products on the kernels.
    impl: one of ``IMPLEMENTATIONS``.
    interpret: run the Pallas kernels in interpret mode (CPU tests).

  Returns:
    ``[B, T, N, H]`` array of ``v.dtype``.

  Raises (the same checks, and the same messages, on every backend; table in docs/contracts.md):
    ValueError: an unknown or unavailable backend (lists the available ones); shapes that do not
      fit (ranks, B, S, K, Hq, N % K, no heads); ``scale`` NaN, inf, 0 or negative;
      ``precise_dims`` outside 0..Hq; an ``AttentionMask`` whose ``valid`` / ``segment_ids`` are
      not ``[B, T]`` or used with T != S; bad ``AlibiSpec`` fields (slopes not ``[N]``, finite and
      >= 0; positions not ``[B, T]``/``[B, S]`` or negative; ``max_position`` outside 1..2^24;
      ``form``, ``order`` 1..8, ``theta`` > 0). Fused kernels only: a bias or dense mask (says to
      use ``alibi_spec`` / ``AttentionMask``); T != S; H = 0; a head dim cudnn refuses (> 256 with
      the emulation dims); a float16 kernel with an emulation (bf16 parts overflow float16);
      concrete positions >= ``max_position`` with the exact form; the rotated form with a slope 0
      or a theta whose phase reaches pi/2.
    TypeError: non-float q, k, v; a ``scale`` that is not a concrete real number (bool, string,
      traced); a non-int ``precise_dims``; a non-bool ``interpret``; a mask that is neither an
      ``AttentionMask`` nor an array; ``AttentionMask`` fields of the wrong dtype (float or bool
      segment ids, float ``valid``, non-bool ``causal``); ``alibi_spec`` not an ``AlibiSpec``;
      AlibiSpec fields of the wrong type.

  Masks: segment ids of any integer dtype and value are compared exactly on every backend (the
  fused kernels get them ranked per row by ``attention.dense_segment_ids``). Real query rows get
  the same result on every backend; padding query rows (``valid`` False) are zeros on the fused
  kernels and what the dense mask gives on ``xla``.
  """
  if not isinstance(interpret, bool | np.bool_):
    raise TypeError(f"interpret must be a bool, got {interpret!r}")
  impl = resolve_backend(impl, interpret=bool(interpret))
  q, k, v, scale, mask, alibi_spec = _check_inputs(q, k, v, scale, mask, alibi_spec, precise_dims, impl)
  if impl == "xla":
    return _xla(q, k, v, scale=scale, mask=mask, bias=bias, alibi_spec=alibi_spec, precise_dims=precise_dims)
  if bias is not None:
    raise ValueError(
      f"attention impl {impl!r} takes no bias tensor: for ALiBi pass alibi_spec=AlibiSpec(...) (its "
      "emulated, bias-free form; ModelConfig.alibi_emulation chooses 'exact' or 'rotated') or use impl='xla'"
    )
  if mask is not None and not isinstance(mask, attention_lib.AttentionMask):
    raise ValueError(
      f"attention impl {impl!r} takes an AttentionMask (causal, padding, segment ids), not a dense mask; "
      "KV-cache decoding runs on impl='xla'"
    )
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv, head_dim = k.shape[1], k.shape[2], v.shape[-1]
  if s_len != t_len:
    raise ValueError(f"attention impl {impl!r} is for self-attention (T == S), got T={t_len}, S={s_len}")
  if qk_dim - precise_dims != head_dim:
    raise ValueError(
      f"q/k must carry H = {head_dim} content dims plus precise_dims = {precise_dims}, got Hq = {qk_dim}"
    )
  if head_dim == 0:
    raise ValueError(f"attention impl {impl!r} needs a head dim H >= 1, got v of shape {v.shape}")
  if batch == 0 or t_len == 0:  # nothing to compute (the kernels' grids need a token)
    return jnp.zeros((batch, t_len, num_heads, head_dim), v.dtype)
  mask = mask or attention_lib.AttentionMask(causal=False)
  if mask.segment_ids is not None:
    # the kernels compare int32 ids: rank the user's ids exactly in their own dtype first
    mask = dataclasses.replace(mask, segment_ids=attention_lib.dense_segment_ids(mask.segment_ids))

  # Dims in kernel order: emulation products first, then content (the accumulator meets the exact
  # products before anything it could round them against).
  dot_scale = 1.0 if impl == "splash" else scale  # splash: q is pre-scaled
  q_cont, k_cont = q[..., :head_dim], k[..., :head_dim]
  q_parts, k_parts = [], []
  if precise_dims:
    q_e, k_e = q[..., head_dim:].astype(jnp.float32), k[..., head_dim:].astype(jnp.float32)
    if impl == "splash":
      q_e = q_e * jnp.float32(scale)
    q_s, k_s = bf16_exact.split_product_dims(q_e, k_e)
    q_parts.append(q_s)
    k_parts.append(k_s)
  if alibi_spec is not None:
    q_a, k_a = _emulated_alibi(alibi_spec, q_cont, k_cont, dot_scale=dot_scale, num_kv=num_kv)
    q_parts.append(q_a)
    k_parts.append(k_a)
  if q_parts and any(p.shape[2] != num_kv for p in k_parts):
    # per-head rotated keys: repeat the kv heads (grouped-query sharing is lost)
    k_cont = jnp.repeat(k_cont, num_heads // num_kv, axis=2)
    v = jnp.repeat(v, num_heads // num_kv, axis=2)
    k_parts = [jnp.broadcast_to(p, (*p.shape[:2], num_heads, p.shape[3])) for p in k_parts]
    num_kv = num_heads
  if impl == "splash":
    q_cont = (q_cont.astype(jnp.float32) * jnp.float32(scale)).astype(q_cont.dtype)

  dtype = _kernel_dtype(impl, v.dtype, emulated=bool(q_parts))
  dim = padded_head_dim(impl, head_dim + sum(p.shape[-1] for p in q_parts))
  if impl == "cudnn" and dim > CUDNN_MAX_HEAD_DIM:
    raise ValueError(f"cudnn takes head dims up to {CUDNN_MAX_HEAD_DIM}; H + emulation dims = {dim}")
  qf = _assemble(q_parts, q_cont, dim, dtype)
  kf = _assemble(k_parts, k_cont, dim, dtype)
  vf = _assemble([], v, dim, dtype)
  valid = mask.valid
  if impl == "cudnn":
    out = _cudnn(qf, kf, vf, mask, scale=dot_scale)
  else:
    # The Pallas kernels tile T in blocks: pad T to a whole number of blocks with tokens that are
    # padding (their own segment id, so no real query sees them) and slice the output back.
    qf, kf, vf, kernel_mask = _pad_length(qf, kf, vf, mask, kernel_length(impl, t_len))
    if impl == "pallas_gpu":
      # jax's Triton kernel mixes int32 and Python ints in its causal loop bound: under
      # jax_enable_x64 those become int64 and lax.div refuses them. Every operand here is 32-bit.
      with jax.enable_x64(False):
        out = _pallas_gpu(qf, kf, vf, kernel_mask, scale=dot_scale, interpret=interpret)
    else:
      out = _splash(qf, kf, vf, kernel_mask, interpret=interpret)
  out = out[:, :t_len, :, :head_dim]
  if valid is not None:
    out = jnp.where(valid.astype(bool)[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out.astype(v.dtype)


def _check_inputs(q, k, v, scale, mask, alibi_spec, precise_dims, impl: str):
  """The checks every backend shares (the same errors on xla and on the fused kernels)."""
  for name, arr in (("q", q), ("k", k), ("v", v)):
    _checks.check_rank(name, arr, 4, "[B, T, N, Hq]" if name == "q" else "[B, S, K, Hq]")
    _checks.check_float(name, arr)
  scale = attention_lib.check_scale("scale", scale)
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if num_heads == 0 or num_kv == 0:
    raise ValueError(f"q and k need at least one head (N >= 1, K >= 1), got N={num_heads}, K={num_kv}")
  if num_heads % num_kv or k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != qk_dim:
    raise ValueError(
      f"q, k, v must be [B,T,N,Hq], [B,S,K,Hq], [B,S,K,H] with N % K == 0, got {q.shape}, {k.shape}, {v.shape}"
    )
  if isinstance(precise_dims, bool) or not isinstance(precise_dims, int | np.integer):
    raise TypeError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  if not 0 <= precise_dims <= qk_dim:
    raise ValueError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  if isinstance(mask, attention_lib.AttentionMask):
    if s_len != t_len:
      raise ValueError(f"an AttentionMask is for self-attention (T == S), got T={t_len}, S={s_len}")
    mask = mask.check(batch, t_len)
  elif mask is not None and not isinstance(mask, jax.Array | np.ndarray):
    raise TypeError(f"mask must be an AttentionMask, a bool array [B, 1|N, T, S] or None, got {mask!r}")
  if alibi_spec is not None:
    alibi_spec = _check_alibi_spec(alibi_spec, batch, t_len, s_len, num_heads, fused=impl != "xla")
  return q, k, v, scale, mask, alibi_spec


def _check_alibi_spec(spec, batch: int, t_len: int, s_len: int, num_heads: int, *, fused: bool) -> AlibiSpec:
  """``spec`` checked against q ``[B, T, N, .]`` and k ``[B, S, ., .]``; positions as arrays."""
  if not isinstance(spec, AlibiSpec):
    raise TypeError(f"alibi_spec must be an AlibiSpec or None, got {type(spec).__name__}")
  if isinstance(spec.slopes, jax.core.Tracer):
    raise ValueError("AlibiSpec.slopes must be concrete (numpy or Python numbers), not traced under jit")
  slopes = spec.slopes  # a numpy array of another dtype is named by the float check below
  slopes = slopes if isinstance(slopes, np.ndarray) else _checks.as_array("AlibiSpec.slopes", slopes)
  if not (jnp.issubdtype(slopes.dtype, jnp.floating) or jnp.issubdtype(slopes.dtype, jnp.integer)):
    raise TypeError(f"AlibiSpec.slopes must be a float array, got dtype {slopes.dtype}")
  slopes = np.asarray(slopes, np.float64)
  if slopes.shape != (num_heads,):
    raise ValueError(
      f"AlibiSpec.slopes must have shape [N] = [{num_heads}] (one per query head), got {slopes.shape}"
    )
  if not np.all(np.isfinite(slopes)) or np.any(slopes < 0):
    raise ValueError(
      f"AlibiSpec.slopes must be finite and >= 0 (0 = no ALiBi on that head), got {slopes.tolist()}"
    )
  max_position = spec.max_position
  if isinstance(max_position, bool) or not isinstance(max_position, int | np.integer):
    raise TypeError(f"AlibiSpec.max_position must be an int in 1..2^24, got {max_position!r}")
  if not 1 <= max_position <= 2**24:
    raise ValueError(f"AlibiSpec.max_position must be in 1..2^24, got {max_position}")
  if spec.form not in ("exact", "rotated"):
    raise ValueError(f"AlibiSpec.form must be 'exact' or 'rotated', got {spec.form!r}")
  order = spec.order
  if isinstance(order, bool) or not isinstance(order, int | np.integer):
    raise TypeError(f"AlibiSpec.order must be an int in 1..8, got {order!r}")
  if not 1 <= order <= 8:
    raise ValueError(f"AlibiSpec.order must be in 1..8, got {order}")
  theta = spec.theta
  if theta is not None:
    if isinstance(theta, bool | str | bytes | jax.core.Tracer) or np.ndim(theta) != 0:
      raise TypeError(f"AlibiSpec.theta must be None or a number (radians per token), got {theta!r}")
    theta = _checks.check_positive_float("AlibiSpec.theta", theta)
  positions = []
  for name, pos, shape in (
    ("AlibiSpec.q_positions", spec.q_positions, (batch, t_len)),
    ("AlibiSpec.k_positions", spec.k_positions, (batch, s_len)),
  ):
    pos = _checks.as_array(name, pos)
    _checks.check_positions(name, pos)
    if tuple(pos.shape) != shape:
      raise ValueError(
        f"{name} must have shape {list(shape)} (q/k's [B, T] / [B, S]), got {tuple(pos.shape)}"
      )
    if fused and spec.form == "exact":  # its base-256 digits hold positions below max_position only
      _checks.check_index_range(name, pos, max_position, "AlibiSpec.max_position")
    positions.append(pos)
  if fused and spec.form == "rotated" and np.any(slopes <= 0):
    raise ValueError("the rotated ALiBi emulation needs every slope > 0 (alibi_heads): use form='exact'")
  return dataclasses.replace(
    spec,
    slopes=slopes,
    q_positions=positions[0],
    k_positions=positions[1],
    max_position=int(max_position),
    order=int(order),
    theta=theta,
  )


def kernel_length(impl: str, length: int) -> int:
  """Sequence length the kernel computes with for T = ``length`` (padded to whole blocks).

  splash: a multiple of 128 (its block). pallas_gpu: the next power of two >= 16 up to 128 (Triton
  blocks are powers of two), above that a multiple of 128. cudnn, xla: T.
  """
  if impl == "splash":
    return -(-length // 128) * 128
  if impl == "pallas_gpu":
    return max(16, 1 << (length - 1).bit_length()) if length <= 128 else -(-length // 128) * 128
  return length


def _pad_length(q, k, v, mask: attention_lib.AttentionMask, length: int):
  """q, k, v ``[B, T, ., .]`` and the mask padded to ``length`` tokens; padding tokens are invalid."""
  batch, t_len = q.shape[:2]
  extra = length - t_len
  if extra == 0:
    return q, k, v, mask
  pad = lambda x: jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))  # noqa: E731
  valid = jnp.ones((batch, t_len), bool) if mask.valid is None else mask.valid.astype(bool)
  valid = jnp.pad(valid, ((0, 0), (0, extra)), constant_values=False)
  segments = None if mask.segment_ids is None else jnp.pad(mask.segment_ids, ((0, 0), (0, extra)))
  return pad(q), pad(k), pad(v), dataclasses.replace(mask, valid=valid, segment_ids=segments)


def _xla(q, k, v, *, scale, mask, bias, alibi_spec, precise_dims):
  causal_block = None
  if isinstance(mask, attention_lib.AttentionMask):
    if mask.causal and q.shape[1] > XLA_CAUSAL_BLOCK:
      causal_block = XLA_CAUSAL_BLOCK  # self-attention: key slot t is query slot t
    mask = (
      mask.dense(q.shape[0], q.shape[1])
      if (mask.causal or mask.valid is not None or mask.segment_ids is not None)
      else None
    )
  if alibi_spec is not None:
    native = alibi.alibi_bias(
      jnp.asarray(alibi_spec.slopes, jnp.float32), alibi_spec.q_positions, alibi_spec.k_positions
    )
    bias = native if bias is None else bias + native
  # Looked up at call time so tests can wrap attention.dot_product_attention.
  return attention_lib.dot_product_attention(
    q, k, v, scale=scale, bias=bias, mask=mask, precise_dims=precise_dims, causal_block=causal_block
  )


def _emulated_alibi(spec: AlibiSpec, q_cont, k_cont, *, dot_scale: float, num_kv: int):
  """bf16-exact extra dims for ALiBi on a fused kernel: ``(q [B,T,N,E], k [B,S,K or N,E])``."""
  if spec.form == "exact":
    return bf16_exact.exact_alibi_dims(
      spec.q_positions,
      spec.k_positions,
      slopes=spec.slopes,
      dot_scale=dot_scale,
      max_position=spec.max_position,
      num_kv_heads=num_kv,
    )
  if spec.form != "rotated":
    raise ValueError(f"AlibiSpec.form must be 'exact' or 'rotated', got {spec.form!r}")
  if np.any(np.asarray(spec.slopes) <= 0):
    raise ValueError("the rotated ALiBi emulation needs every slope > 0 (alibi_heads): use form='exact'")
  theta = spec.theta
  if theta is None:
    theta = emulation.emulation_theta(max_phase=0.1, max_len=spec.max_position)
  head_dim = q_cont.shape[-1]
  # apply_rope_alibi scales its amplitudes for a 1/sqrt(H) score scale; rescale to dot_scale.
  q_aug, k_aug = emulation.apply_rope_alibi(
    q_cont,
    k_cont,
    spec.q_positions,
    spec.k_positions,
    slopes=spec.slopes,
    theta=theta,
    order=spec.order,
  )
  q_e, k_e = q_aug[..., head_dim:], k_aug[..., head_dim:]
  rescale = 1.0 / (dot_scale * math.sqrt(head_dim))
  if rescale != 1.0:
    q_e = q_e * jnp.float32(rescale)
  return bf16_exact.split_product_dims(q_e, k_e)


def _kernel_dtype(impl: str, dtype, *, emulated: bool):
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float16:
    if emulated:
      raise ValueError(
        "float16 cannot carry the ALiBi emulation (its bf16 parts reach ~1e6 > 65504); use bfloat16"
      )
    return dtype
  if impl == "cudnn":
    return jnp.dtype(jnp.bfloat16)  # cuDNN flash attention reads fp16/bf16 only
  return dtype


def _assemble(parts, content, dim, dtype):
  x = jnp.concatenate([*parts, content.astype(jnp.float32)], axis=-1) if parts else content
  x = x.astype(dtype)
  extra = dim - x.shape[-1]
  return x if extra == 0 else jnp.concatenate([x, jnp.zeros((*x.shape[:-1], extra), dtype)], axis=-1)


def _segment_ids(mask: attention_lib.AttentionMask, batch: int, length: int):
  """``[B, T]`` int32 ids that encode packing and padding (padding tokens share their own id)."""
  if mask.valid is None and mask.segment_ids is None:
    return None
  ids = (
    jnp.zeros((batch, length), jnp.int32) if mask.segment_ids is None else mask.segment_ids.astype(jnp.int32)
  )
  if mask.valid is not None:
    ids = jnp.where(mask.valid.astype(bool), ids, jnp.iinfo(jnp.int32).min)
  return ids


def _cudnn(q, k, v, mask: attention_lib.AttentionMask, *, scale):
  # cuDNN has no segment ids here: padding/packing go in as a dense [B, 1, T, S] mask (O(T^2)) built
  # from the same ids as the Pallas kernels' (padding tokens see each other), so no query row is
  # fully masked (cuDNN gives NaN there, e.g. left padding under causality); attention() zeroes
  # the padding rows.
  ids = _segment_ids(mask, q.shape[0], q.shape[1])
  dense = None if ids is None else ids[:, None, :, None] == ids[:, None, None, :]
  return jax.nn.dot_product_attention(
    q, k, v, mask=dense, scale=scale, is_causal=mask.causal, implementation="cudnn"
  )


def _pallas_gpu(q, k, v, mask: attention_lib.AttentionMask, *, scale, interpret):
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention

  batch, t_len, num_heads, _ = q.shape
  block = min(128, t_len)  # attention() pads T to kernel_length: a power of two or a multiple of 128
  if k.shape[2] != num_heads:  # the kernel has no grouped-query heads
    k = jnp.repeat(k, num_heads // k.shape[2], axis=2)
    v = jnp.repeat(v, num_heads // v.shape[2], axis=2)
  sizes = gpu_attention.BlockSizes(
    block_q=block,
    block_k=block,
    block_q_dkv=min(32, t_len),
    block_kv_dkv=min(32, t_len),
    block_q_dq=min(32, t_len),
    block_kv_dq=min(32, t_len),
  )
  return gpu_attention.mha(
    q,
    k,
    v,
    _segment_ids(mask, batch, t_len),
    sm_scale=scale,
    causal=mask.causal,
    block_sizes=sizes,
    interpret=interpret,
  )


@functools.lru_cache(maxsize=32)
def _splash_kernel(t_len: int, num_heads: int, causal: bool, interpret: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  head_mask = splash.CausalMask((t_len, t_len)) if causal else splash.FullMask((t_len, t_len))
  with jax.ensure_compile_time_eval():  # the mask tables are constants, also when first built under jit
    return splash.make_splash_mha(
      splash.MultiHeadMask([head_mask] * num_heads), head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _splash(q, k, v, mask: attention_lib.AttentionMask, *, interpret):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  batch, t_len, num_heads, _ = q.shape
  # attention() pads T to a multiple of 128 (kernel_length)
  kernel = _splash_kernel(t_len, num_heads, mask.causal, interpret)
  ids = _segment_ids(mask, batch, t_len)
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, N, H] <-> [B, N, T, H]
  if ids is None:
    out = jax.vmap(kernel)(swap(q), swap(k), swap(v))
  else:
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1)))(
      swap(q), swap(k), swap(v), ids
    )
  return swap(out)
