"""``pos_encoding='t5'``: T5's bucketed relative attention bias (Raffel et al., arXiv 1910.10683),
causal (T5's decoder: ``bidirectional=False``).

One learned table ``relative_attention_bias [num_buckets, N]`` on the ``Decoder``, shared by every
layer, as in T5 (its first layer computes the bias and the others reuse it). Initialised
Normal(0, ``d_model ** -0.5``) as HF's ``T5PreTrainedModel._init_weights``. The bias reaches the
attention as a ``PositionBias`` (``xla`` backend only: blockwise, per block pair).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from jaxpe.attention.position_bias import PositionBias
from jaxpe.model import initializers
from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import relative_bias


def _t5_fn(params, q_positions, k_positions, *, max_distance: int):
  return relative_bias.t5_bias(
    params["table"], q_positions, k_positions, bidirectional=False, max_distance=max_distance
  )


@register("t5")
class T5Bias(PositionalEncoding):
  """``table[bucket(j - i)]`` per head (``relative_attention_num_buckets``,
  ``relative_attention_max_distance``), added to every layer's scores."""

  def params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module | nnx.Variable]:
    cfg = self.cfg
    init = initializers.normal(cfg.d_model**-0.5, (None, "heads"))
    table = init(rngs.params(), (cfg.relative_attention_num_buckets, cfg.num_heads), jax.numpy.float32)
    return {"relative_attention_bias": nnx.Param(table)}

  def shared_bias_params(self, model: nnx.Module) -> Any:
    return {"table": model.relative_attention_bias[...]}

  def position_bias(self, layer, shared, positions, kv_positions) -> PositionBias:
    fn = functools.partial(_t5_fn, max_distance=self.cfg.relative_attention_max_distance)
    return PositionBias(fn, shared, positions, kv_positions)
