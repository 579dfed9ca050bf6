"""The fused-kernel path of ``jaxpe.attention.attention``: q, k, v prepared for a kernel without a bias.

Fused kernels take no bias tensor (cuDNN takes a dense one, which costs O(T^2) memory and is not used
here). ALiBi reaches them through its bias-free emulation (``AlibiSpec``): the ``lean`` form (the
default: ``jaxpe.emulation.lean.lean_alibi_dims``, 2..6 dims, keys shared by every kv head), the
``exact`` augmented form (``jaxpe.emulation.bf16_exact.exact_alibi_dims``, 18 dims) or the ``rotated``
form of order k (``jaxpe.emulation.apply_rope_alibi``); the trailing float32 emulation dims of
``rope_alibi`` (``precise_dims``) are split into bf16-exact products (``bf16_exact.split_product_dims``).
``prepare`` builds the kernel's inputs (a pure step: ``jax.eval_shape`` of it gives every backend's
shapes on any platform); ``attend`` runs the kernel on them. The content dims go first, then the
emulation dims (the float32 accumulator then carries the content at its own size: measured better for
every form, docs/emulation.md), then zero padding to the kernel's head-dim multiple; v keeps its own
head dim where the kernel allows it (``backends.padded_v_dim``: splash) and is padded to the q/k
width elsewhere; the output is sliced back to H.

Masks: padding and segments become segment ids (padding tokens get their own id), grouped-query
heads are kept where the kernel has them (splash, cudnn) and repeated for ``pallas_gpu``. Rows of
padding queries return zeros. The Pallas kernels get T padded to whole blocks (``kernel_length``:
padding tokens, sliced off), so any T runs.

``KERNELS`` maps each fused backend to its module's ``attend(q, k, v, mask, *, scale, interpret)``.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
E emulation dims.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import cudnn, gpu_cards, pallas_gpu, splash
from jaxpe.attention.backends import (
  CUDNN_MAX_HEAD_DIM,
  AlibiSpec,
  kernel_length,
  padded_head_dim,
  padded_v_dim,
)
from jaxpe.attention.masks import AttentionMask, dense_segment_ids
from jaxpe.emulation import bf16_exact, lean
from jaxpe.emulation.ops import apply_rope_alibi
from jaxpe.emulation.solver import emulation_theta

KERNELS: dict[str, Callable[..., jax.Array]] = {
  "cudnn": cudnn.attend,
  "splash": splash.attend,
  "pallas_gpu": pallas_gpu.attend,
}
"""Fused backend -> ``attend(q, k, v, mask, *, scale, interpret)`` (``[B, T, N, D]`` each, T == S)."""
SINK_KERNELS: tuple[str, ...] = ("splash",)
PATTERN_KERNELS: tuple[str, ...] = ("splash", "cudnn")
"""Fused backends whose ``attend`` takes ``pattern=`` (a window, chunks, a soft cap: ``jaxpe.attention.patterns``)."""
"""Fused backends whose ``attend`` also takes ``sinks=`` (``[N]`` float logits)."""


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: AttentionMask | jax.Array | None,
  bias: jax.Array | None,
  alibi_spec: AlibiSpec | None,
  precise_dims: int,
  implementation: str,
  interpret: bool,
  sinks: jax.Array | None = None,
  pattern=None,
) -> jax.Array:
  """``jaxpe.attention.attention`` on a fused backend, its shared checks done: ``[B, T, N, H]``.

  ``pattern``: a checked ``jaxpe.attention.patterns.Pattern`` the backend runs (``patterns.refuse``
  has passed it), given to the kernels of ``PATTERN_KERNELS``.

  Raises:
    ValueError: as ``jaxpe.attention.attention`` (fused kernels only: a bias or dense mask, T != S,
      H = 0, a head dim cudnn refuses, float16 with an emulation; ``sinks`` on a kernel without
      them: only splash takes ``sinks [N]``).
  """
  impl = implementation
  if sinks is not None and impl not in SINK_KERNELS:
    raise ValueError(
      f"attention implementation {impl!r} takes no attention sinks; sinks run on 'xla', "
      f"{', '.join(repr(n) for n in SINK_KERNELS)} (native sinks) and 'flash'"
    )
  if bias is not None:
    raise ValueError(
      f"attention implementation {impl!r} takes no bias tensor: for ALiBi pass alibi_spec=AlibiSpec(...) "
      "(its emulated, bias-free form; ModelConfig.alibi_emulation chooses 'lean', 'exact' or 'rotated') "
      "or use implementation='xla'"
    )
  batch, t_len, num_heads, _ = q.shape
  head_dim = v.shape[-1]
  qf, kf, vf, kernel_mask = prepare(
    q, k, v, scale=scale, mask=mask, alibi_spec=alibi_spec, precise_dims=precise_dims, implementation=impl
  )
  if batch == 0 or t_len == 0:  # nothing to compute (the kernels' grids need a token)
    return jnp.zeros((batch, t_len, num_heads, head_dim), v.dtype)
  extra = {} if sinks is None else {"sinks": sinks}
  if pattern is not None:
    if impl not in PATTERN_KERNELS:  # patterns.refuse names the option first; a guard for direct callers
      raise ValueError(f"attention implementation {impl!r} takes no attention pattern ({pattern.options()})")
    extra["pattern"] = pattern
  out = KERNELS[impl](qf, kf, vf, kernel_mask, scale=kernel_scale(impl, scale), interpret=interpret, **extra)
  out = out[:, :t_len, :, :head_dim]
  if mask is not None and mask.valid is not None:
    out = jnp.where(mask.valid.astype(bool)[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out.astype(v.dtype)


def kernel_scale(implementation: str, scale: float) -> float:
  """The scale backend ``implementation`` applies to ``q . k``: 1 on splash (q comes pre-scaled), else ``scale``."""
  return 1.0 if implementation == "splash" else scale


def prepare(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: AttentionMask | None,
  alibi_spec: AlibiSpec | None,
  precise_dims: int,
  implementation: str,
) -> tuple[jax.Array, jax.Array, jax.Array, AttentionMask]:
  """The arrays fused backend ``implementation`` receives: ``(q [B, T', N, Dqk], k [B, T', K', Dqk],
  v [B, T', K', Dv], mask)``, the arguments checked as ``attention`` does.

  Pure (no kernel call), so ``jax.eval_shape`` reads every backend's shapes on any platform
  (``benchmarks/attention_bench.py`` prints its cost table from them). Content dims first, then the
  emulation dims (``precise_dims`` split into bf16-exact products, then ALiBi's dims), then zeros up to
  ``padded_head_dim``: ``Dqk = padded_head_dim(impl, H + E)``; ``Dv = padded_v_dim(impl, H, Dqk)``;
  ``T' = kernel_length(impl, T)``; ``K' = K`` unless the rotated ALiBi form (per-head keys) or
  ``pallas_gpu`` (inside its ``attend``) repeats the kv heads. q is pre-scaled on splash.

  Args:
    q: ``[B, T, N, H + precise_dims]`` float queries; k ``[B, T, K, H + precise_dims]``; v
      ``[B, T, K, H]``.
    scale: score scale, finite, > 0. mask: an ``AttentionMask`` or None. alibi_spec: a checked
      ``AlibiSpec`` or None. precise_dims: trailing float32 emulation dims of q and k.
    implementation: ``"cudnn"``, ``"splash"`` or ``"pallas_gpu"``.

  Raises:
    ValueError: a dense mask, T != S, H = 0, Hq != H + precise_dims, a head dim cudnn refuses,
      float16 with an emulation.
  """
  impl = implementation
  check_kernel_operands(impl, q, k, v, mask, precise_dims)
  batch, t_len, num_heads, _ = q.shape
  num_kv, head_dim = k.shape[2], v.shape[-1]
  mask = mask or AttentionMask(causal=False)
  if mask.segment_ids is not None:
    # the kernels compare int32 ids: rank the user's ids exactly in their own dtype first
    mask = dataclasses.replace(mask, segment_ids=dense_segment_ids(mask.segment_ids))

  # Dims in kernel order: content first, then the emulation dims (a float32 accumulator that sums in
  # dim order then rounds the content at the content's own size; with the emulation first it would
  # round it at the emulation's, measured in docs/emulation.md), then zero padding.
  dot_scale = kernel_scale(impl, scale)
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
  if impl == "cudnn" and dim > (limit := gpu_cards.cudnn_max_head_dim()):
    cc = ".".join(map(str, gpu_cards.card()))
    raise ValueError(
      f"cudnn takes head dims up to {limit} on compute capability {cc} (the card built for; "
      f"{CUDNN_MAX_HEAD_DIM} from 9.0); H + emulation dims = {dim}"
    )
  qf = _assemble(q_parts, q_cont, dim, dtype)
  kf = _assemble(k_parts, k_cont, dim, dtype)
  vf = _assemble([], v, padded_v_dim(impl, head_dim, dim), dtype)
  # The Pallas kernels tile T in blocks: pad T to a whole number of blocks with tokens that are
  # padding (their own segment id, so no real query sees them); attend slices the output back.
  return _pad_length(qf, kf, vf, mask, kernel_length(impl, t_len))


def check_kernel_operands(impl: str, q, k, v, mask, precise_dims: int) -> None:
  """The checks every Pallas/cuDNN kernel shares (``fused`` and ``flash``): an ``AttentionMask`` or
  None, self-attention (T == S), q/k = H content dims + ``precise_dims``, H >= 1.

  Raises:
    ValueError: as ``jaxpe.attention.attention`` for a fused backend.
  """
  if mask is not None and not isinstance(mask, AttentionMask):
    raise ValueError(
      f"attention implementation {impl!r} takes an AttentionMask (causal, padding, segment ids), not a "
      f"{type(mask).__name__} (a dense mask or an IndexMask); KV-cache decoding runs on implementation='xla'"
    )
  t_len, qk_dim, s_len, head_dim = q.shape[1], q.shape[3], k.shape[1], v.shape[-1]
  if s_len != t_len:
    raise ValueError(
      f"attention implementation {impl!r} is for self-attention (T == S), got T={t_len}, S={s_len}"
    )
  if qk_dim - precise_dims != head_dim:
    raise ValueError(
      f"q/k must carry H = {head_dim} content dims plus precise_dims = {precise_dims}, got Hq = {qk_dim}"
    )
  if head_dim == 0:
    raise ValueError(f"attention implementation {impl!r} needs a head dim H >= 1, got v of shape {v.shape}")


def _pad_length(q, k, v, mask: AttentionMask, length: int):
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


def _emulated_alibi(spec: AlibiSpec, q_cont, k_cont, *, dot_scale: float, num_kv: int):
  """bf16-exact extra dims for ALiBi on a fused kernel: ``(q [B,T,N,E], k [B,S,K or N,E])``."""
  digit_forms = {"lean": lean.lean_alibi_dims, "exact": bf16_exact.exact_alibi_dims}
  if spec.form in digit_forms:
    return digit_forms[spec.form](
      spec.q_positions,
      spec.k_positions,
      slopes=spec.slopes,
      dot_scale=dot_scale,
      max_position=spec.max_position,
      num_kv_heads=num_kv,
    )
  if spec.form != "rotated":
    raise ValueError(f"AlibiSpec.form must be 'lean', 'exact' or 'rotated', got {spec.form!r}")
  if np.any(np.asarray(spec.slopes) <= 0):
    raise ValueError("the rotated ALiBi emulation needs every slope > 0 (alibi_heads): use form='exact'")
  theta = spec.theta
  if theta is None:
    theta = emulation_theta(max_phase=0.1, max_len=spec.max_position)
  head_dim = q_cont.shape[-1]
  # apply_rope_alibi scales its amplitudes for a 1/sqrt(H) score scale; rescale to dot_scale.
  q_aug, k_aug = apply_rope_alibi(
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
  x = jnp.concatenate([content.astype(jnp.float32), *parts], axis=-1) if parts else content
  x = x.astype(dtype)
  extra = dim - x.shape[-1]
  return x if extra == 0 else jnp.concatenate([x, jnp.zeros((*x.shape[:-1], extra), dtype)], axis=-1)
