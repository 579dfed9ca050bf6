"""The ``pallas_gpu`` backend: jax's Triton flash attention (``jax.experimental.pallas.ops.gpu``).

GPU; ``interpret=True`` runs it on CPU. Head dims are padded to a power of two, T to whole blocks
(``jaxpe.attention.backends.kernel_length``); the kernel has no grouped-query heads, so the kv
heads are repeated.

Shape alphabet: B batch, T query positions, N heads, K kv heads, D kernel head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.attention.masks import AttentionMask, kernel_segment_ids

FORWARD_BLOCK = 128
"""Forward block_q = block_k for head dims up to 128."""


def forward_block(dim: int, itemsize: int = 2) -> int:
  """Forward block_q = block_k for the kernel's head dim ``dim`` (a power of two) and operand bytes
  ``itemsize`` (2: bf16 / float16, 4: float32): 128 up to 128 x 2 bytes of a row, then halved as a
  row's bytes double (64 at bf16 H 256 or float32 H 128, 32 at bf16 H 512), so the blocks' shared
  memory (two pipeline stages of q, k and v blocks) stays what bf16 H 128 needs: 128-row blocks of
  bf16 H 256 exceed an H100's 227 KiB per block ("requested 328192, available: 232448"), as do those
  of float32 H 128 ("requested 262656"; the deviceless H100 compiles of
  ``benchmarks/lowering_check.py``)."""
  return max(16, FORWARD_BLOCK * 256 // max(dim * itemsize, 256))


def attend(q, k, v, mask: AttentionMask, *, scale: float, interpret: bool) -> jax.Array:
  """Self-attention ``[B, T, N, D]`` of q ``[B, T, N, D]``, k, v ``[B, T, K, D]``, T from ``kernel_length``."""
  # jax's Triton kernel mixes int32 and Python ints in its causal loop bound: under
  # jax_enable_x64 those become int64 and lax.div refuses them. Every operand here is 32-bit.
  with jax.enable_x64(False):
    return _mha(q, k, v, mask, scale=scale, interpret=interpret)


def _mha(q, k, v, mask: AttentionMask, *, scale, interpret):
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # heavy, GPU-specific: on first use

  batch, t_len, num_heads, dim = q.shape
  # attention() pads T to kernel_length: a power of two or a multiple of 128. Past H 128 (H 256, or
  # H 128 widened by the ALiBi emulation and padded to 256) 128-row blocks of q, k and v overflow an
  # H100's shared memory (XLA: "requested 328192, available: 232448"): 64-row blocks there.
  block = min(forward_block(dim, jnp.dtype(q.dtype).itemsize), t_len)
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
    kernel_segment_ids(mask, batch, t_len),
    sm_scale=scale,
    causal=mask.causal,
    block_sizes=sizes,
    interpret=interpret,
  )
