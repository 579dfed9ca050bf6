"""``pos_encoding='fire'``: FIRE, a learned MLP over the log-interpolated distance (Li et al., arXiv
2310.04418): ``b(i, j) = f(psi(i - j) / psi(max(L, i)))``, ``psi(x) = log(|c x| + 1)``.

Each layer holds its own FIRE (``fire`` module of each ``Attention``), as the paper's listing
(one ``FIRE`` module per attention layer): the MLP ``1 -> fire_mlp_width -> N`` with ReLU,
initialised as PyTorch's ``nn.Linear`` (weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in))), c
initialised ``fire_init_c``, and the threshold ``L = |L_multiplier| * fire_init_L`` with a learned
multiplier initialised 1. The bias reaches the attention as a ``PositionBias`` (``xla`` only).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.attention.position_bias import PositionBias
from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import fire


class FireParams(nnx.Module):
  """A layer's FIRE parameters (float32): ``w1 [F]``, ``b1 [F]``, ``w2 [F, N]``, ``b2 [N]``, scalars
  ``c`` and ``L_multiplier``."""

  def __init__(self, width: int, num_heads: int, init_c: float, rngs: nnx.Rngs):
    def linear_init(fan_in, shape, names):
      bound = 1.0 / math.sqrt(fan_in)

      def init(key, shape, dtype):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

      return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, jnp.float32))

    self.w1 = linear_init(1, (width,), ("mlp",))
    self.b1 = linear_init(1, (width,), ("mlp",))
    self.w2 = linear_init(width, (width, num_heads), ("mlp", "heads"))
    self.b2 = linear_init(width, (num_heads,), ("heads",))
    self.c = nnx.Param(jnp.asarray(init_c, jnp.float32))
    self.L_multiplier = nnx.Param(jnp.asarray(1.0, jnp.float32))


def _fire_fn(params, q_positions, k_positions):
  return fire.fire_bias(q_positions, k_positions, **params)


@register("fire")
class Fire(PositionalEncoding):
  """FIRE's bias per layer and head (``fire_mlp_width``, ``fire_init_c``, ``fire_init_L``)."""

  def layer_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    cfg = self.cfg
    return {"fire": FireParams(cfg.fire_mlp_width, cfg.num_heads, cfg.fire_init_c, rngs)}

  def matmul_flops_per_token(self, seq_len: int) -> float:
    """The MLP ``1 -> F -> N`` on each of a query's ``(T + 1) / 2`` causal (query, key) pairs: ``2 (F +
    F N)`` per pair."""
    f, n = self.cfg.fire_mlp_width, self.cfg.num_heads
    return 2.0 * (f + f * n) * (seq_len + 1) / 2

  def position_bias(self, layer, shared, positions, kv_positions) -> PositionBias:
    p = layer.fire
    f32 = {k: getattr(p, k)[...].astype(jnp.float32) for k in ("w1", "b1", "w2", "b2", "c", "L_multiplier")}
    params = {k: f32[k] for k in ("w1", "b1", "w2", "b2", "c")}  # float32 also for bfloat16 parameters
    params["threshold"] = f32["L_multiplier"] * jnp.float32(self.cfg.fire_init_L)
    return PositionBias(_fire_fn, params, positions, kv_positions)
