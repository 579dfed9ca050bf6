"""Additive relative position biases: T5's bucketed bias and Kerple's log and power kernels.

Each bias is a float32 ``[B, N, T, S]`` array added to the scaled scores ``q.k / sqrt(H)``, computed
from integer token positions (so padding, packing and the KV cache work as for ALiBi: the caller
gives each token's position). Learned parts (T5's table, Kerple's r1 and r2) are arguments, so the
ops stay Flax-free and differentiable in them. ``jaxpe.attention.PositionBias`` runs them inside
the blockwise attention without building the ``[B, N, T, S]`` array.

Sources: T5, Raffel et al., arXiv 1910.10683 (the bucket function of HF transformers'
``T5Attention._relative_position_bucket``, itself Mesh TensorFlow's); Kerple, Chi et al., arXiv
2205.09921 (section 4, the log and power variants; parameters as the authors' GPT-NeoX code).

Shape alphabet: B batch, T query positions, S key positions, N heads.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks

# Kerple's parameters are clamped to at least this before use (the authors' code, ``self.eps``).
KERPLE_EPS = 1e-2


def t5_relative_position_bucket(
  relative_position: jax.Array, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> jax.Array:
  """T5's bucket of each relative position (key position minus query position), HF's function.

  Distances below ``num_buckets // 2`` (bidirectional: per direction, of ``num_buckets // 2``
  buckets) get a bucket each; larger ones share buckets spaced logarithmically up to
  ``max_distance``, beyond which all fall into the last bucket. Causal (``bidirectional=False``):
  keys after the query (positive relative positions) all fall into bucket 0, with distance 0.
  Computed in float32 as HF's PyTorch code, so buckets agree at every distance (the tests compare
  with ``transformers`` over -5000..5000).

  Args:
    relative_position: integer array of any shape, ``k_position - q_position`` in tokens.
    bidirectional: True for T5's encoder (both directions), False for its decoder (causal).
    num_buckets: buckets in all, an int >= 2 (>= 4 when bidirectional); T5 uses 32.
    max_distance: distance (tokens) from which positions share the last bucket, an int > the
      exact range ``num_buckets // 2`` (bidirectional ``num_buckets // 4``); T5 uses 128.

  Returns:
    int32 buckets in ``[0, num_buckets)``, the shape of ``relative_position``.

  Raises:
    TypeError: non-integer ``relative_position``; ``bidirectional`` not a bool; sizes not ints.
    ValueError: ``num_buckets`` or ``max_distance`` out of the ranges above.

  Source: HF ``transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket`` (Raffel et
  al., arXiv 1910.10683).
  """
  bidirectional = _checks.check_bool("bidirectional", bidirectional)
  num_buckets = _checks.check_positive_int("num_buckets", num_buckets, maximum=_checks.MAX_DIM)
  max_distance = _checks.check_positive_int("max_distance", max_distance)
  relative_position = _checks.as_array("relative_position", relative_position)
  if not jnp.issubdtype(jnp.result_type(relative_position), jnp.integer):
    raise TypeError(
      f"relative_position must be an integer array (key minus query position, in tokens), got dtype "
      f"{jnp.result_type(relative_position)}"
    )
  n = num_buckets // 2 if bidirectional else num_buckets
  max_exact = n // 2
  if max_exact < 1:
    raise ValueError(
      f"num_buckets must be >= {4 if bidirectional else 2} (bidirectional={bidirectional}), got {num_buckets}"
    )
  if max_distance <= max_exact:
    raise ValueError(
      f"max_distance must be > the exact range num_buckets{' // 4' if bidirectional else ' // 2'} = "
      f"{max_exact}, got {max_distance}"
    )
  rel = jnp.asarray(relative_position).astype(jnp.int32)
  buckets = jnp.zeros(rel.shape, jnp.int32)
  if bidirectional:
    buckets = buckets + (rel > 0).astype(jnp.int32) * n
    rel = jnp.abs(rel)
  else:
    rel = -jnp.minimum(rel, 0)
  # float32 as HF: log(r / max_exact) / log(max_distance / max_exact) * (n - max_exact), truncated
  scaled = (
    jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / jnp.float32(max_exact))
    / jnp.float32(math.log(max_distance / max_exact))
    * jnp.float32(n - max_exact)
  )
  large = jnp.minimum(max_exact + scaled.astype(jnp.int32), n - 1)
  return buckets + jnp.where(rel < max_exact, rel, large)


def t5_bias(
  table: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  bidirectional: bool,
  max_distance: int = 128,
) -> jax.Array:
  """T5's relative attention bias: ``table[bucket(k_position - q_position), h]`` for every head.

  Args:
    table: ``[num_buckets, N]`` float learned bias per bucket and head (HF T5's
      ``relative_attention_bias.weight``); ``num_buckets = table.shape[0]``.
    q_positions: ``[B, T]`` integer token indices of the queries, >= 0.
    k_positions: ``[B, S]`` integer token indices of the keys, >= 0.
    bidirectional: False for a causal decoder (T5's decoder), True for an encoder.
    max_distance: as ``t5_relative_position_bucket``.

  Returns:
    ``[B, N, T, S]`` float32 bias (differentiable in ``table``).

  Raises:
    ValueError: ``table`` not rank 2; positions not ``[B, T]`` / ``[B, S]`` with one B, or concrete
      ones negative; sizes as ``t5_relative_position_bucket``.
    TypeError: non-float ``table``, non-integer positions.

  Source: HF ``T5Attention.compute_bias`` (Raffel et al., arXiv 1910.10683).
  """
  table = _checks.as_array("table", table)
  _checks.check_rank("table", table, 2, "[num_buckets, N]")
  _checks.check_float("table", table)
  q_positions, k_positions = check_position_pair(q_positions, k_positions, heads=table.shape[1])
  rel = k_positions[:, None, :].astype(jnp.int32) - q_positions[:, :, None].astype(jnp.int32)  # [B, T, S]
  buckets = t5_relative_position_bucket(
    rel, bidirectional=bidirectional, num_buckets=table.shape[0], max_distance=max_distance
  )
  values = jnp.take(jnp.asarray(table, jnp.float32), buckets, axis=0)  # [B, T, S, N]
  return jnp.moveaxis(values, 3, 1)


def kerple_log_bias(
  r1: jax.Array, r2: jax.Array, q_positions: jax.Array, k_positions: jax.Array
) -> jax.Array:
  """Kerple's logarithmic bias ``-r1_h log(1 + r2_h |i - j|)`` (query position i, key position j).

  The authors keep r1, r2 >= ``KERPLE_EPS`` = 0.01 by clamping the parameters before each use; the
  decoder does the same (``jaxpe.model.encodings.kerple``). This op takes the values as given.

  Args:
    r1: ``[N]`` float, > 0 (scale of the kernel; ``p`` in the authors' code).
    r2: ``[N]`` float, > 0 (``a`` in the authors' code).
    q_positions: ``[B, T]`` integer token indices of the queries, >= 0.
    k_positions: ``[B, S]`` integer token indices of the keys, >= 0.

  Returns:
    ``[B, N, T, S]`` float32 bias, <= 0, differentiable in r1 and r2.

  Raises:
    ValueError: r1, r2 not ``[N]`` or (when concrete) not finite and > 0; positions as ``t5_bias``.
    TypeError: non-real r1, r2; non-integer positions.

  Source: Chi et al., "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation",
  arXiv 2205.09921, section 4 (the logarithmic variant, eq. for ``k_log``).
  """
  r1, r2, distance = _kerple_inputs(r1, r2, q_positions, k_positions, power=False)
  return -r1[None, :, None, None] * jnp.log1p(r2[None, :, None, None] * distance[:, None])


def kerple_power_bias(
  r1: jax.Array, r2: jax.Array, q_positions: jax.Array, k_positions: jax.Array
) -> jax.Array:
  """Kerple's power bias ``-r1_h |i - j| ^ r2_h`` (query position i, key position j).

  A conditionally positive definite kernel for ``0 < r2 <= 2`` (the paper's range); the authors
  clamp r1 >= ``KERPLE_EPS`` and r2 to ``[KERPLE_EPS, 2]`` before each use, as the decoder does.
  ``|i - j| ^ r2`` is 0 at distance 0 with gradient 0 in r2 there (no ``log 0``).

  Args:
    r1: ``[N]`` float, > 0.
    r2: ``[N]`` float, in ``(0, 2]``.
    q_positions, k_positions: as ``kerple_log_bias``.

  Returns:
    ``[B, N, T, S]`` float32 bias, <= 0, differentiable in r1 and r2.

  Raises:
    ValueError: r1, r2 not ``[N]``; concrete r1 not finite and > 0 or r2 outside ``(0, 2]``;
      positions as ``t5_bias``.
    TypeError: non-real r1, r2; non-integer positions.

  Source: Chi et al., arXiv 2205.09921, section 4 (the power variant, ``k_power``).
  """
  r1, r2, distance = _kerple_inputs(r1, r2, q_positions, k_positions, power=True)
  d = distance[:, None]  # [B, 1, T, S]
  positive = d > 0
  powered = jnp.where(positive, jnp.power(jnp.where(positive, d, 1.0), r2[None, :, None, None]), 0.0)
  return -r1[None, :, None, None] * powered


def _kerple_inputs(r1, r2, q_positions, k_positions, *, power: bool):
  """(r1 ``[N]`` float32, r2 ``[N]`` float32, ``|i - j|`` ``[B, T, S]`` float32), checked."""
  for name, x in (("r1", r1), ("r2", r2)):
    x = _checks.as_array(name, x)
    _checks.check_rank(name, x, 1, "[N]")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating) and not jnp.issubdtype(
      jnp.result_type(x), jnp.integer
    ):
      raise TypeError(f"{name} must be a float array, got dtype {jnp.result_type(x)}")
  if jnp.shape(r1) != jnp.shape(r2):
    raise ValueError(f"r1 and r2 must both be [N], got shapes {jnp.shape(r1)} and {jnp.shape(r2)}")
  _checks.check_slopes("r1", r1)
  _checks.check_slopes("r2", r2)
  if power and not isinstance(r2, jax.core.Tracer) and np.any(np.asarray(r2, np.float64) > 2):
    raise ValueError(f"r2 of Kerple's power bias must be in (0, 2], got {np.asarray(r2).tolist()}")
  q_positions, k_positions = check_position_pair(q_positions, k_positions, heads=jnp.shape(r1)[0])
  distance = jnp.abs(q_positions[:, :, None].astype(jnp.int32) - k_positions[:, None, :].astype(jnp.int32))
  return jnp.asarray(r1, jnp.float32), jnp.asarray(r2, jnp.float32), distance.astype(jnp.float32)


def check_position_pair(q_positions, k_positions, *, heads: int = 1):
  """``jaxpe.ops.checks.check_position_pair`` (query ``[B, T]`` and key ``[B, S]`` integer positions,
  >= 0 when concrete, same B; a dense ``[B, heads, T, S]`` float32 bias that fits the device),
  returned as jax arrays.

  Raises:
    ValueError: wrong ranks, different B, concrete negative positions.
    TypeError: non-integer positions.
  """
  q_positions, k_positions = _checks.check_position_pair(q_positions, k_positions, heads=heads)
  return jnp.asarray(q_positions), jnp.asarray(k_positions)


__all__ = [
  "KERPLE_EPS",
  "check_position_pair",
  "kerple_log_bias",
  "kerple_power_bias",
  "t5_bias",
  "t5_relative_position_bucket",
]
