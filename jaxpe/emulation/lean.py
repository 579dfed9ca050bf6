"""The lean ALiBi emulation: ALiBi as ``+m_h (j - j0)``, the fewest bf16-exact extra dims.

ALiBi's bias ``-m_h (i - j)`` differs from ``m_h (j - j0)`` by ``-m_h (i - j0)``, a constant for each
query row (and head), which softmax ignores (BLOOM adds ``m_h j`` alone). So the key side carries
positions only, the same for every head (grouped-query sharing kept: k stays ``[B, S, K, E]``),
and the query side the per-head constant ``c_h = m_h / dot_scale``:

- keys: the signed base-256 digits ``d_b`` of ``x = j - j0`` (``|d_b| <= 128``; the top digit
  ``<= 256``), each times ``256^b``: exact bf16 integers times a power of two. ``j0`` is the centre
  of the row's key positions, ``(min_j + max_j) // 2`` per batch row (a per-row constant as well),
  which halves ``|x|`` and makes it scale with the row's span of positions, not with their size.
- queries: ``c_h`` split into ``P`` bf16 parts ``c_{h,a}`` (greedy; a power of two is one part,
  at most 3, the last one rounding ``c_h`` to ~2^-26 relative as ``exact_alibi_dims`` does).
  ``P`` is the most parts any head needs (0 slopes need none).
- dims: for a = 1..P (largest part first), b from the coarsest digit down: q ``c_{h,a}``, k
  ``d_b 256^b``. Every product has at most 8 + 9 significant bits, so it is exact in float32 (and
  TF32 or bf16 inputs read both sides unchanged); ``E = P x D`` dims (D digits): 2..6 for positions
  below 65536, against 18 for the exact augmented form.

The price: the accumulator holds ``c_h x`` (up to ``m_h / dot_scale x span / 2``, see
``jaxpe.emulation.bounds.lean_alibi_magnitude``) instead of the exact form's ``c_h (j - i)``, so
float32 rounding of the sum scales with the row's span rather than with the distance (measured in
``benchmarks/kernel_precision.py``; ``tests/emulation/lean_test.py`` holds the goal of 1e-2 logits).

Source: ALiBi (Press et al., arXiv 2108.12409); the key-only ``m_h j`` form is BLOOM's
(huggingface/transformers ``build_alibi_tensor``); the split into exact products is jaxpe's.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, E extra dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks

# Positions are split into signed base-2^8 digits (|d| <= 128, exact in bf16).
DIGIT_BITS = 8
# Most bf16 parts of a slope constant (3 x 8 bits hold a float32 significand).
MAX_SLOPE_PARTS = 3


def lean_digit_count(max_position: int) -> int:
  """D: signed base-256 digits of ``j - j0`` for positions ``< max_position`` (1 up to 257, 2 up to 65537).

  ``|j - j0| <= ceil((max_position - 1) / 2)`` must be at most ``128 x 256^(D-1)``.

  Raises:
    ValueError: ``max_position`` not an int in 1..2^24.
  """
  max_position = _checks.check_positive_int("max_position", max_position, maximum=2**24)
  half = max_position // 2  # ceil((max_position - 1) / 2)
  digits = 1
  while 128 * 256 ** (digits - 1) < half:
    digits += 1
  return digits


def lean_slope_parts(slopes, dot_scale: float) -> np.ndarray:
  """``[P, N]`` float64 bf16-exact parts of ``c_h = m_h / dot_scale``, P the most any head needs (1..3).

  Greedy round-to-nearest (``c_1 = bf16(c)``, ``c_2 = bf16(c - c_1)``, ...), stopped where every
  head's remainder is 0 or after 3 parts. A power-of-two ``c_h`` (and 0) is one part.

  Args:
    slopes: ``[N]`` ALiBi slopes, concrete, finite, >= 0.
    dot_scale: the factor the kernel applies to ``q . k``; finite, > 0.

  Raises:
    ValueError: bad slopes or dot_scale.
  """
  slopes = np.asarray(slopes, np.float64)
  _checks.check_slopes("slopes", slopes, allow_zero=True)
  dot_scale = _checks.check_positive_float("dot_scale", dot_scale)
  rest = slopes / dot_scale
  parts = []
  while len(parts) < MAX_SLOPE_PARTS and (not parts or np.any(rest != 0)):
    part = rest.astype(jnp.bfloat16).astype(np.float64)
    parts.append(part)
    rest = rest - part
  return np.stack(parts)


def lean_alibi_dim_count(slopes, dot_scale: float, max_position: int) -> int:
  """E of ``lean_alibi_dims``: ``P x lean_digit_count(max_position)`` (P from ``lean_slope_parts``).

  Raises:
    ValueError: as ``lean_slope_parts`` and ``lean_digit_count``.
  """
  return lean_slope_parts(slopes, dot_scale).shape[0] * lean_digit_count(max_position)


def lean_alibi_dims(
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  dot_scale: float,
  max_position: int,
  num_kv_heads: int,
) -> tuple[jax.Array, jax.Array]:
  """Extra q/k dims with ``q_extra . k_extra * dot_scale = m_h (j - j0)``: ALiBi up to a per-row constant.

  Layout in the module docstring. ``softmax`` over keys of ``q.k * dot_scale`` plus these dims
  equals the one with ALiBi's ``-m_h (i - j)`` (the two differ by ``m_h (i - j0)`` per row).

  Args:
    q_positions: ``[B, T]`` integer token indices (only the shape is used: the query side is the
      same for every query).
    k_positions: ``[B, S]`` integer token indices, ``< max_position`` (traced positions cannot be
      checked; larger ones make the top digit inexact).
    slopes: ``[N]`` ALiBi slopes, concrete, finite, >= 0 (0 = no ALiBi on that head).
    dot_scale: the factor the kernel applies to ``q . k`` (``1/sqrt(H)``, or 1 when q is
      pre-scaled); finite, > 0.
    max_position: static bound on positions (sets the digit count); 1..2^24.
    num_kv_heads: K; the key dims are the same for every kv head.

  Returns:
    ``(q_extra [B, T, N, E], k_extra [B, S, K, E])`` float32, bf16-exact values,
    ``E = lean_alibi_dim_count(slopes, dot_scale, max_position)``.

  Raises:
    ValueError: bad slopes, dot_scale, max_position or num_kv_heads; concrete positions out of
      range.
    TypeError: non-integer positions.

  Source: ALiBi (Press et al., arXiv 2108.12409) in BLOOM's key-only form, split into exact
  bf16 products (jaxpe).
  """
  if isinstance(slopes, jax.core.Tracer):
    raise ValueError(_checks.traced_message("slopes"))
  c_parts = lean_slope_parts(slopes, dot_scale)  # [P, N]
  num_kv_heads = _checks.check_positive_int("num_kv_heads", num_kv_heads)
  digits = lean_digit_count(max_position)
  for name, pos in (("q_positions", q_positions), ("k_positions", k_positions)):
    _checks.check_rank(name, pos, 2, "[B, T]" if name[0] == "q" else "[B, S]")
    _checks.check_positions(name, pos)
    _checks.check_index_range(name, pos, max_position, "max_position")
  batch, t_len = q_positions.shape
  s_len = k_positions.shape[1]
  pos = jnp.asarray(k_positions).astype(jnp.int32)
  if s_len:  # centre of the row's keys: a per-row constant, |x| <= half the row's span
    pos = pos - (jnp.min(pos, axis=1, keepdims=True) + jnp.max(pos, axis=1, keepdims=True)) // 2
  values = []  # x = sum_b d_b 256^b, |d_b| <= 128 (the top digit keeps the rest)
  for b in range(digits):
    digit = pos if b == digits - 1 else jnp.mod(pos + 128, 256) - 128
    values.append(digit.astype(jnp.float32) * float(2 ** (DIGIT_BITS * b)))
    pos = (pos - digit) // 256
  values = values[::-1]  # coarsest first
  num_parts = c_parts.shape[0]
  c = jnp.asarray(np.repeat(c_parts.T, digits, axis=1), jnp.float32)  # [N, P*D], part-major
  q_extra = jnp.broadcast_to(c, (batch, t_len, *c.shape))
  k_one = jnp.stack(values * num_parts, axis=-1)  # [B, S, P*D]
  k_extra = jnp.broadcast_to(k_one[:, :, None, :], (batch, s_len, num_kv_heads, k_one.shape[-1]))
  return q_extra, k_extra
