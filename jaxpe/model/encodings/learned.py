"""``pos_encoding='learned'``: an absolute position table ``[max_len, D]`` added to the token
embeddings (GPT-2, Radford et al. 2019)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.model import initializers
from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import checks as _checks


@register("learned")
class LearnedPositions(PositionalEncoding):
  """The Decoder's ``pos_embed`` (``nnx.Embed``, embedding ``[max_len, D]``, logical names ``(pos,
  embed)``, init Normal(0, ``init_std``)), looked up at each token's position."""

  def params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    cfg = self.cfg
    pos_embed = nnx.Embed(
      cfg.max_len,
      cfg.d_model,
      dtype=cfg.dtype,
      embedding_init=initializers.normal(cfg.init_std, ("pos", "embed")),
      rngs=rngs,
    )
    return {"pos_embed": pos_embed}

  def embed_inputs(self, model: nnx.Module, x: jax.Array, positions: jax.Array) -> jax.Array:
    """``x + pos_embed[positions]``.

    Raises:
      ValueError: T or a concrete position beyond ``max_len``. Under ``jax.jit`` a position outside
        ``[0, max_len)`` embeds as NaN (never another row of the table).
    """
    cfg = self.cfg
    t_len = positions.shape[1]
    if t_len > cfg.max_len:
      raise ValueError(f"sequence length {t_len} exceeds max_len={cfg.max_len} of the learned position table")
    _checks.check_index_range("positions", positions, cfg.max_len, "max_len (learned position table)")
    # A traced position outside [0, max_len) embeds as NaN (jnp.take's fill mode): negative ones
    # would otherwise wrap to max_len + p.
    return x + model.pos_embed(jnp.where(positions < 0, cfg.max_len, positions))
