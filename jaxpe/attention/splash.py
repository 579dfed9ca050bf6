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
def _splash_kernel(t_len: int, num_heads: int, causal: bool, interpret: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # heavy, TPU-specific: on first use

  head_mask = splash.CausalMask((t_len, t_len)) if causal else splash.FullMask((t_len, t_len))
  # the mask tables are constants, also when first built under jit, and on no mesh's devices
  with jax.ensure_compile_time_eval(), _no_concrete_mesh():
    return splash.make_splash_mha(
      splash.MultiHeadMask([head_mask] * num_heads), head_shards=1, q_seq_shards=1, interpret=interpret
    )


def attend(q, k, v, mask: AttentionMask, *, scale: float, interpret: bool, sinks=None) -> jax.Array:
  """Self-attention ``[B, T, N, D]`` of pre-scaled q ``[B, T, N, D]``, k, v ``[B, T, K, D]``.

  ``scale`` is not used: q is already scaled (the kernel has none). ``sinks``: optional ``[N]``
  float sink logits, the kernel's own ``sinks`` argument (the same for every batch row).
  """
  # jax's splash kernel mixes int32 and Python ints in its index maps: under jax_enable_x64 those
  # become int64 and its _div refuses them. Every operand here is 32-bit (as in pallas_gpu).
  with jax.enable_x64(False):
    return _mha(q, k, v, mask, interpret=interpret, sinks=sinks)


def _mha(q, k, v, mask: AttentionMask, *, interpret: bool, sinks):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # heavy, TPU-specific: on first use

  batch, t_len, num_heads, _ = q.shape
  # attention() pads T to a multiple of 128 (kernel_length)
  kernel = _splash_kernel(t_len, num_heads, mask.causal, interpret)
  ids = kernel_segment_ids(mask, batch, t_len)
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, N, H] <-> [B, N, T, H]
  if ids is None:
    out = jax.vmap(lambda q1, k1, v1: kernel(q1, k1, v1, sinks=sinks))(swap(q), swap(k), swap(v))
  else:
    out = jax.vmap(
      lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1), sinks=sinks)
    )(swap(q), swap(k), swap(v), ids)
  return swap(out)
