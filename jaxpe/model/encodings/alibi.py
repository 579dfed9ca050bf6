"""``pos_encoding='alibi'``: attention with linear biases (Press et al., arXiv 2108.12409), the
first ``alibi_heads`` heads only when set. The bias reaches the backend as an ``AlibiSpec``: the
xla reference adds it; bias-free kernels run it through the emulation ``alibi_emulation`` names.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpe.attention.kernels import AlibiSpec
from jaxpe.model.encodings.base import PositionalEncoding, emulation_theta, register
from jaxpe.ops import alibi


@register("alibi")
class Alibi(PositionalEncoding):
  """Slopes of an ``alibi_heads``-head model (default N) on the first heads, 0 on the rest."""

  def alibi_spec(self, positions: jax.Array, kv_positions: jax.Array) -> AlibiSpec:
    cfg = self.cfg
    n_alibi = cfg.alibi_heads or cfg.num_heads
    slopes = alibi.alibi_slopes_f64(n_alibi)
    return AlibiSpec(
      slopes=np.pad(slopes, (0, cfg.num_heads - n_alibi)),
      q_positions=positions,
      k_positions=kv_positions,
      # positions are < max(T, max_len) unless given explicitly; the lean and exact forms' two base-256
      # digits cover every position below 65536 whatever the model's lengths
      max_position=max(
        65536, cfg.max_len, cfg.rope_alibi_context or 0, positions.shape[1], kv_positions.shape[1]
      ),
      form=cfg.alibi_emulation,
      order=cfg.rope_alibi_order,
      theta=emulation_theta(cfg),
    )
