"""ALiBi: attention with linear biases.

Source: Press, Smith and Lewis, "Train Short, Test Long: Attention with Linear Biases Enables Input
Length Extrapolation", arXiv 2108.12409; slopes as in the paper's code (ofirpress/attention_with_
linear_biases, ``get_slopes``), which BLOOM (HF ``build_alibi_tensor``) also follows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe import _checks


def alibi_slopes_f64(num_heads: int) -> np.ndarray:
  """ALiBi slopes in float64 on the host (see ``alibi_slopes``)."""
  num_heads = _checks.check_positive_int("num_heads", num_heads)

  def power_of_2(n: int) -> list[float]:
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]

  closest = 2 ** math.floor(math.log2(num_heads))
  slopes = power_of_2(closest)
  if closest != num_heads:
    slopes += power_of_2(2 * closest)[0::2][: num_heads - closest]
  return np.asarray(slopes, dtype=np.float64)


def alibi_slopes(num_heads: int) -> jax.Array:
  """Per-head ALiBi slopes m_h.

  For ``n`` a power of two: ``m_h = 2 ** (-8 h / n)``, h = 1..n. Otherwise the paper's rule: the
  slopes for the largest power of two ``c < n``, then every other slope of ``2c`` heads.

  Args:
    num_heads: N, positive.

  Returns:
    ``[N]`` float32 slopes (per token).

  Raises:
    ValueError: ``num_heads`` not a positive integer.
  """
  return jnp.asarray(alibi_slopes_f64(num_heads), jnp.float32)


def alibi_bias(slopes: jax.Array, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
  """ALiBi score bias ``-m_h * (i - j)`` for query position i and key position j.

  Keys after the query (j > i) get a positive bias; the causal mask removes them. Adding a per-row
  constant does not change softmax, so this equals BLOOM's ``+m_h * j`` form under a causal mask.

  Args:
    slopes: ``[N]`` float slopes, > 0.
    q_positions: ``[B, T]`` integer token indices of the queries.
    k_positions: ``[B, S]`` integer token indices of the keys.

  Returns:
    ``[B, N, T, S]`` float32 bias, added to ``q.k / sqrt(H)``.

  Raises:
    ValueError: wrong ranks, mismatched batch sizes, non-positive slopes.
    TypeError: non-integer positions.
  """
  _checks.check_slopes("slopes", slopes)
  _checks.check_rank("q_positions", q_positions, 2, "[B, T]")
  _checks.check_rank("k_positions", k_positions, 2, "[B, S]")
  _checks.check_positions("q_positions", q_positions)
  _checks.check_positions("k_positions", k_positions)
  if q_positions.shape[0] != k_positions.shape[0]:
    raise ValueError(
      f"q_positions and k_positions must have the same batch size B, got "
      f"{q_positions.shape[0]} and {k_positions.shape[0]}"
    )
  # Distances are exact integers; convert once to float32 (exact below 2**24).
  distance = (q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)  # [B, T, S]
  return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * distance[:, None, :, :]
