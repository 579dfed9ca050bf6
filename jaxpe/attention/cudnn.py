"""The ``cudnn`` backend: cuDNN flash attention through ``jax.nn.dot_product_attention`` (NVIDIA GPU).

q, k, v go in as bf16 (float16 when the values are float16), head dims up to
``CUDNN_MAX_HEAD_DIM`` in multiples of 8 (``jaxpe.attention.fused`` prepares them). No segment ids:
padding and packing go in as a dense mask.

Shape alphabet: B batch, T query positions, N heads, K kv heads, D kernel head dim.
"""

from __future__ import annotations

import jax

from jaxpe.attention.masks import AttentionMask, kernel_segment_ids


def attend(q, k, v, mask: AttentionMask, *, scale: float, interpret: bool = False) -> jax.Array:
  """Self-attention ``[B, T, N, D]`` of q ``[B, T, N, D]``, k, v ``[B, T, K, D]`` (cuDNN; no interpret mode).

  cuDNN has no segment ids here: padding/packing go in as a dense ``[B, 1, T, S]`` mask (O(T^2))
  built from the same ids as the Pallas kernels' (padding tokens see each other), so no query row is
  fully masked (cuDNN gives NaN there, e.g. left padding under causality); ``attention`` zeroes the
  padding rows.
  """
  del interpret  # the GPU kernel only (resolve_backend refuses cudnn elsewhere)
  ids = kernel_segment_ids(mask, q.shape[0], q.shape[1])
  dense = None if ids is None else ids[:, None, :, None] == ids[:, None, None, :]
  return jax.nn.dot_product_attention(
    q, k, v, mask=dense, scale=scale, is_causal=mask.causal, implementation="cudnn"
  )
