"""Exact RoPE phases: cos and sin of ``p * theta`` by a fixed-point reduction in turns.

The ``phase_precision="exact"`` path (the default) of ``jaxpe.ops.rope.rope_cos_sin`` and
``apply_rope``. Every float32 implementation computes the phase as ``float32(p) * float32(theta)``:
its rounding error grows with the position (half an ulp of the phase: 3.9e-3 rad at p = 131072,
~64 rad at p = 2^31), so cos/sin drift and
``score(i, j) != score(i + s, j + s)`` at long context (arXiv 2411.13476). jaxpe instead reduces the
phase in fixed-point turns, where integer arithmetic is exact:

1. Per frequency (host, once): ``U = round(2^64 * frac(theta / 2 pi))`` as two uint32 words, from
   the exact binary value of ``theta`` (float64 or float32 input) and 2 pi to 240 bits. A traced
   float32 ``theta`` is converted in the graph instead: ``theta`` split in two 12-bit halves times
   ``1 / 2 pi`` in six 12-bit pieces gives 12 exact float32 products, summed in 64-bit fixed
   point with carries (cost on ``[R/2]`` elements only).
2. Per position: ``F = frac(p * U / 2^64) * 2^32`` in uint32 (``p * U_hi`` wraps modulo 2^32, which
   is exactly the modulo 1 turn; the high half of ``p * U_lo`` from 16-bit limbs). The result is
   ``frac(p * theta / 2 pi)`` to 3 units of 2^-32 turn (4.4e-9 rad) for every ``|p| <= 2^31``.
3. The top two bits of ``F + 2^29`` are the quadrant; the remaining 30 bits, a signed fraction of a
   quarter turn, become ``r`` in ``[-pi/4, pi/4]`` (two-part constant, error ~3e-8 rad).
4. sin/cos of ``r`` by the Cephes ``sinf``/``cosf`` polynomials, swapped and negated by quadrant.

Measured (``benchmarks/rope_phase_accuracy.py``: 2004 positions below 2^31 x every frequency of
H = 128, bases 1e4 / 5e5 / 1e6): max |error| of cos/sin 7.8e-8 against the exact value, 1.4e-7
against plain float64 ``cos(p * theta)`` (float32 products: 2.0). On CPU the integer reduction
and two short polynomials cost less than XLA's ``cos`` + ``sin`` (``rope_cos_sin`` over 8.4 M
pairs: 0.43x the CPU time); in ``apply_rope`` cos/sin are computed once per position and pair, so
both precisions run at about the speed of the rotation's memory traffic
(``benchmarks/ops_bench.py`` prints the ratio).
Gradients: a custom JVP gives d/dtheta and d/dp (float positions) of ``p * theta``.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

# pi to 75 significant digits (A000796); 2 pi as an exact fraction from it.
_PI = Fraction("3.14159265358979323846264338327950288419716939937510582097494459230781640628")
_TWO_PI = 2 * _PI
_MASK16 = 0xFFFF


# ---------------------------------------------------------------- frequencies in fixed-point turns


@functools.lru_cache(maxsize=256)
def _turn_words_host(inv_freq_f64: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(U_hi, U_lo, turns)``: ``U = round(2^64 frac(theta / 2 pi))`` as uint32 words, and the
  float32 ``theta / 2 pi`` (for fractional positions), from the exact value of each float."""
  hi, lo, turns = [], [], []
  for theta in inv_freq_f64:
    u = Fraction(theta) / _TWO_PI
    word = round(u * 2**64) % 2**64
    hi.append(word >> 32)
    lo.append(word & 0xFFFFFFFF)
    turns.append(float(u))
  return np.asarray(hi, np.uint32), np.asarray(lo, np.uint32), np.asarray(turns, np.float32)


def _inv_two_pi_pieces(count: int, bits: int) -> tuple[float, ...]:
  """``1 / 2 pi`` as ``count`` floats of ``bits`` significant bits each (truncated, exact)."""
  rest, pieces = 1 / _TWO_PI, []
  for _ in range(count):
    exponent = math.floor(math.log2(rest))
    scale = Fraction(2) ** (bits - 1 - exponent)
    piece = Fraction(math.floor(rest * scale)) / scale
    pieces.append(float(piece))
    rest -= piece
  return tuple(pieces)


_INV_TWO_PI_12 = _inv_two_pi_pieces(6, 12)  # 72 bits: exact products with 12-bit halves of theta


def _to_fixed64(t: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Exact float32 ``t >= 0`` -> ``(hi, lo)`` uint32 words of ``frac(t) * 2^64`` (truncated)."""
  y = t * jnp.float32(2.0**32)  # exact (power of 2)
  high = y - jnp.floor(y * jnp.float32(2.0**-32)) * jnp.float32(2.0**32)  # y mod 2^32, exact
  whole = jnp.floor(high)
  low = (high - whole) * jnp.float32(2.0**32)  # exact
  return whole.astype(jnp.uint32), jnp.floor(low).astype(jnp.uint32)


@jax.jit
def _turn_words_traced(inv_freq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``_turn_words_host`` in the graph for a traced float32 ``[R/2]`` inv_freq."""
  theta = inv_freq.astype(jnp.float32)
  negative = theta < 0
  mag = jnp.abs(theta)
  top = jax.lax.bitcast_convert_type(
    jax.lax.bitcast_convert_type(mag, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32
  )  # 12 significant bits
  halves = (top, mag - top)  # both exact, 12 bits each
  pieces = jnp.asarray(_INV_TWO_PI_12, jnp.float32)[:, None]  # [6, 1]
  t_hi, t_lo = _to_fixed64(jnp.concatenate([h[None, :] * pieces for h in halves]))  # [12, R/2], exact
  # Sum the 12 words with carries in 16-bit limbs. The sums are reductions, which XLA does not fuse
  # into (and so recompute in) every [B, T, R/2] element of the phases as it did a chain of adds
  # (a traced inv_freq cost 8-20x the concrete one).
  low = jnp.sum(t_lo & jnp.uint32(_MASK16), axis=0)  # < 12 * 2^16
  mid = jnp.sum(t_lo >> 16, axis=0) + (low >> 16)
  lo = (mid << 16) | (low & jnp.uint32(_MASK16))
  hi = jnp.sum(t_hi, axis=0) + (mid >> 16)  # modulo 2^32: whole turns drop out
  # theta < 0: U -> 2^64 - U (two's complement of the 64-bit word).
  neg_lo = jnp.uint32(0) - lo
  neg_hi = ~hi + (lo == 0).astype(jnp.uint32)
  hi, lo = jnp.where(negative, neg_hi, hi), jnp.where(negative, neg_lo, lo)
  turns = theta * jnp.float32(float(1 / _TWO_PI))
  return hi, lo, turns


def _turn_words(inv_freq) -> tuple[jax.Array, jax.Array, jax.Array]:
  if isinstance(inv_freq, jax.core.Tracer):
    return _turn_words_traced(inv_freq)
  values = np.asarray(inv_freq, np.float64)
  return _turn_words_host(tuple(values.tolist()))


# ---------------------------------------------------------------- cos / sin


@jax.jit  # one XLA program per shape when called eagerly (inlined under an outer jit)
def _exact_cos_sin(positions: jax.Array, hi, lo, turns) -> tuple[jax.Array, jax.Array]:
  """cos/sin of ``positions * theta`` from the fixed-point turns ``U = (hi, lo)`` of theta.

  ``positions`` broadcasts against ``[R/2]``; integer (any sign, ``|p| <= 2^31``) or float32.
  """
  hi, lo = jnp.asarray(hi, jnp.uint32), jnp.asarray(lo, jnp.uint32)
  frac_turns = None
  out_of_range = None
  if jnp.issubdtype(positions.dtype, jnp.floating):
    # NaN, inf and |p| >= 2^31 have no int32 whole part: their cos/sin are NaN (traced positions;
    # concrete ones are refused before), not the garbage of an out-of-range float -> int cast.
    out_of_range = ~(jnp.abs(positions) < jnp.float32(2.0**31))
    whole = jnp.floor(positions)
    frac = positions - whole  # exact, in [0, 1)
    d = frac * jnp.asarray(turns, jnp.float32)
    d = d - jnp.floor(d)  # [0, 1) turns
    frac_turns = (d * jnp.float32(2.0**32)).astype(jnp.uint32)
    positions = whole.astype(jnp.int32)
  p = positions.astype(jnp.int32)
  negative = p < 0
  mag = jnp.abs(p).astype(jnp.uint32)  # |-2^31| wraps to 2^31 as uint32: still right
  p_hi, p_lo = mag >> 16, mag & jnp.uint32(_MASK16)
  a_hi, a_lo = lo >> 16, lo & jnp.uint32(_MASK16)
  # F = frac(p * U / 2^64) * 2^32 = p * U_hi + mulhi(p, U_lo) (mod 2^32), mulhi to -3 units.
  f = mag * hi + p_hi * a_hi + ((p_hi * a_lo) >> 16) + ((p_lo * a_hi) >> 16)
  f = jnp.where(negative, jnp.uint32(0) - f, f)
  if frac_turns is not None:
    f = f + frac_turns
  g = f + jnp.uint32(1 << 29)
  quadrant = g >> 30
  rest = (g & jnp.uint32((1 << 30) - 1)).astype(jnp.int32) - jnp.int32(1 << 29)  # |rest| <= 2^29
  rest_hi = rest & jnp.int32(~0xFFF)  # <= 17 significant bits: exact in float32
  rest_lo = rest - rest_hi  # < 2^12
  x_hi, x_lo = rest_hi.astype(jnp.float32), rest_lo.astype(jnp.float32)
  c_hi, c_lo, c_all = _QUARTER_TURN_UNIT
  r = x_hi * c_hi + (x_hi * c_lo + x_lo * c_all)  # radians, in [-pi/4, pi/4]
  z = r * r
  s = (
    (jnp.float32(-1.9515295891e-4) * z + jnp.float32(8.3321608736e-3)) * z - jnp.float32(1.6666654611e-1)
  ) * (z * r) + r
  c = (
    (
      (jnp.float32(2.443315711809948e-5) * z - jnp.float32(1.388731625493765e-3)) * z
      + jnp.float32(4.166664568298827e-2)
    )
    * (z * z)
    - jnp.float32(0.5) * z
    + jnp.float32(1.0)
  )
  swap = (quadrant & 1) == 1
  cos, sin = jnp.where(swap, s, c), jnp.where(swap, c, s)
  cos = jnp.where(((quadrant + 1) & 2) != 0, -cos, cos)
  sin = jnp.where((quadrant & 2) != 0, -sin, sin)
  if out_of_range is not None:
    cos, sin = jnp.where(out_of_range, jnp.nan, cos), jnp.where(out_of_range, jnp.nan, sin)
  return cos, sin


def _quarter_turn_unit() -> tuple[float, float, float]:
  """(pi/2) / 2^30 as a 7-bit head (exact products with 17-bit integers), its tail, and whole."""
  unit = _PI / 2 / 2**30
  exponent = math.floor(math.log2(unit))
  scale = Fraction(2) ** (6 - exponent)
  head = Fraction(math.floor(unit * scale)) / scale
  return float(head), float(unit - head), float(unit)


_QUARTER_TURN_UNIT = tuple(np.float32(v) for v in _quarter_turn_unit())


def exact_cos_sin(positions: jax.Array, inv_freq, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """cos and sin of ``positions * inv_freq``, exact to 3e-7 (see the module docstring).

  Args:
    positions: int32 (any sign, ``|p| <= 2^31``) or float32 token positions, broadcastable against
      ``inv_freq.reshape(shape)``.
    inv_freq: ``[R/2]`` float radians per token, checked (finite, rank 1); a float64 numpy array is
      taken exactly, a traced float32 array is converted in the graph.
    shape: ``inv_freq``'s broadcast shape, ``(1, ..., 1, R/2)``.

  Returns:
    ``(cos, sin)`` float32 of the broadcast shape; differentiable in ``inv_freq`` and float
    ``positions``.
  """
  hi, lo, turns = (jnp.asarray(w).reshape(shape) for w in _turn_words(inv_freq))
  theta = jnp.asarray(inv_freq, jnp.float32).reshape(shape)
  return _exact_cos_sin_jvp(positions, theta, hi, lo, turns)


@jax.custom_jvp
def _exact_cos_sin_jvp(positions, theta, hi, lo, turns):
  """``_exact_cos_sin`` with the derivative of cos/sin(p * theta) in ``theta`` and float ``p``
  (the integer reduction itself has none): learnable frequencies and float positions differentiate."""
  return _exact_cos_sin(positions, hi, lo, turns)


@_exact_cos_sin_jvp.defjvp
def _exact_cos_sin_tangent(primals, tangents):
  positions, theta, hi, lo, turns = primals
  d_positions, d_theta = tangents[0], tangents[1]
  # The primal through the custom JVP itself, so the rule differentiates again (hessians).
  cos, sin = _exact_cos_sin_jvp(positions, theta, hi, lo, turns)
  d_phase = positions.astype(jnp.float32) * d_theta
  if jnp.issubdtype(positions.dtype, jnp.floating):
    d_phase = d_phase + d_positions * theta
  return (cos, sin), (-sin * d_phase, cos * d_phase)
