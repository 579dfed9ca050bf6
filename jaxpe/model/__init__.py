# ruff: noqa: E402  (the extra is checked before the imports that need it)
"""The Flax NNX decoder: its configuration (``config``), layers (``layers``), the decoder
(``decoder``), its KV cache (``cache``), the positional encodings it composes (``encodings``, one
module per family) and generation (``generate``). Needs the ``model`` extra (flax, pydantic, ruamel.yaml): without it the
import fails naming it (``jaxpe.errors.MissingExtraError``)."""

from jaxpe.errors import require_extra

require_extra("model", "jaxpe.model")

from jaxpe.model.cache import KVCache, init_cache
from jaxpe.model.decoder import Decoder, stack_blocks, to_loop_layout, to_scan_layout
from jaxpe.model.encodings import emulation_theta
from jaxpe.model.layers import MLP, Attention, Block, LayerNorm, gelu

__all__ = [
  "Attention",
  "Block",
  "Decoder",
  "KVCache",
  "LayerNorm",
  "MLP",
  "emulation_theta",
  "gelu",
  "init_cache",
  "stack_blocks",
  "to_loop_layout",
  "to_scan_layout",
]
