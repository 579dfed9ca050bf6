"""``pos_encoding='none'``: no positional encoding (NoPE); the causal mask alone orders the tokens.

Source: Haviv et al. 2022, "Transformer Language Models without Positional Encodings Still Learn
Positional Information" (arXiv 2203.16634); Kazemnejad et al. 2023 (arXiv 2305.19466).
"""

from __future__ import annotations

from jaxpe.model.encodings.base import PositionalEncoding, register


@register("none")
class NoPositions(PositionalEncoding):
  """Every hook's default: nothing added, rotated or biased."""
