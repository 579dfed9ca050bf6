"""FIRE: a learned MLP over the log-interpolated relative distance, one bias per head.

``b(i, j) = f(psi(i - j) / psi(max(L, i)))`` with ``psi(x) = log(|c x| + 1)``, c > 0 and the
threshold L learned, f an MLP ``1 -> F -> N`` with ReLU. Dividing by ``psi(max(L, i))`` maps every
distance of a query at position i into ``[0, 1]`` (progressive interpolation), so a model sees no
new input values at longer contexts; the threshold keeps short contexts from being stretched. The
op follows the paper's PyTorch listing (appendix): ``log(|c x| + 1)`` in numerator and
denominator, ``eps`` = 1e-6 added to the denominator.

Shape alphabet: B batch, T query positions, S key positions, N heads, F the MLP's hidden width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.ops import checks as _checks
from jaxpe.ops.relative_bias import check_position_pair

FIRE_EPS = 1e-6
"""Added to ``psi(max(L, i))`` (the paper's listing) so the denominator stays > 0 at position 0."""


def fire_interpolation(
  q_positions: jax.Array, k_positions: jax.Array, *, c: jax.Array, threshold: jax.Array, eps: float = FIRE_EPS
) -> jax.Array:
  """FIRE's normalised distance ``psi(i - j) / (psi(max(L, i)) + eps)``, ``psi(x) = log(|c x| + 1)``.

  Args:
    q_positions: ``[B, T]`` integer token indices i of the queries, >= 0.
    k_positions: ``[B, S]`` integer token indices j of the keys, >= 0.
    c: float scalar, the log transform's scale (> 0; the paper initialises 0.1).
    threshold: float scalar L in tokens (the paper initialises 512 and learns a multiplier of it;
      its absolute value is used, as the listing's ``abs(L_multiplier * init_L)``).
    eps: added to the denominator, a float >= 0 (default ``FIRE_EPS``).

  Returns:
    ``[B, T, S]`` float32, in ``[0, 1]`` where ``j <= i`` (the causal region) and L >= 0;
    differentiable in ``c`` and ``threshold``.

  Raises:
    ValueError: c or threshold not scalars; positions as ``jaxpe.ops.relative_bias.t5_bias``.
    TypeError: non-float c or threshold; non-integer positions.

  Source: Li et al., "Functional Interpolation for Relative Positions Improves Long Context
  Transformers", arXiv 2310.04418, eq. (3) and the appendix's listing.
  """
  q_positions, k_positions = check_position_pair(q_positions, k_positions)
  for name, x in (("c", c), ("threshold", threshold)):
    x = _checks.as_array(name, x)
    _checks.check_float(name, x)
    if jnp.ndim(x) != 0:
      raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(x)}")
  c = jnp.asarray(c, jnp.float32)
  qi, ki = q_positions.astype(jnp.int32), k_positions.astype(jnp.int32)  # token indices < 2^31
  # i - j exactly in int32, then one rounding to float32 (positions >= 2^24 would round apart first)
  rel = (qi[:, :, None] - ki[:, None, :]).astype(jnp.float32)  # [B, T, S]
  qf = qi.astype(jnp.float32)
  normalizer = jnp.maximum(qf, jnp.abs(jnp.asarray(threshold, jnp.float32)))[:, :, None]
  return jnp.log(jnp.abs(c * rel) + 1.0) / (jnp.log(jnp.abs(c * normalizer) + 1.0) + jnp.float32(eps))


def fire_bias(
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  w1: jax.Array,
  b1: jax.Array,
  w2: jax.Array,
  b2: jax.Array,
  c: jax.Array,
  threshold: jax.Array,
  eps: float = FIRE_EPS,
) -> jax.Array:
  """FIRE's bias ``f(fire_interpolation(i, j))`` per head, ``f(x) = relu(x w1 + b1) w2 + b2``.

  Args:
    q_positions, k_positions, c, threshold, eps: as ``fire_interpolation``.
    w1: ``[F]`` float, the first layer's weight (the paper: ``nn.Linear(1, F)``, F = 32).
    b1: ``[F]`` float, its bias.
    w2: ``[F, N]`` float, the second layer's weight (``nn.Linear(F, N)``, transposed).
    b2: ``[N]`` float, its bias.

  Returns:
    ``[B, N, T, S]`` float32, differentiable in every parameter.

  Raises:
    ValueError: MLP parameters of the wrong ranks or of sizes that do not fit; as
      ``fire_interpolation``.
    TypeError: non-float parameters; as ``fire_interpolation``.

  Source: Li et al., arXiv 2310.04418 (eq. (3); the MLP of the appendix's listing).
  """
  for name, x, rank, hint in (
    ("w1", w1, 1, "[F]"),
    ("b1", b1, 1, "[F]"),
    ("w2", w2, 2, "[F, N]"),
    ("b2", b2, 1, "[N]"),
  ):
    x = _checks.as_array(name, x)
    _checks.check_rank(name, x, rank, hint)
    _checks.check_float(name, x)
  width, heads = jnp.shape(w2)
  if jnp.shape(w1) != (width,) or jnp.shape(b1) != (width,) or jnp.shape(b2) != (heads,):
    raise ValueError(
      f"w1, b1, w2, b2 must be [F], [F], [F, N], [N], got {jnp.shape(w1)}, {jnp.shape(b1)}, "
      f"{jnp.shape(w2)}, {jnp.shape(b2)}"
    )
  x = fire_interpolation(q_positions, k_positions, c=c, threshold=threshold, eps=eps)  # [B, T, S]
  fix = (
    "the MLP runs on dense [B, T, S, F]: give fewer positions, or attention's blockwise path (PositionBias)"
  )
  _checks.check_dense_fits("q_positions / k_positions", (*x.shape, max(width, heads)), jnp.float32, fix)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  hidden = jax.nn.relu(x[..., None] * f32(w1)[None, None, None] + f32(b1)[None, None, None])  # [B, T, S, F]
  out = jnp.einsum("BTSF,FN->BNTS", hidden, f32(w2), precision=jax.lax.Precision.HIGHEST)
  return out + f32(b2)[None, :, None, None]


__all__ = ["FIRE_EPS", "fire_bias", "fire_interpolation"]
