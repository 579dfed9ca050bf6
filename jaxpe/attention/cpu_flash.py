"""A fused float32 attention kernel for the CPU (C++ through XLA's FFI), built on first use.

``cpu_flash_attention`` computes self-attention with an optional causal mask, key validity,
segment ids (packing) and ALiBi in one C++ call per pass, where the plain-XLA blockwise path runs a
loop of small operations per block pair: per batch row and kv head, blocks of 64 queries against
their causal prefix of keys, the exact row softmax, and ``P.V``; the backward pass recomputes ``P``
from the saved log-sum-exp and accumulates dq, dk, dv (FlashAttention-2's backward, Dao 2023, arXiv
2307.08691). It is the ``xla`` backend's path on the CPU wherever it applies
(``jaxpe.attention.blockwise.blockwise_attention``); the plain-XLA loops stay the path everywhere
else and its test reference beside the dense ``dot_product_attention``.

The kernel (``cpu_flash.cc``) is compiled on first use by ``jaxpe.attention.native`` (the system
C++ compiler, ``-O3 -march=native``, cached under ``~/.cache/jaxpe``); it uses vectors of 16 floats
where the target has AVX-512 and of 8 elsewhere. Where it cannot be built, ``available()`` is False,
``unavailable_reason()`` says why, and the ``xla`` backend keeps its plain-XLA path (the same
results to float32 rounding). ``JAXPE_CPU_FLASH=0`` (or ``false``, ``no``, ``off``) in the environment turns it off;
``1``, ``true``, ``yes``, ``on`` or unset leave it on, and any other value (``disabled``) raises a
ValueError naming the variable at the first attention call that would use the kernel.

Memory: the kernel's scratch is ``workspace_bytes`` per thread of XLA's CPU pool (O(S), not O(T S));
``cpu_flash_attention`` refuses, before any allocation, a call whose scratch for all the CPU's
threads exceeds ``MEMORY_FRACTION`` of the machine's memory (a ValueError naming S), and
``blockwise_attention`` runs its XLA loops instead (their memory is O(block_q x block_k)).

Sharding (``cpu_flash_call``): any sharding of the inputs gives the unsharded values. Each device
computes its own batch rows and kv heads where q splits them over whole mesh axes (in any order;
the heads only in whole groups of G); everything else (the sequence, the head dims, a split inside
a kv group or into sub-axes) is gathered first. Context parallelism has its own path
(``jaxpe.attention.context``), inside whose ``shard_map`` the kernel runs per shard.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, G = N / K query
heads per kv head, Hq q/k head dim, H v head dim.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import cpu_flash_call as call
from jaxpe.attention import native, numerics, online_softmax, patterns
from jaxpe.attention.reference import check_precise_dims, check_scale
from jaxpe.ops import checks as _checks

SOURCE = Path(__file__).with_name("cpu_flash.cc")
"""The kernel's C++ source."""
BLOCK_Q = 64
"""Query rows per block (``BQ`` in the source): each thread holds ``[BLOCK_Q, S]`` float32 scores."""
MEMORY_FRACTION = 0.5
"""The share of the machine's memory the kernel's scratch (all threads together) may take."""
_lock = threading.Lock()
_state: dict[str, object] = {}


def _load() -> bool:
  with _lock:
    if "ok" not in _state:
      if not _checks.env_flag("JAXPE_CPU_FLASH", True):  # ValueError for a value not on/off
        _state.update(ok=False, reason=f"turned off by JAXPE_CPU_FLASH={os.environ['JAXPE_CPU_FLASH']}")
      else:
        try:
          native.register(
            SOURCE, {call.FORWARD: "JaxpeCpuFlashForward", call.BACKWARD: "JaxpeCpuFlashBackward"}
          )
          _state.update(ok=True, reason=None)
        except RuntimeError as err:  # said once; KeyboardInterrupt and ValueError propagate, nothing kept
          _state.update(ok=False, reason=str(err))
          warnings.warn(
            f"the CPU attention kernel is not available, attention runs on the XLA loops (the same results "
            f"to float32 rounding, slower): {err}",
            RuntimeWarning,
            stacklevel=2,
          )
    return bool(_state["ok"])


def workspace_bytes(t_len: int, s_len: int, qk_dim: int, v_dim: int, precise_dims: int = 0) -> int:
  """Bytes of the kernel's own scratch per thread in the backward pass (the larger pass), which
  XLA's ``memory_analysis`` does not see: the kv head's keys and values packed three ways and their
  gradient accumulators (``~10 S H`` floats: dk and dv also in float64) and two ``[BLOCK_Q, S]``
  score blocks; O(S), not O(T S).
  Each of the CPU's threads holds one at a time. (``t_len`` does not enter: queries go by blocks.)"""
  del t_len
  pad = lambda x: -(-x // 16) * 16  # noqa: E731  (PAD in the source)
  s_pad, hq_pad, h_pad = pad(s_len), pad(qk_dim), pad(v_dim)
  # (the float64 accumulators of the long sums count two floats each)
  wide = 2 * BLOCK_Q * max(h_pad, hq_pad)
  forward = (
    qk_dim * s_pad + s_len * h_pad + BLOCK_Q * (s_pad * (2 if precise_dims else 1) + h_pad + hq_pad) + wide
  )
  backward = 2 * s_len * hq_pad + v_dim * s_pad + s_len * h_pad + BLOCK_Q * (s_pad + h_pad + 2 * hq_pad)
  backward += 2 * s_len * (hq_pad + h_pad)
  return 4 * (forward + backward)


def scratch_fits(t_len: int, s_len: int, qk_dim: int, v_dim: int, precise_dims: int = 0) -> tuple[int, int]:
  """``(need, available)``: the bytes of the kernel's scratch on all the CPU's threads
  (``workspace_bytes`` x ``os.cpu_count()``) and ``MEMORY_FRACTION`` of the machine's memory."""
  need = workspace_bytes(t_len, s_len, qk_dim, v_dim, precise_dims) * (os.cpu_count() or 1)
  return need, int(MEMORY_FRACTION * _checks.host_memory_bytes())


def available() -> bool:
  """Whether the kernel is built and registered with XLA (building it on the first call, a few
  seconds; later calls and processes use the cached library)."""
  return _load()


def check_settings() -> None:
  """Reads the kernel's environment settings as its first use does (``JAXPE_CPU_FLASH``, and when
  it is on ``JAXPE_CPU_FLASH_BUILD_TIMEOUT``), so a run refuses a bad value before it starts
  rather than at its first attention call (after the workdir is made and the data read).

  Raises:
    ValueError: a setting that is not on/off, a build timeout that is not a number > 0 (named).
  """
  if _checks.env_flag("JAXPE_CPU_FLASH", True):
    native.build_timeout()


def unavailable_reason() -> str | None:
  """Why ``available()`` is False: no compiler, a failed build (the compiler's message), or
  ``JAXPE_CPU_FLASH=0``; None when it is True."""
  _load()
  return None if _state["ok"] else str(_state["reason"])


def cpu_flash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  causal: bool = False,
  precise_dims: int | None = None,
  k_valid: jax.Array | None = None,
  q_segment_ids: jax.Array | None = None,
  k_segment_ids: jax.Array | None = None,
  slopes=None,
  q_positions: jax.Array | None = None,
  k_positions: jax.Array | None = None,
  return_lse: bool = False,
  local_window_size: int | tuple[int, int] | None = None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
):
  """``softmax(softcap(q.k * scale) - ALiBi, masked) . v`` in the fused CPU kernel, float32.

  Equal to ``jaxpe.attention.dot_product_attention`` with the same mask and ALiBi bias to float32
  rounding (the tests hold it to 1e-5 with gradients), including its rules: a row with no visible
  key gives zeros (and zero gradients), a row whose visible scores hold a NaN gives NaN; the values
  of padding keys (``k_valid`` False) never reach the result, even NaN; the last ``precise_dims`` dims of q and k are contracted
  apart from the others (in float32) and the two sums added, as the RoPE-emulated ALiBi needs;
  grouped-query heads share their kv head without repeating it. Key slot s is visible to query
  slot t when ``s <= t`` (``causal``), ``k_valid[b, s]``, and ``q_segment_ids[b, t] ==
  k_segment_ids[b, s]``.

  Args:
    q: ``[B, T, N, Hq]`` float32 queries.
    k: ``[B, S, K, Hq]`` float32 keys; ``N % K == 0``.
    v: ``[B, S, K, H]`` float32 values.
    scale: multiplies q.k, a concrete number > 0 (usually ``1/sqrt(H)``).
    causal: mask keys after the query (slot order, T == S).
    precise_dims: trailing dims of q and k summed apart, 0..Hq; default None: ``Hq - H``.
    k_valid: optional ``[B, S]`` bool, False for padding keys.
    q_segment_ids, k_segment_ids: optional ``[B, T]`` / ``[B, S]`` int32 document ids (both or
      neither); a query sees keys of its own document.
    slopes: optional ``[N]`` ALiBi slopes, concrete (numpy or a list): the score gets
      ``-slopes[n] * (q_positions[b, t] - k_positions[b, s])`` after scaling (Press et al. 2022,
      arXiv 2108.12409).
    q_positions, k_positions: ``[B, T]`` / ``[B, S]`` int32 token indices, with ``slopes`` only.
    return_lse: also return the log-sum-exp of each row's scaled, biased scores.
    local_window_size, chunk_size, logits_soft_cap: the attention pattern of
      ``jaxpe.attention.attention`` on the slots ``0..T-1`` / ``0..S-1`` (``jaxpe.attention.patterns``;
      ``chunk_size`` with ``k_valid`` or segment ids is refused: chunks count from each row's first
      real token there, from slot 0 here):
      query block rows meet only the key range their window and chunk reach (O(T x window) work in
      both passes); the cap applies to the scaled scores before ALiBi and the mask, and its
      derivative ``1 - tanh^2`` to the backward pass. Not the cap with ``precise_dims > 0``.

  Returns:
    ``[B, T, N, H]`` float32; with ``return_lse`` also ``[B, T, N]`` float32 (``-inf`` on rows with
    no visible key; NaN on rows whose visible scores hold a NaN). Differentiable in q, k, v in
    reverse mode (``jax.grad``, ``jax.vjp``) and twice (grad of grad, ``jax.hessian``: the
    second derivatives are the XLA loops' at the kernel's values); ``jax.jvp`` raises jax's
    custom_vjp TypeError.

  Raises:
    RuntimeError: the kernel is not available (``unavailable_reason()`` says why).
    TypeError: q, k or v not float32 (or not arrays of numbers: lists of numbers are taken as numpy
      arrays); ``causal`` or ``return_lse`` not a bool (``"False"`` is not False); a traced
      ``scale`` or ``slopes``.
    ValueError: ranks or sizes that do not fit; a scratch too large for the machine (S named, see
      the module docstring: checked before any allocation); ``JAXPE_CPU_FLASH`` not an on/off
      value; ``scale`` not a finite number > 0; ``precise_dims``
      outside 0..Hq; ``causal`` with T != S; side arrays not ``[B, T]`` / ``[B, S]``; slopes not
      ``[N]`` or without both position arrays; one segment array without the other.
  """
  q, k, v = (_checks.as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
  for name, arr, hint in (("q", q, "[B, T, N, Hq]"), ("k", k, "[B, S, K, Hq]"), ("v", v, "[B, S, K, H]")):
    _checks.check_rank(name, arr, 4, hint)
    if jnp.result_type(arr) != jnp.float32:
      raise TypeError(f"{name} must be float32 for the CPU kernel, got {jnp.result_type(arr)}")
  scale = check_scale("scale", scale)
  causal = _checks.check_bool("causal", causal)
  return_lse = _checks.check_bool("return_lse", return_lse)
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if num_heads == 0 or num_kv == 0 or num_heads % num_kv:
    raise ValueError(
      f"q and k need N >= 1 heads and K >= 1 kv heads with N % K == 0, got N={num_heads}, K={num_kv}"
    )
  if k.shape[0] != batch or k.shape[3] != qk_dim or v.shape[:3] != k.shape[:3]:
    raise ValueError(
      f"q, k, v must be [B,T,N,Hq], [B,S,K,Hq], [B,S,K,H], got {q.shape}, {k.shape}, {v.shape}"
    )
  precise_dims = check_precise_dims(precise_dims, qk_dim, v.shape[-1])
  pattern = patterns.check_pattern(local_window_size, chunk_size, logits_soft_cap)
  patterns.check_cap_precise_dims(pattern, precise_dims)
  need, room = scratch_fits(t_len, s_len, qk_dim, v.shape[-1], precise_dims)
  _checks.check_fits(
    "k",
    need,
    room,
    f"S = {s_len} keys: the kernel's scratch ({os.cpu_count() or 1} threads x O(S))",
    "use blockwise_attention with block_q / block_k (the XLA loops hold O(block_q x block_k)), or fewer keys",
  )
  if causal and t_len != s_len:
    raise ValueError(f"causal needs T == S (self-attention in slot order), got T={t_len}, S={s_len}")
  if (q_segment_ids is None) != (k_segment_ids is None):
    raise ValueError("give q_segment_ids and k_segment_ids together, or neither")
  if pattern.chunk is not None and (k_valid is not None or q_segment_ids is not None):
    raise ValueError(
      "cpu_flash_attention cannot run chunk_size with k_valid or segment ids: the kernel counts chunks from "
      "slot 0, while each row's chunks start at its first real token and restart with each document (as "
      "transformers' create_chunked_causal_mask); use blockwise_attention or attention(implementation='xla')"
    )
  if (slopes is None) != (q_positions is None) or (slopes is None) != (k_positions is None):
    raise ValueError("ALiBi needs slopes, q_positions and k_positions together")
  side = []
  for name, arr, length in (
    ("q_positions", q_positions, t_len),
    ("k_positions", k_positions, s_len),
    ("q_segment_ids", q_segment_ids, t_len),
    ("k_segment_ids", k_segment_ids, s_len),
    ("k_valid", k_valid, s_len),
  ):
    side.append(_check_side(name, arr, (batch, length)))
  q_pos, k_pos, q_seg, k_seg, valid = side
  q_seg, k_seg = numerics.canonical_segment_ids(q_seg, k_seg)  # wide ids ranked jointly, exactly
  k, v = numerics.zero_hidden_keys(k, v, valid)  # padding keys (NaN too) never reach P.V or dS.K
  for name, pos in (("q_positions", q_pos), ("k_positions", k_pos)):
    if isinstance(pos, np.ndarray) and pos.size and (pos.min() < 0 or pos.max() >= 2**31):
      raise ValueError(f"{name} must be token indices in [0, 2^31), got values in [{pos.min()}, {pos.max()}]")
  side = [
    jnp.zeros((0,), jnp.bool_ if i == 4 else jnp.int32)
    if x is None
    else jnp.asarray(x, jnp.bool_ if i == 4 else jnp.int32)
    for i, x in enumerate((q_pos, k_pos, q_seg, k_seg, valid))
  ]
  if slopes is None:
    slope_arr = jnp.zeros((0,), jnp.float32)
  else:
    if isinstance(slopes, jax.core.Tracer):
      raise TypeError("slopes must be concrete (numpy or a list), not traced")
    slope_np = np.asarray(_checks.as_array("slopes", slopes), np.float32)
    if slope_np.shape != (num_heads,):
      raise ValueError(f"slopes must be [N] = [{num_heads}], got {slope_np.shape}")
    if not np.all(np.isfinite(slope_np)):
      raise ValueError(f"slopes must be finite, got {slope_np}")
    slope_arr = jnp.asarray(slope_np)
  if not available():
    raise RuntimeError(f"the CPU attention kernel is not available: {unavailable_reason()}")
  left, right = (-1, -1) if pattern.window is None else (min(x, patterns.UNBOUNDED) for x in pattern.window)
  mask = (bool(causal), int(left), int(right), int(pattern.chunk or 0), float(pattern.cap or 0.0))
  attrs = (float(scale), mask, int(precise_dims))
  out, lse = _attention(q, k, v, (*side, slope_arr), attrs)
  return (out, lse) if return_lse else out


def _check_side(name: str, arr, shape):
  """A side array as given (numpy stays numpy), checked: shape ``[B, T]`` / ``[B, S]``, integers
  (``k_valid``: bool or integers)."""
  if arr is None:
    return None
  arr = _checks.as_array(name, arr)  # lists become numpy; strings, ragged lists: ArgTypeError
  dtype = np.dtype(arr.dtype)
  ok = np.issubdtype(dtype, np.integer) or (name == "k_valid" and dtype == np.bool_)
  if not ok:
    kind = "a bool or integer" if name == "k_valid" else "an integer"
    raise TypeError(f"{name} must be {kind} array, got {dtype}")
  if tuple(arr.shape) != shape:
    raise ValueError(
      f"{name} must have shape [B, {'T' if name[0] == 'q' else 'S'}] = {list(shape)}, got {tuple(arr.shape)}"
    )
  return arr


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, side, attrs):
  """(out, lse) by the forward kernel, the gradients by the backward kernel."""
  return _forward_kernel(q, k, v, side, attrs)


def _attention_fwd(q, k, v, side, attrs):
  out, lse = _forward_kernel(q, k, v, side, attrs)
  return (out, lse), (q, k, v, side, out, lse)


def _attention_bwd(attrs, residuals, cotangents):
  q, k, v, side, out, lse = residuals
  d_out, d_lse = cotangents
  d_lse = jnp.zeros(lse.shape, jnp.float32) if d_lse is None else d_lse.astype(jnp.float32)
  dq, dk, dv = _backward_kernel(q, k, v, side, out, lse, d_out.astype(jnp.float32), d_lse, attrs)
  return dq, dk, dv, jax.tree.map(lambda _: None, side)


_attention.defvjp(_attention_fwd, _attention_bwd)

# Second derivatives (grad of grad, and jax.hessian: forward over reverse) differentiate the two
# kernel calls above; their derivatives come from the same computations in plain XLA
# (``online_softmax``'s forward and backward, which jax differentiates in either mode): the kernels
# give the values, XLA the tangents.


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _forward_kernel(q, k, v, side, attrs):
  return call.batchable("forward", attrs, call.layout(q, k, side))(q, k, v, *side)


@_forward_kernel.defjvp
def _forward_kernel_jvp(attrs, primals, tangents):
  q, k, v, side = primals
  xla = lambda q, k, v: _xla_forward(q, k, v, side, attrs)  # noqa: E731
  return _forward_kernel(*primals, attrs), jax.jvp(xla, (q, k, v), tuple(tangents[:3]))[1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(8,))
def _backward_kernel(q, k, v, side, out, lse, d_out, d_lse, attrs):
  return call.batchable("backward", attrs, call.layout(q, k, side))(q, k, v, *side, out, lse, d_out, d_lse)


@_backward_kernel.defjvp
def _backward_kernel_jvp(attrs, primals, tangents):
  q, k, v, side, out, lse, d_out, d_lse = primals
  dense = (0, 1, 2, 4, 5, 6, 7)  # the float arguments (side holds integers and the slopes)
  xla = lambda q, k, v, out, lse, d_out, d_lse: _xla_grads(q, k, v, side, out, lse, d_out, d_lse, attrs)  # noqa: E731
  tangent = jax.jvp(xla, tuple(primals[i] for i in dense), tuple(tangents[i] for i in dense))[1]
  return _backward_kernel(*primals, attrs), tangent


def _xla_args(q, k, v, side, attrs):
  """``online_softmax``'s arguments for the kernel's: (k .. k_pos), the slopes, the Config."""
  scale, (causal, left, right, chunk, cap), precise = attrs
  window = (
    None if left < 0 and right < 0 else tuple(patterns.UNBOUNDED if x < 0 else x for x in (left, right))
  )
  pattern = patterns.Pattern(window, chunk or None, cap or None)
  batch, t_len, s_len = q.shape[0], q.shape[1], k.shape[1]
  q_pos, k_pos, q_seg, k_seg, valid, slopes = (None if x.shape == (0,) else x for x in side)
  if slopes is not None:  # online_softmax takes them per kv head: [K, G]
    slopes = slopes.reshape(k.shape[2], q.shape[2] // k.shape[2])
  qi = ki = None
  if causal or pattern.masks:
    qi = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
    ki = jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32), (batch, s_len))
  natural = causal or (pattern.masks and t_len == s_len)
  cfg = online_softmax.Config(
    scale, precise, 32, 32, causal, natural, None, pattern if pattern.active else None
  )
  return (k, v, qi, ki, valid, q_seg, k_seg, q_pos, k_pos), slopes, cfg


def _xla_forward(q, k, v, side, attrs):
  """The forward kernel's (out, lse) in plain XLA (``online_softmax.flash_fwd``; chunks count slots:
  the kernel is refused chunks with padding or segments, so no chunk positions)."""
  args, slopes, cfg = _xla_args(q, k, v, side, attrs)
  return online_softmax.flash_fwd(q, *args, None, None, slopes, None, cfg)[0]


def _xla_grads(q, k, v, side, out, lse, d_out, d_lse, attrs):
  """The backward kernel's (dq, dk, dv) in plain XLA (``online_softmax.flash_bwd``; its residuals
  as ``flash_fwd`` saves them, no chunk positions)."""
  args, slopes, cfg = _xla_args(q, k, v, side, attrs)
  return online_softmax.flash_bwd(cfg, (q, *args, None, slopes, None, out, lse), (d_out, d_lse))[:3]


__all__ = [
  "BLOCK_Q",
  "MEMORY_FRACTION",
  "SOURCE",
  "available",
  "check_settings",
  "cpu_flash_attention",
  "scratch_fits",
  "unavailable_reason",
  "workspace_bytes",
]
