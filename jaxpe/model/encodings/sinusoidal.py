"""``pos_encoding='sinusoidal'``: the fixed sinusoids of Vaswani et al. (arXiv 1706.03762, section
3.4) added to the token embeddings (``jaxpe.ops.sinusoidal``)."""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import sinusoidal


@register("sinusoidal")
class Sinusoidal(PositionalEncoding):
  """As Vaswani et al. and fairseq's ``TransformerEncoder``: token embeddings initialised with std
  ``D ** -0.5`` and multiplied by ``sqrt(D)`` (unit scale, like the sinusoids), so neither drowns
  the other."""

  def token_embed_std(self) -> float:
    return self.cfg.d_model**-0.5

  def embed_inputs(self, model: nnx.Module, x: jax.Array, positions: jax.Array) -> jax.Array:
    """``x * sqrt(D) + sinusoidal_embedding(positions)`` in ``x``'s dtype."""
    d = self.cfg.d_model
    return x * math.sqrt(d) + sinusoidal.sinusoidal_embedding(positions, d_model=d, dtype=x.dtype)
