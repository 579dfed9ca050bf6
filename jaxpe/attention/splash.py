"""The ``splash`` backend: TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``).

TPU; ``interpret=True`` runs it on CPU for tests. The kernel has no scale argument: q comes
pre-scaled (``jaxpe.attention.fused``); T is padded to a multiple of 128 (``kernel_length``).

Shape alphabet: B batch, T query positions, N heads, K kv heads, D kernel head dim.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jaxpe.attention.masks import AttentionMask, kernel_segment_ids
from jaxpe.attention.patterns import Pattern


def head_mask(t_len: int, causal: bool, pattern: Pattern | None):
  """splash's mask of one head for T = ``t_len``: causal or full, and the local window
  (``LocalMask``) and causal chunks (``ChunkedCausalMask``) of ``pattern``.

  Raises:
    ValueError: ``chunk_size`` without a causal mask (splash's chunked mask is causal).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  shape = (t_len, t_len)
  out = masks.CausalMask(shape) if causal else masks.FullMask(shape)
  if pattern is not None and pattern.window is not None:
    left, right = (None if x >= t_len else x for x in pattern.window)  # None: no limit on that side
    if causal:
      right = 0
    if (left, right) != (None, None):
      out = out & masks.LocalMask(shape, window_size=(left, right), offset=0)
  if pattern is not None and pattern.chunk is not None and pattern.chunk < t_len:
    if not causal:
      raise ValueError(
        "attention implementation 'splash' runs chunk_size with a causal mask only (its ChunkedCausalMask); "
        "implementation='xla' runs non-causal chunks"
      )
    out = out & masks.ChunkedCausalMask(shape, chunk_size=pattern.chunk)
  return out


@contextlib.contextmanager
def _no_concrete_mesh():
  """While active, no concrete mesh is set (``jax.set_mesh``'s thread-local device context is
  empty), also inside a trace, where ``jax.set_mesh(None)`` is refused. ``make_splash_mha`` builds its
  mask tables with ``jnp.array``, which places them on the concrete mesh's devices: under
  ``jax.set_mesh(<a mesh of compile-only devices>)`` (``jaxpe-compile``, deviceless AOT) that failed
  with "'Executable' object has no attribute 'local_devices'" (issue 45). The tables are constants of
  the kernel, the same on every device. Uses jax's private ``config.device_context`` (what
  ``jax.set_mesh`` swaps)."""
  from jax._src import config as jax_config  # noqa: PLC0415
  from jax._src import mesh as mesh_lib  # noqa: PLC0415

  previous = jax_config.device_context.swap_local(mesh_lib.empty_concrete_mesh)
  try:
    yield
  finally:
    jax_config.device_context.set_local(previous)


@functools.lru_cache(maxsize=32)
def _splash_kernel(t_len: int, num_heads: int, causal: bool, interpret: bool, pattern: Pattern | None = None):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # heavy, TPU-specific: on first use

  mask = head_mask(t_len, causal, pattern)
  cap = None if pattern is None else pattern.cap
  # the mask tables are constants, also when first built under jit, and on no mesh's devices
  with jax.ensure_compile_time_eval(), _no_concrete_mesh():
    return splash.make_splash_mha(
      splash.MultiHeadMask([mask] * num_heads),
      head_shards=1,
      q_seq_shards=1,
      interpret=interpret,
      attn_logits_soft_cap=cap,
    )


def attend(
  q, k, v, mask: AttentionMask, *, scale: float, interpret: bool, sinks=None, pattern: Pattern | None = None
) -> jax.Array:
  """Self-attention ``[B, T, N, D]`` of pre-scaled q ``[B, T, N, D]``, k, v ``[B, T, K, D]``.

  ``scale`` is not used: q is already scaled (the kernel has none). ``sinks``: optional ``[N]``
  float sink logits, the kernel's own ``sinks`` argument (the same for every batch row).
  ``pattern``: the local window and causal chunks as splash's ``LocalMask`` / ``ChunkedCausalMask``
  (its block tables skip the blocks they hide), the soft cap as its ``attn_logits_soft_cap`` (on the
  pre-scaled q.k, i.e. the scaled scores).
  """
  # jax's splash kernel mixes int32 and Python ints in its index maps: under jax_enable_x64 those
  # become int64 and its _div refuses them. Every operand here is 32-bit (as in pallas_gpu).
  with jax.enable_x64(False):
    return _mha(q, k, v, mask, interpret=interpret, sinks=sinks, pattern=pattern)


def _mha(q, k, v, mask: AttentionMask, *, interpret: bool, sinks, pattern=None):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # heavy, TPU-specific: on first use

  batch, t_len, num_heads, _ = q.shape
  # attention() pads T to a multiple of 128 (kernel_length)
  kernel = _splash_kernel(t_len, num_heads, mask.causal, interpret, pattern)
  ids = kernel_segment_ids(mask, batch, t_len)
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, N, H] <-> [B, N, T, H]
  if ids is None:
    out = jax.vmap(lambda q1, k1, v1: kernel(q1, k1, v1, sinks=sinks))(swap(q), swap(k), swap(v))
  else:
    out = jax.vmap(
      lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1), sinks=sinks)
    )(swap(q), swap(k), swap(v), ids)
  return swap(out)
