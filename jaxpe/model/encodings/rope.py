"""``pos_encoding='rope'``: rotary position embedding of queries and keys (Su et al., arXiv
2104.09864), with ``rope_scaling`` (HF's types), ``rotary_dim`` (partial rotation) and
``rope_layout`` (``jaxpe.ops.rope``, ``jaxpe.ops.rope_scaling``)."""

from __future__ import annotations

import jax

from jaxpe.attention.rope_spec import RopeSpec
from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import rope


@register("rope")
class Rope(PositionalEncoding):
  """Rotates q and k by ``positions`` at ``cfg.rope_frequencies()`` (the scaled inverse frequencies
  of the first ``rotary_dim`` dims and HF's attention factor as the rotation's scale); keys are
  cached rotated."""

  def encode_qk(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = self.cfg
    inv_freq, factor = cfg.rope_frequencies()  # rope_scaling + rotary_dim
    kw = dict(inv_freq=inv_freq, layout=cfg.rope_layout, attention_factor=factor)
    return rope.apply_rope(q, positions, **kw), rope.apply_rope(k, positions, **kw)

  def rope_spec(self, positions: jax.Array, kv_positions: jax.Array) -> RopeSpec:
    inv_freq, factor = self.cfg.rope_frequencies()
    return RopeSpec(inv_freq, positions, kv_positions, layout=self.cfg.rope_layout, attention_factor=factor)
