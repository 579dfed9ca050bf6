"""Attention, pure JAX and Flax-free: the dense reference attention and its masks, and the kernel
backends behind one ``attention(..., implementation=)``.

Modules, in import order (each imports only the ones before it, ``jaxpe.emulation`` and
``jaxpe.ops``):

- ``masks``: ``AttentionMask``, ``dense_attention_mask``, ``document_mask`` and the mask checks.
- ``numerics``: the numeric rules every backend shares (hidden keys zeroed, a NaN row is not an
  empty row, wide document ids ranked, never cast).
- ``patterns``: the attention patterns (``local_window_size``, ``chunk_size``, ``logits_soft_cap``):
  their checks, masks, the soft cap, which block pairs they need, which backends run them.
- ``reference``: ``dot_product_attention``, the dense reference (einsum, float32 logits).
- ``platforms``: choices made for the platform a program is lowered for (``per_platform`` through
  ``jax.lax.platform_dependent``; ``refused``: a value that raises when lowered for a platform that
  cannot compute it; ``one_platform``).
- ``backends``: the backend names, what each needs, which run on each platform; ``AlibiSpec``.
- ``sinks``: attention sinks (a learned logit per head in the softmax denominator), from the lse or
  as one more key slot.
- ``position_bias``: ``PositionBias``, a learned bias from positions (T5, Kerple, FIRE; ``xla`` only).
- ``native``: building and loading jaxpe's C++ kernels for XLA's FFI (compiled on first use, cached).
- ``cpu_flash``: ``cpu_flash_attention``, a fused float32 attention kernel for the CPU (C++
  through XLA's FFI, built on first use); ``blockwise`` runs it on the CPU where it applies. Its
  two XLA calls, sharded and batchable, are ``cpu_flash_call``.
- ``blockwise``: ``blockwise_attention``, FlashAttention's online softmax in plain XLA (O(T) memory),
  the ``xla`` backend's path; ``combine_partials`` merges attentions over disjoint key sets. Its
  kernel (the forward and backward loops, a ``custom_vjp``) is ``online_softmax``, its block-pair
  loops (the static band a window reaches, guarded steps) ``block_loops``.
- ``decode``: ``decode_attention``, a few queries (KV-cache decoding) against every cache slot in one
  pass (the ``xla`` backend's path for an ``IndexMask`` of few queries).
- ``rope_spec``: ``RopeSpec``, RoPE (any scaling, xPos) as arrays for ``attention(rope_spec=...)``.
- ``xla``, ``cudnn``, ``splash``, ``pallas_gpu``: one module per backend.
- ``flash`` (with ``flash_kernels``: Triton, ``flash_tpu``: Mosaic): jaxpe's own Pallas flash attention,
  RoPE and ALiBi inside.
- ``fused``: q, k, v prepared for a fused kernel (the bias-free ALiBi emulation, segment ids).
- ``kernels``: ``attention``, the one entry point (checks, then a backend).
- ``emulated``: ``emulated_alibi_attention``, RoPE-emulated ALiBi through ``attention``.
"""

from jaxpe.attention.backends import (
  BACKENDS,
  CUDNN_MAX_HEAD_DIM,
  HEAD_DIM_MULTIPLE,
  IMPLEMENTATIONS,
  AlibiSpec,
  Backend,
  available_backends,
  emulation_dim_count,
  kernel_length,
  padded_head_dim,
  platform_backends,
  resolve_backend,
)
from jaxpe.attention.blockwise import blockwise_attention, combine_partials
from jaxpe.attention.cpu_flash import cpu_flash_attention
from jaxpe.attention.decode import decode_attention
from jaxpe.attention.emulated import emulated_alibi_attention
from jaxpe.attention.kernels import attention
from jaxpe.attention.masks import (
  AttentionMask,
  IndexMask,
  check_causal,
  check_segment_ids,
  check_valid,
  dense_attention_mask,
  dense_segment_ids,
  document_mask,
  make_attention_mask,
)
from jaxpe.attention.position_bias import PositionBias
from jaxpe.attention.reference import check_scale, dot_product_attention
from jaxpe.attention.rope_spec import RopeSpec
from jaxpe.attention.xla import XLA_CAUSAL_BLOCK

__all__ = [
  "AlibiSpec",
  "AttentionMask",
  "BACKENDS",
  "Backend",
  "CUDNN_MAX_HEAD_DIM",
  "HEAD_DIM_MULTIPLE",
  "IndexMask",
  "IMPLEMENTATIONS",
  "PositionBias",
  "RopeSpec",
  "XLA_CAUSAL_BLOCK",
  "attention",
  "available_backends",
  "blockwise_attention",
  "decode_attention",
  "check_causal",
  "check_scale",
  "check_segment_ids",
  "check_valid",
  "combine_partials",
  "cpu_flash_attention",
  "dense_attention_mask",
  "dense_segment_ids",
  "document_mask",
  "dot_product_attention",
  "emulated_alibi_attention",
  "emulation_dim_count",
  "kernel_length",
  "make_attention_mask",
  "padded_head_dim",
  "platform_backends",
  "resolve_backend",
]
