"""``pos_encoding='xpos'``: RoPE with an exponential decay of the scores with distance (Sun et al.
2022, "A Length-Extrapolatable Transformer", arXiv 2212.10554; ``jaxpe.ops.xpos``)."""

from __future__ import annotations

import jax

from jaxpe.attention.rope_spec import RopeSpec
from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import xpos


@register("xpos")
class XPos(PositionalEncoding):
  """Rotates and scales q (``zeta ** p``) and k (``zeta ** -p``) at ``cfg.rope_frequencies()``;
  positions are offset by ``max_len // 2`` for both."""

  def encode_qk(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = self.cfg
    inv_freq, factor = cfg.rope_frequencies()
    # The same offset for queries and keys cancels in q.k and keeps zeta ** (p / scale_base) finite
    # in float32 for |p - offset| up to ~35,000 (config: max_len <= 65536).
    kw = dict(inv_freq=inv_freq, layout=cfg.rope_layout, attention_factor=factor, offset=cfg.max_len // 2)
    return xpos.apply_xpos(q, positions, kind="query", **kw), xpos.apply_xpos(k, positions, kind="key", **kw)

  def rope_spec(self, positions: jax.Array, kv_positions: jax.Array) -> RopeSpec:
    cfg = self.cfg
    inv_freq, factor = cfg.rope_frequencies()
    return RopeSpec(
      inv_freq,
      positions,
      kv_positions,
      layout=cfg.rope_layout,
      attention_factor=factor,
      xpos_scale_base=512.0,  # apply_xpos's defaults, as encode_qk
      xpos_gamma=0.4,
      xpos_offset=cfg.max_len // 2,
    )
