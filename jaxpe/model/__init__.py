"""The Flax NNX decoder: its configuration, the decoder, the encodings it composes, generation."""

from jaxpe.model.decoder import (
  MLP,
  Attention,
  Block,
  Decoder,
  KVCache,
  LayerNorm,
  emulation_theta,
  init_cache,
  stack_blocks,
  to_loop_layout,
  to_scan_layout,
)

__all__ = [
  "Attention",
  "Block",
  "Decoder",
  "KVCache",
  "LayerNorm",
  "MLP",
  "emulation_theta",
  "init_cache",
  "stack_blocks",
  "to_loop_layout",
  "to_scan_layout",
]
