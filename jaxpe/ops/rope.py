"""Rotary position embedding (RoPE) written with complex numbers, with exact phases.

Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
arXiv 2104.09864. The complex formulation matches Meta's LLaMA reference
(``precompute_freqs_cis`` / ``apply_rotary_emb`` in facebookresearch/llama ``model.py``).

Pair layouts (see ``Layout``):

* ``"interleaved"`` (Meta LLaMA, complex): dims ``(2i, 2i+1)`` form the complex number
  ``x[2i] + 1j * x[2i+1]``.
* ``"half"`` (GPT-NeoX / HF ``rotate_half``): dims ``(i, i + R/2)`` form
  ``x[i] + 1j * x[i + R/2]``.

Pair ``i`` rotates by ``positions * inv_freq[i]`` radians. ``R = 2 * len(inv_freq)`` dims rotate: the
first R of the head (``rotated_slice="leading"``, GPT-NeoX / GPT-J partial rotary) or the last R
(``"trailing"``, DeepSeek-V2/V3 MLA's ``q_pe``/``k_pe``); the others pass through unchanged.

Exact phases (``phase_precision="exact"``, the default). Every float32 implementation computes the
phase as ``float32(p) * float32(theta)``: its rounding error grows with the position (half an ulp of
the phase: 3.9e-3 rad at p = 131072, ~64 rad at p = 2^31), so cos/sin drift and
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
``phase_precision="float32"`` keeps the phase ``float32(p) * float32(theta)`` bit for bit as
HF transformers / Meta / vLLM compute it, and XLA's float32 ``cos``/``sin`` of it (to match an
engine that uses them).

The rotation is complex64; the result is cast back to the input dtype (JAX has no bf16 complex).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks

Layout = Literal["interleaved", "half"]
LAYOUTS: tuple[str, ...] = ("interleaved", "half")
PhasePrecision = Literal["exact", "float32"]
PHASE_PRECISIONS: tuple[str, ...] = ("exact", "float32")
RotatedSlice = Literal["leading", "trailing"]

# pi to 75 significant digits (A000796); 2 pi as an exact fraction from it.
_PI = Fraction("3.14159265358979323846264338327950288419716939937510582097494459230781640628")
_TWO_PI = 2 * _PI
_MASK16 = 0xFFFF


def rope_inv_freq(
  head_dim: int, *, base: float = 10000.0, rotary_dim: int | None = None, dtype=jnp.float32
) -> jax.Array | np.ndarray:
  """Default RoPE inverse frequencies ``base ** (-2i / rotary_dim)``, ``i < rotary_dim / 2``.

  Args:
    head_dim: H, the per-head dimension of q and k; positive.
    base: rope_theta, > 0. Default 10000 (RoFormer, LLaMA).
    rotary_dim: R, number of dims that rotate; even, ``0 < R <= H``. Default ``H``.
    dtype: ``jnp.float32`` (default): a float32 JAX array, the frequencies engines use.
      ``np.float64``: a float64 numpy array (host; JAX without x64 cannot hold float64). Give this
      to ``apply_rope`` for phases exact with respect to the float64 frequencies; a float32 array
      is taken as the exact number it holds (within 1.2e-7 relative of the float64 one, which
      shifts the phase by up to ``p * 6e-8 * theta`` radians).

  Returns:
    inv_freq: ``[R/2]`` radians per token, of ``dtype``.

  Raises:
    ValueError: ``head_dim``/``rotary_dim`` not positive or > 2^20, ``rotary_dim`` odd or > ``head_dim``,
      ``base`` not a finite number > 0.
    TypeError (also a ValueError): ``head_dim``/``rotary_dim`` not ints, ``base`` not a real
      number, ``dtype`` not float32 or float64.

  Source: RoFormer (arXiv 2104.09864) eq. 15; HF ``compute_default_rope_parameters``.
  """
  head_dim = _checks.check_positive_int("head_dim", head_dim, maximum=_checks.MAX_DIM)
  rotary_dim = head_dim if rotary_dim is None else rotary_dim
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  if rotary_dim > head_dim:
    raise ValueError(f"rotary_dim must be <= head_dim = {head_dim}, got {rotary_dim}")
  base = _checks.check_positive_float("base", base)
  # float64 on the host, rounded once to float32 (HF computes base ** (arange / dim) in float32;
  # the two agree to 1 ulp).
  exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
  inv_freq = base**-exponents
  if _checks.check_float_dtype("dtype", dtype, allowed=(np.float32, np.float64)) == np.float64:
    return inv_freq
  return jnp.asarray(inv_freq, dtype=jnp.float32)


def rope_phases(positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotation angles ``float32(positions[..., None]) * float32(inv_freq)``: the float32 phases.

  These are the phases of ``phase_precision="float32"`` (HF, Meta, vLLM), with their rounding error
  of half an ulp of the phase. ``rope_cos_sin`` gives exact cos/sin instead.

  Args:
    positions: ``[B, T]`` integer token indices, >= 0.
    inv_freq: ``[R/2]`` float, radians per token.

  Returns:
    ``[B, T, R/2]`` float32 radians.

  Raises:
    ValueError: ``positions`` not ``[B, T]`` or (concrete) negative or >= 2^31, ``inv_freq`` not
      ``[R/2]``, empty or not finite.
    TypeError: non-integer ``positions``, non-float ``inv_freq``.

  Source: Meta LLaMA ``precompute_freqs_cis``; HF ``LlamaRotaryEmbedding.forward``.
  """
  positions = _checks.as_array("positions", positions)
  _checks.check_rank("positions", positions, 2, "[B, T]")
  _checks.check_positions("positions", positions)
  inv_freq = _check_inv_freq(inv_freq)
  inv_freq = jnp.asarray(inv_freq, jnp.float32)
  return positions.astype(jnp.float32)[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))


# ---------------------------------------------------------------- exact phases: frequencies


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


# ---------------------------------------------------------------- exact phases: cos / sin


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


# ---------------------------------------------------------------- public API


def rope_cos_sin(
  positions,
  inv_freq,
  *,
  mrope_section=None,
  phase_precision: PhasePrecision = "exact",
) -> tuple[jax.Array, jax.Array]:
  """``cos`` and ``sin`` of the rotation angles ``positions[..., None] * inv_freq``.

  One value per pair (not duplicated as HF's ``cos``/``sin`` of ``[..., R]``).

  Args:
    positions: ``[...]`` token indices, e.g. ``[T]`` or ``[B, T]``: integers (exact below 2^31),
      or floats (fractional positions; taken as float32, so the position itself is exact only as
      far as float32 holds it: integers up to 2^24, then steps of ``ulp(p)``). With
      ``mrope_section``: ``[A, ...]``, one row of positions per axis (Qwen2-VL: A = 3,
      temporal / height / width).
    inv_freq: ``[R/2]`` float radians per token. A float64 numpy array keeps the exact float64
      frequencies; a float32 array is taken as the exact number it holds.
    mrope_section: optional A positive ints summing to R/2: frequencies ``0..s0-1`` take positions
      row 0, the next ``s1`` row 1, ... (Qwen2-VL ``rope_parameters["mrope_section"]``,
      arXiv 2409.12191).
    phase_precision: ``"exact"`` (default; cos/sin within 3e-7 of the float64 value, see the
      module docstring) or ``"float32"`` (``cos(float32(p) * float32(theta))``, bit-matching HF /
      Meta / vLLM).

  Returns:
    ``(cos, sin)``, each ``[..., R/2]`` float32. Under jit (traced positions, not checked):
    negative positions give the exact cos/sin of ``p * theta``; float positions that are NaN or
    inf give NaN, and so do finite ones with ``|p| >= 2^31`` under exact phases (``"float32"``
    phases take them as float32 numbers, as HF does); integers wider than int32 (int64 under x64, uint32) with
    ``|p| >= 2^31`` give NaN (not a wrapped int32 phase).

  Raises:
    ValueError: ``inv_freq`` not rank 1 or (concrete) not finite; ``mrope_section`` not positive
      ints summing to R/2 or ``positions.shape[0]`` not ``len(mrope_section)``; concrete positions
      negative, >= 2^31, not finite, or float64 values float32 cannot hold; bad
      ``phase_precision``.
    TypeError: ``positions`` not integer or float; ``inv_freq`` not float.

  Source: RoFormer arXiv 2104.09864 (phases); Qwen2-VL arXiv 2409.12191 and HF
  ``Qwen2VLRotaryEmbedding`` (mrope_section); exact reduction: this module's docstring.
  """
  if phase_precision not in PHASE_PRECISIONS:
    raise ValueError(f"phase_precision must be one of {PHASE_PRECISIONS}, got {phase_precision!r}")
  inv_freq = _check_inv_freq(inv_freq)
  given = _checks.as_array("positions", positions)
  positions = _checks.rope_positions("positions", given)
  # Traced integers wider than int32 (int64 under x64, uint32): rope_positions casts them to int32,
  # so |p| >= 2^31 would wrap; their cos/sin are NaN instead. (Concrete ones are refused.)
  wide = (
    isinstance(given, jax.core.Tracer)
    and jnp.issubdtype(given.dtype, jnp.integer)
    and jnp.iinfo(given.dtype).bits >= 32
    and given.dtype != jnp.int32
  )
  if wide:
    given_wide = given
  if mrope_section is not None:
    axis_of = _mrope_axes(mrope_section, inv_freq.shape[0], positions)
    positions = jnp.moveaxis(positions, 0, -1)[..., axis_of]  # [..., R/2]
  else:
    positions = positions[..., None]  # [..., 1]
  lead = (1,) * (positions.ndim - 1) + (-1,)  # [R/2] -> [1, ..., 1, R/2] (no rank promotion)
  if phase_precision == "float32":
    angles = positions.astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32).reshape(lead)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
  else:
    hi, lo, turns = (jnp.asarray(w).reshape(lead) for w in _turn_words(inv_freq))
    theta = jnp.asarray(inv_freq, jnp.float32).reshape(lead)
    cos, sin = _exact_cos_sin_jvp(positions, theta, hi, lo, turns)
  if wide:
    p = given_wide if mrope_section is None else jnp.moveaxis(given_wide, 0, -1)[..., axis_of]
    p = p if mrope_section is not None else p[..., None]
    if jnp.issubdtype(p.dtype, jnp.signedinteger):
      bad = (p < -_checks.MAX_POSITION) | (p >= _checks.MAX_POSITION)
    else:
      bad = p >= _checks.MAX_POSITION
    cos, sin = jnp.where(bad, jnp.nan, cos), jnp.where(bad, jnp.nan, sin)
  return cos, sin


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


def _check_scale(scale, target: tuple[int, ...]):
  """``scale``: a real number or a real array broadcastable to ``target`` ``[B, T, N, R/2]``; finite
  when concrete. ArgTypeError for strings, bools, complex; ValueError otherwise."""
  if isinstance(scale, (str, bytes, bool, np.bool_, complex, np.complexfloating)):
    raise _checks.ArgTypeError(f"scale must be a float (or float array), got {scale!r}")
  scale = _checks.as_array("scale", scale)
  if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
    raise _checks.ArgTypeError(f"scale must be a float (or float array), got dtype {scale.dtype}")
  if jnp.ndim(scale) > 0:
    _checks.broadcastable("scale", scale.shape, target, "[B, T, N, R/2]")
  if not isinstance(scale, jax.core.Tracer):
    if not np.all(np.isfinite(np.asarray(scale, np.float64))):
      raise ValueError("scale must be finite")
    if jnp.ndim(scale) == 0:
      return float(scale)
  return scale


def _check_inv_freq(inv_freq):
  inv_freq = _checks.as_array("inv_freq", inv_freq)
  if isinstance(inv_freq, np.ndarray) and inv_freq.dtype.kind in "iu":
    inv_freq = inv_freq.astype(np.float64)  # a list or tuple of Python numbers, e.g. [1, 0.5]
  _checks.check_rank("inv_freq", inv_freq, 1, "[R/2]")
  _checks.check_float("inv_freq", inv_freq)
  if inv_freq.shape[0] == 0:
    raise ValueError("inv_freq must have at least one frequency ([R/2] with R >= 2), got shape (0,)")
  if not isinstance(inv_freq, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(inv_freq, np.float64))):
    raise ValueError("inv_freq must be finite (radians per token)")
  return inv_freq


def _mrope_axes(mrope_section, half: int, positions) -> np.ndarray:
  """``[R/2]`` index of the position row each frequency uses."""
  sections = list(mrope_section)
  if not sections or any(
    isinstance(s, bool) or not isinstance(s, int | np.integer) or s <= 0 for s in sections
  ):
    raise ValueError(f"mrope_section must be a list of positive ints, got {mrope_section!r}")
  if sum(sections) != half:
    raise ValueError(
      f"mrope_section must sum to R/2 = len(inv_freq) = {half}, got {sections} (sum {sum(sections)})"
    )
  if jnp.ndim(positions) < 1 or positions.shape[0] != len(sections):
    raise ValueError(
      f"with mrope_section of {len(sections)} sections, positions must have shape [{len(sections)}, ...] "
      f"(one row per axis), got shape {jnp.shape(positions)}"
    )
  return np.repeat(np.arange(len(sections)), sections)


def apply_rope(
  x: jax.Array,
  positions: jax.Array,
  *,
  inv_freq: jax.Array | np.ndarray | None = None,
  base: float = 10000.0,
  layout: Layout = "interleaved",
  scale: float | jax.Array = 1.0,
  rotated_slice: RotatedSlice = "leading",
  mrope_section=None,
  phase_precision: PhasePrecision = "exact",
) -> jax.Array:
  """Rotates queries or keys by their positions: ``x_pair * exp(1j * position * inv_freq)``.

  Args:
    x: ``[B, T, N, H]`` float array (queries ``[B, T, N, H]`` or keys ``[B, S, K, H]``).
    positions: token indices of the rows of ``x``: ``[B, T]``, or ``[1, T]`` / ``[T]`` shared by
      the batch; integers (any int dtype, values in ``[0, 2^31)``) or floats (see
      ``rope_cos_sin``). With ``mrope_section``: ``[A, B, T]``, ``[A, 1, T]`` or ``[A, T]``.
    inv_freq: ``[R/2]`` float radians per token, ``R <= H``; the other ``H - R`` dims pass
      through. Default: ``rope_inv_freq(H, base=base)`` in float64.
    base: rope_theta used when ``inv_freq`` is None.
    layout: ``"interleaved"`` (complex, Meta) or ``"half"`` (rotate-half, GPT-NeoX/HF), within the
      rotated slice.
    scale: multiplies each rotated pair: a scalar (HF's ``attention_scaling`` for YaRN/LongRoPE)
      or a float array broadcastable to ``[B, T, N, R/2]`` (xPos). Default 1.
    rotated_slice: which R dims rotate: ``"leading"`` (``x[..., :R]``, default) or ``"trailing"``
      (``x[..., H-R:]``, MLA-style ``[nope | rope]`` heads such as DeepSeek-V2/V3).
    mrope_section: multi-axis RoPE (Qwen2-VL); see ``rope_cos_sin``.
    phase_precision: ``"exact"`` (default) or ``"float32"``; see ``rope_cos_sin``.

  Returns:
    ``[B, T, N, H]`` array of ``x.dtype``.

  Raises:
    ValueError: wrong ranks, positions not ``[B, T]``/``[1, T]``/``[T]`` for x's B and T, odd H,
      ``R > H``, empty ``inv_freq``, unknown ``layout``/``rotated_slice``/``phase_precision``,
      concrete positions negative, >= 2^31, not finite or (float64) not held by float32, ``scale``
      not finite or not broadcastable to ``[B, T, N, R/2]``, bad ``mrope_section``.
    TypeError: non-float ``x`` or ``inv_freq`` (int, bool, complex, strings), positions neither
      integer nor float, ``scale`` a string, bool or complex, ``base`` not a real number.

  Under jit, traced positions are not checked: see ``rope_cos_sin`` for what negative, non-finite
  and too-wide positions give (exact rotations, or NaN rows). ``x`` of any float dtype (bfloat16,
  float16) is rotated in float32 and cast back; NaN in ``x`` stays in its pair.

  Source: RoFormer arXiv 2104.09864; Meta LLaMA ``apply_rotary_emb`` (interleaved), HF
  ``apply_rotary_pos_emb`` (half), HF ``Qwen2VLRotaryEmbedding`` (mrope_section).
  """
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 4, "[B, T, N, H]")
  _checks.check_float("x", x)
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if rotated_slice not in ("leading", "trailing"):
    raise ValueError(f"rotated_slice must be 'leading' or 'trailing', got {rotated_slice!r}")
  positions = _batch_positions(positions, x.shape[:2], multi_axis=mrope_section is not None)
  head_dim = x.shape[-1]
  if inv_freq is None:
    _checks.check_positive_int("x.shape[-1] (head_dim)", head_dim, even=True)
    inv_freq = rope_inv_freq(head_dim, base=base, dtype=np.float64)
  inv_freq = _check_inv_freq(inv_freq)
  rotary_dim = 2 * inv_freq.shape[0]
  if rotary_dim > head_dim:
    raise ValueError(
      f"inv_freq has {inv_freq.shape[0]} frequencies (rotary_dim {rotary_dim}) but head_dim is "
      f"{head_dim}; rotary_dim must be <= head_dim"
    )
  scale = _check_scale(scale, (*x.shape[:3], rotary_dim // 2))
  cos, sin = rope_cos_sin(positions, inv_freq, mrope_section=mrope_section, phase_precision=phase_precision)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B or 1, T, 1, R/2]
  if isinstance(scale, jax.Array | np.ndarray) or float(scale) != 1.0:
    scale = jnp.asarray(scale, jnp.float32)
    cos, sin = cos * scale, sin * scale
  if 4 * cos.size <= x.size:
    cos, sin = _computed_once(cos, sin)
  rot = jax.lax.complex(cos, sin)  # exp(1j * phase), complex64
  split = rotary_dim if rotated_slice == "leading" else head_dim - rotary_dim
  first, second = x[..., :split], x[..., split:]
  x_rot = (first if rotated_slice == "leading" else second).astype(jnp.float32)
  if layout == "interleaved":
    pairs = x_rot.reshape(*x_rot.shape[:-1], rotary_dim // 2, 2)
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * rot
    out = jnp.stack([z.real, z.imag], axis=-1).reshape(x_rot.shape)
  else:
    half = rotary_dim // 2
    z = jax.lax.complex(x_rot[..., :half], x_rot[..., half:]) * rot
    out = jnp.concatenate([z.real, z.imag], axis=-1)
  out = out.astype(x.dtype)
  if rotary_dim == head_dim:
    return out
  parts = [out, second] if rotated_slice == "leading" else [first, out]
  return jnp.concatenate(parts, axis=-1)


def _computed_once(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """``arrays`` unchanged (bit for bit), each computed once into a buffer rather than per element
  of the op that reads it.

  XLA:CPU fuses an elementwise producer (the exact-phase cos/sin, about 60 operations per value, or
  XLA's ``cos``/``sin``) into its consumer's loop and redoes it for every element the consumer
  reads it at: for every head and both halves of each pair in ``apply_rope``, for every batch row
  when a table is broadcast. It does not duplicate an "expensive" producer (a float divide) into
  a consumer that reuses elements (a broadcast), so dividing by an exact 1.0 that XLA cannot fold
  materializes the array: ``a / (a == a)`` (1.0 for every number and infinity; NaN stays NaN).
  The divisor must not be a broadcast (XLA rewrites ``a / broadcast(c)`` into
  ``a * broadcast(1 / c)``, cheap and fused again), and ``jax.lax.optimization_barrier`` does not
  help: XLA:CPU removes it before fusion. Checked in the optimized HLO (``compiled.as_text()``:
  a separate fusion writes the array) and by ``benchmarks/ops_bench.py``.
  """
  return tuple(a / (a == a).astype(a.dtype) for a in arrays)


def _batch_positions(positions, bt: tuple[int, int], *, multi_axis: bool):
  """Positions as ``[B or 1, T]`` (``[A, B or 1, T]`` with ``multi_axis``) for x's ``(B, T)``."""
  positions = _checks.as_array("positions", positions)
  lead = positions.shape[:1] if multi_axis else ()
  shape = positions.shape[len(lead) :]
  b, t = bt
  hint = "[A, B, T], [A, 1, T] or [A, T]" if multi_axis else "[B, T], [1, T] or [T]"
  if shape == (t,):
    positions = positions.reshape(*lead, 1, t)
  elif not (len(shape) == 2 and shape[1] == t and shape[0] in (1, b)):
    raise ValueError(
      f"positions must have shape {hint} for x of B = {b}, T = {t}, got shape {positions.shape}"
    )
  return positions
