"""The ``pallas_gpu`` backend: jax's Triton flash attention (``jax.experimental.pallas.ops.gpu``).

GPU; ``interpret=True`` runs it on CPU. Head dims are padded to a power of two, T to whole blocks
(``jaxpe.attention.backends.kernel_length``); the kernel has no grouped-query heads, so the kv
heads are repeated.

Shape alphabet: B batch, T query positions, N heads, K kv heads, D kernel head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.attention import gpu_cards
from jaxpe.attention.masks import AttentionMask, kernel_segment_ids

FORWARD_BLOCK = 128
"""Forward block_q = block_k at most (and what head dims up to 128 in bf16 get)."""

BACKWARD_BLOCK = 32
"""Backward (dq and dk/dv kernels) block sizes at most: jax's Triton defaults."""

FORWARD_ROW_COPIES = 4
"""Row copies of q, k and v blocks ``forward_block`` counts per block row of jax's Triton forward
(two pipeline stages of k and v; q once; Triton's scratch in what that leaves)."""


def forward_block(dim: int, itemsize: int = 2, budget: int | None = None, cap: int = FORWARD_BLOCK) -> int:
  """Forward block_q = block_k for the kernel's head dim ``dim`` (a power of two) and operand bytes
  ``itemsize`` (2: bf16 / float16, 4: float32): the largest power of two <= ``cap`` (and >= 16)
  whose ``FORWARD_ROW_COPIES`` rows of ``dim * itemsize`` bytes (+ 512) fit ``budget`` bytes of shared
  memory, by default the card's (``gpu_cards.shared_memory()``: 232448 on an H100, 166912 on an
  A100, 101376 on an L4). Triton asked, at 128 rows (the deviceless compiles of
  ``benchmarks/lowering_check.py``, XLA's "requested ..."): bf16 H 128 98816 (counted 131072),
  bf16 H 256 229888 (262144), float32 H 128 197120 (262144). So 128 rows at bf16 H 128, 64 at bf16
  H 256 or float32 H 128 on an H100 and an A100; 64 at bf16 H 128 on an L4. The backward's blocks
  (``cap=BACKWARD_BLOCK``) likewise: float32 H 256 with ALiBi (the head padded to 512) asked 262528
  bytes at 32 rows (counted 262656), over an H100's and an A100's, so 16 there."""
  if budget is None:
    budget = gpu_cards.shared_memory()
  block = FORWARD_BLOCK
  while block > 16 and FORWARD_ROW_COPIES * block * dim * itemsize + 512 > budget:
    block //= 2
  return block


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
  # H 128 widened by the ALiBi emulation and padded to 256) 128-row blocks of q, k and v overflow the
  # card's shared memory (forward_block: the card's limit, gpu_cards).
  itemsize = jnp.dtype(q.dtype).itemsize
  block = min(forward_block(dim, itemsize), t_len)
  back = min(forward_block(dim, itemsize, cap=BACKWARD_BLOCK), t_len)
  if k.shape[2] != num_heads:  # the kernel has no grouped-query heads
    k = jnp.repeat(k, num_heads // k.shape[2], axis=2)
    v = jnp.repeat(v, num_heads // v.shape[2], axis=2)
  sizes = gpu_attention.BlockSizes(
    block_q=block,
    block_k=block,
    block_q_dkv=back,
    block_kv_dkv=back,
    block_q_dq=back,
    block_kv_dq=back,
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
