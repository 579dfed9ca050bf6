"""``pos_encoding='kerple_log'`` and ``'kerple_power'``: Kerple's kernelized relative biases
(Chi et al., arXiv 2205.09921): ``-r1 log(1 + r2 |i - j|)`` and ``-r1 |i - j| ^ r2``.

Each layer holds its own ``r1 [N]`` and ``r2 [N]`` (``kerple`` module of each ``Attention``),
initialised as the authors' code (github.com/chijames/KERPLE, GPT-NeoX and fairseq): the log form's
r1 ~ U(0, 2), r2 ~ U(0, 1) (``bias_p``, ``bias_a``); the power form's coefficient r1 ~ U(0, 1) and
exponent r2 ~ U(0, 2) (``bias_a``, ``bias_p`` of ``-bias_a |m - n| ^ bias_p``). The authors clamp the
parameters in place before each use (r1, r2 >= 0.01; the power form's r2 <= 2 as well); here the
forward pass uses the clamped values and the gradient passes the clamp unchanged (straight
through), so a parameter pushed past a bound still moves back as the clamped one would. The bias
reaches the attention as a ``PositionBias`` (``xla`` backend only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.attention.position_bias import PositionBias
from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import relative_bias


class KerpleParams(nnx.Module):
  """A layer's Kerple parameters ``r1 [N]`` and ``r2 [N]``, float32, logical name ``heads``: U(0, 2)
  and U(0, 1) for the log form, U(0, 1) and U(0, 2) for the power form (``power``)."""

  def __init__(self, num_heads: int, rngs: nnx.Rngs, *, power: bool = False):
    def uniform(high):
      init = nnx.with_partitioning(nnx.initializers.uniform(high), ("heads",))
      return nnx.Param(init(rngs.params(), (num_heads,), jnp.float32))

    self.r1 = uniform(1.0 if power else 2.0)
    self.r2 = uniform(2.0 if power else 1.0)


def _clamped(x, low: float, high: float | None = None):
  """``clip(x, low, high)`` in value, identity in gradient (the authors' in-place clamp)."""
  return x + jax.lax.stop_gradient(jnp.clip(x, low, high) - x)


def _log_fn(params, q_positions, k_positions):
  return relative_bias.kerple_log_bias(params["r1"], params["r2"], q_positions, k_positions)


def _power_fn(params, q_positions, k_positions):
  return relative_bias.kerple_power_bias(params["r1"], params["r2"], q_positions, k_positions)


@register("kerple_log")
class KerpleLog(PositionalEncoding):
  """``-r1_h log(1 + r2_h |i - j|)`` per layer and head."""

  power = False

  def layer_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    return {"kerple": KerpleParams(self.cfg.num_heads, rngs, power=self.power)}

  def position_bias(self, layer, shared, positions, kv_positions) -> PositionBias:
    eps = relative_bias.KERPLE_EPS
    params = {
      "r1": _clamped(layer.kerple.r1[...], eps),
      "r2": _clamped(layer.kerple.r2[...], eps, 2.0 if self.power else None),
    }
    return PositionBias(_power_fn if self.power else _log_fn, params, positions, kv_positions)


@register("kerple_power")
class KerplePower(KerpleLog):
  """``-r1_h |i - j| ^ r2_h`` per layer and head, r2 clamped to ``[0.01, 2]``."""

  power = True
