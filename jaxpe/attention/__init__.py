"""Attention: the reference (dense) attention and its masks, and the kernel backends behind one
``attention(..., impl=)``. Pure JAX, Flax-free."""

from jaxpe.attention.kernels import (
  BACKENDS,
  CUDNN_MAX_HEAD_DIM,
  HEAD_DIM_MULTIPLE,
  IMPLEMENTATIONS,
  XLA_CAUSAL_BLOCK,
  AlibiSpec,
  Backend,
  attention,
  available_backends,
  emulation_dim_count,
  kernel_length,
  padded_head_dim,
  platform_backends,
  resolve_backend,
)
from jaxpe.attention.masks import document_mask
from jaxpe.attention.reference import (
  AttentionMask,
  check_causal,
  check_scale,
  check_segment_ids,
  check_valid,
  dense_segment_ids,
  dot_product_attention,
  make_attention_mask,
)

__all__ = [
  "AlibiSpec",
  "AttentionMask",
  "BACKENDS",
  "Backend",
  "CUDNN_MAX_HEAD_DIM",
  "HEAD_DIM_MULTIPLE",
  "IMPLEMENTATIONS",
  "XLA_CAUSAL_BLOCK",
  "attention",
  "available_backends",
  "check_causal",
  "check_scale",
  "check_segment_ids",
  "check_valid",
  "dense_segment_ids",
  "document_mask",
  "dot_product_attention",
  "emulation_dim_count",
  "kernel_length",
  "make_attention_mask",
  "padded_head_dim",
  "platform_backends",
  "resolve_backend",
]
