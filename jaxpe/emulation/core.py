"""RoPE-emulated ALiBi: ALiBi carried by RoPE machinery, with error bounds and a precision policy.

The construction (order k = 1, the published one). Per head h with slope m_h, two dims are appended
to q and k with fixed parts ``q_fixed = (-N_h, 0)`` and ``k_fixed = (0, 1)``. The original H dims get
RoPE frequency 0 (no rotation); the new pair gets frequency theta (radians per token). After
rotation (complex layout, query at position i, key at position j):

    (R_i q_fixed) . (R_j k_fixed) = N_h sin((j - i) theta) = -N_h sin(d theta),   d = i - j,

and after the usual ``1/sqrt(H)`` scaling (H the *original* head dim) the score term is
``-(N_h / sqrt(H)) sin(d theta) ~= -m_h d`` when ``N_h = m_h sqrt(H) / theta``.

Higher order k. k pairs at frequencies ``theta, 2 theta, ..., k theta`` with fixed parts
``q_r = (-w_r N_h, 0)``, ``k_r = (0, 1)`` give the bias ``-(m_h / theta) sum_r w_r sin(r d theta)``.
The weights solve ``sum_r w_r r = 1`` and ``sum_r w_r r^(2p+1) = 0`` for ``p = 1..k-1`` (the Taylor
terms ``x^3 .. x^(2k-1)`` cancel); in closed form (the central-difference weights of Fornberg,
Math. Comp. 51 (1988) 699):

    w_r = 2 (-1)^(r+1) (k!)^2 / (r (k - r)! (k + r)!)          k = 2: (8 sin x - sin 2x) / 6.

Error bound (truncation). With ``x = d theta`` and ``e_k(x) = x - sum_r w_r sin(r x)``,
``|e_k(x)| <= |c_k| x^(2k+1) + sum_r |w_r| (r x)^(2k+3) / (2k+3)!`` where
``c_k = sum_r w_r r^(2k+1) / (2k+1)!`` (Taylor's theorem with the Lagrange remainder of each sine;
``|c_1| = 1/6``, ``|c_2| = 1/30``, ``|c_3| = 1/140``). The bias deviation is ``(m_h / theta) e_k(x)``,
largest at the largest distance ``d = max_len - 1``.

Error bound (rounding), a model calibrated by measurement, not a proof. The emulation dims carry
values ``w_r N_h sin(i r theta)`` of size ``~ w_r r m_h sqrt(H) i``: they grow with the *absolute*
position i, and the cancellation between the query-side and key-side products leaves an absolute
error ``~ u m_h sqrt(H) i`` (u the unit roundoff of the dtype that carries those dims). After
``1/sqrt(H)`` this is bounded by ``ROUNDING_CONSTANT * u * m_h * S_k * (i + j + d)``, with
``S_k = sum_r r |w_r|`` (1, 5/3, 11/5 for k = 1, 2, 3); the same form (``S = 1``) holds for the exact
augmented baseline. u = 2^-24 (float32), 2^-8 (bfloat16), 2^-11 (float16).

Precision policy. The emulation dims are built and rotated in float32 whatever the input dtype
(phases ``position * theta`` in float32; amplitudes from the float32-rounded frequencies) and the
augmented q and k are returned in float32, so that ``jaxpe.attention.dot_product_attention`` (an
einsum with ``preferred_element_type=float32``) forms their product in float32 too: with bf16
activations only the content dims carry bf16 values (exactly representable in float32). Carrying the
emulation dims in bf16 (``out_dtype=jnp.bfloat16``, for measurement) gives errors of whole logits
at positions of a few thousand; float16 is refused when an amplitude overflows it (N_h is ~1e6).

Sources: the construction in ``shared/DESIGN.md`` section 3 (RoPE: Su et al., arXiv 2104.09864;
ALiBi: Press et al., arXiv 2108.12409). The higher-order, base-constrained, augmented and padded
forms are this module's extensions (derivations above and in ``docs/emulation.md``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.alibi import alibi_slopes_f64
from jaxpe.ops.rope import rope_inv_freq

# Unit roundoff (half the machine epsilon) of the dtypes that can carry the emulation dims.
UNIT_ROUNDOFF: dict[str, float] = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# Largest finite value of those dtypes.
DTYPE_MAX: dict[str, float] = {
  "float32": 3.4028234663852886e38,
  "bfloat16": 3.3895313892515355e38,
  "float16": 65504.0,
}
# Constant of the rounding model (see the module docstring); measured worst cases are below 1/2 of it.
ROUNDING_CONSTANT = 4.0
# Positions must be exact in float32 (phases are computed as float32(position) * theta).
MAX_POSITION = 2**24
# Largest head-dim multiple pad_head_dim pads to (kernels use 8 or 128; 2^30 would allocate gigabytes).
MAX_PAD_MULTIPLE = 4096
# Cap on the phase the target-error solver may choose (radians); well below pi/2.
_MAX_SOLVED_PHASE = 1.0

_DTYPE_NAMES = tuple(UNIT_ROUNDOFF)


def _dtype_name(dtype) -> str:
  """Canonical name of a dtype-like (``"float32"``, ``jnp.bfloat16``, ...); ValueError otherwise."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = str(dtype)
  if name not in _DTYPE_NAMES:
    raise ValueError(f"dtype must be one of {_DTYPE_NAMES} for the emulation dims, got {dtype!r}")
  return name


def _check_order(order) -> int:
  order = _checks.check_positive_int("order", order)
  if order > 8:
    raise ValueError(f"order must be in 1..8 (weights grow and cancel badly beyond), got {order}")
  return order


def _check_real(name: str, value) -> None:
  """TypeError for a value that is not a real number (bool, str, bytes, None, an array of > 1 value)."""
  if isinstance(value, bool | np.bool_ | str | bytes) or value is None or np.ndim(value) != 0:
    raise TypeError(f"{name} must be a real number, got {value!r}")
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a concrete Python number, not a value traced under jit")


def _check_max_phase(max_phase) -> float:
  _check_real("max_phase", max_phase)
  try:
    phase = float(max_phase)
  except (TypeError, ValueError):
    raise ValueError(f"max_phase must be a number in (0, pi/2), got {max_phase!r}") from None
  if not (0.0 < phase < math.pi / 2):
    raise ValueError(
      f"max_phase must be in (0, pi/2) radians (sin(d theta) must stay monotonic), got {phase}; "
      "choose a smaller max_phase (0.1 is the published choice)"
    )
  return phase


def _slopes_or_heads(slopes, num_heads) -> np.ndarray:
  if (slopes is None) == (num_heads is None):
    raise ValueError("give exactly one of slopes ([N] ALiBi slopes) or num_heads (paper slopes)")
  if slopes is None:
    return alibi_slopes_f64(num_heads)
  slopes = _slopes_array(slopes)
  if slopes.ndim != 1 or slopes.size == 0:
    raise ValueError(f"slopes must have shape [N] with N >= 1, got shape {slopes.shape}")
  if not np.all(np.isfinite(slopes)) or np.any(slopes <= 0):
    raise ValueError(f"slopes must be finite and > 0 (ALiBi penalises distance), got {slopes.tolist()}")
  return slopes


def _slopes_array(slopes) -> np.ndarray:
  """Concrete slopes as float64 numpy; TypeError for traced, non-numeric or bool slopes."""
  if isinstance(slopes, jax.core.Tracer):
    raise ValueError("slopes must be concrete (numpy or Python numbers), not traced under jit")
  try:
    arr = np.asarray(slopes)
  except Exception:  # noqa: BLE001  (ragged lists)
    raise TypeError(f"slopes must be a [N] float array, got {slopes!r}") from None
  if arr.dtype == np.bool_ or not (
    np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
  ):
    raise TypeError(f"slopes must be a [N] float array, got dtype {arr.dtype}")
  if arr.ndim != 1 or arr.size == 0:
    raise ValueError(f"slopes must have shape [N] with N >= 1, got shape {arr.shape}")
  return arr.astype(np.float64)


# ------------------------------------------------------------------------------------ theory


def emulation_weights(order: int) -> np.ndarray:
  """Weights ``w_r`` (r = 1..k) with ``sum_r w_r sin(r x) = x + O(x^(2k+1))``.

  ``w_r = 2 (-1)^(r+1) (k!)^2 / (r (k - r)! (k + r)!)``: k = 1 gives ``[1]`` (the published
  construction), k = 2 ``[4/3, -1/6]``, k = 3 ``[3/2, -3/10, 1/30]``.

  Args:
    order: k, the number of emulation pairs; 1..8.

  Returns:
    ``[k]`` float64 weights.

  Raises:
    ValueError: ``order`` not an integer in 1..8.

  Source: central-difference weights for a first derivative (Fornberg, Math. Comp. 51 (1988) 699),
  applied to ``exp(i x)``.
  """
  k = _check_order(order)
  f = math.factorial
  return np.asarray(
    [2.0 * (-1) ** (r + 1) * f(k) ** 2 / (r * f(k - r) * f(k + r)) for r in range(1, k + 1)], np.float64
  )


def leading_error_coefficient(order: int) -> float:
  """``|c_k|`` in ``x - sum_r w_r sin(r x) = c_k x^(2k+1) + ...`` (1/6, 1/30, 1/140 for k = 1, 2, 3).

  Raises:
    ValueError: ``order`` not an integer in 1..8.
  """
  k = _check_order(order)
  w = emulation_weights(k)
  r = np.arange(1, k + 1, dtype=np.float64)
  return float(abs(np.sum(w * r ** (2 * k + 1))) / math.factorial(2 * k + 1))


def truncation_error_bound(x, *, order: int = 1) -> np.ndarray:
  """Bound on ``|x - sum_r w_r sin(r x)|`` for phases ``x >= 0`` (radians).

  ``|c_k| x^(2k+1) + sum_r |w_r| (r x)^(2k+3) / (2k+3)!``: the first Taylor term that does not
  cancel plus the Lagrange remainder of order 2k+3 of every sine (each derivative of sin is <= 1).
  Increasing in x. Multiply by ``m / theta`` for the bias deviation in logits.

  Args:
    x: phase ``d theta`` (radians), array-like, >= 0.
    order: k; 1..8.

  Returns:
    float64 array shaped like ``x``.

  Raises:
    ValueError: bad ``order`` or negative ``x``.
  """
  k = _check_order(order)
  x = np.abs(np.asarray(x, np.float64))
  w = np.abs(emulation_weights(k))
  r = np.arange(1, k + 1, dtype=np.float64)
  tail = np.sum(w * r ** (2 * k + 3)) / math.factorial(2 * k + 3)
  return leading_error_coefficient(k) * x ** (2 * k + 1) + tail * x ** (2 * k + 3)


def rounding_sum(order: int) -> float:
  """``S_k = sum_r r |w_r|``, the size of the emulation dims relative to k = 1 (1, 5/3, 11/5).

  Raises:
    ValueError: ``order`` not an integer in 1..8.
  """
  k = _check_order(order)
  return float(np.sum(np.arange(1, k + 1) * np.abs(emulation_weights(k))))


def emulation_error_bound(
  slopes,
  *,
  theta,
  distance,
  position,
  order: int | None = 1,
  dtype="float32",
) -> np.ndarray:
  """Predicted bound on ``|emulated bias - (-m d)|`` in logits (after the ``1/sqrt(H)`` scale).

  ``(m / theta) e_k(d theta)`` (truncation, see ``truncation_error_bound``) plus
  ``ROUNDING_CONSTANT * u * m * S_k * (i + j + d)`` (rounding model, module docstring), for a
  query at position ``i = position`` and a key at ``j = i - d``.

  Args:
    slopes: ``[N]`` ALiBi slopes, > 0.
    theta: base frequency in radians per token, a float or ``[N]``; ignored for ``order=None``.
    distance: d = i - j >= 0 (token indices), array-like.
    position: i, the query's absolute position (token index), array-like broadcastable with
      ``distance``.
    order: k (1..8) for the rotated form; ``None`` for the exact augmented form (no truncation,
      ``S = 1``).
    dtype: dtype that carries the emulation dims: ``"float32"`` (the policy), ``"bfloat16"`` or
      ``"float16"``.

  Returns:
    ``[N, *broadcast(distance, position).shape]`` float64 logits.

  Raises:
    ValueError: bad slopes, theta (not finite > 0, or not a number / ``[N]``), order or dtype;
      distance or position negative, NaN or inf, or shapes that do not broadcast.
    TypeError: non-numeric distance, position or theta.
  """
  slopes = _slopes_or_heads(slopes, None)
  u = UNIT_ROUNDOFF[_dtype_name(dtype)]
  arrays = []
  for name, value in (("distance", distance), ("position", position)):
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or not (
      np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
      raise TypeError(f"{name} must be a number or an array of token counts, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
      raise ValueError(
        f"{name} must be finite and >= 0 (token indices, key at or before the query), got {arr.tolist()}"
      )
    arrays.append(arr)
  try:
    d, i = np.broadcast_arrays(*arrays)
  except ValueError:
    raise ValueError(
      f"distance and position must broadcast together, got shapes {arrays[0].shape} and {arrays[1].shape}"
    ) from None
  extra = (None,) * d.ndim
  m = slopes[(slice(None), *extra)]
  j = np.maximum(i - d, 0.0)
  if order is None:
    return ROUNDING_CONSTANT * u * m * (i + j + d)[None]
  if np.ndim(theta) == 0:
    _check_real("theta", theta)
  theta = np.asarray(theta, np.float64)
  if theta.shape not in ((), slopes.shape):
    raise ValueError(f"theta must be a number or [N] = {list(slopes.shape)} of them, got shape {theta.shape}")
  theta = np.broadcast_to(theta, slopes.shape)
  if not np.all(np.isfinite(theta)) or np.any(theta <= 0):
    raise ValueError(f"theta must be finite and > 0 radians per token, got {theta.tolist()}")
  th = theta[(slice(None), *extra)]
  trunc = m / th * truncation_error_bound(d[None] * th, order=order)
  return trunc + ROUNDING_CONSTANT * u * m * rounding_sum(order) * (i + j + d)[None]


# ------------------------------------------------------------------------------------ solver


def emulation_theta(*, max_phase: float, max_len: int) -> float:
  """Frequency theta = max_phase / max_len, so that the largest phase ``d theta`` stays ``< max_phase``.

  Args:
    max_phase: largest rotation angle in radians over the context; ``0 < max_phase < pi/2``
      (sin is monotonic only below pi/2; 0.1 gives a 1.7e-3 relative bias error).
    max_len: longest context in tokens (the largest distance is ``max_len - 1``); 1..2^24.

  Returns:
    theta in radians per token (Python float).

  Raises:
    ValueError: ``max_phase`` outside (0, pi/2) (NaN too) or ``max_len`` not an integer in 1..2^24.
    TypeError: ``max_phase`` not a real number (a string, a bool, None).
  """
  max_len = _checks.check_positive_int("max_len", max_len)
  if max_len > MAX_POSITION:
    raise ValueError(f"max_len must be <= 2^24 = {MAX_POSITION} (positions exact in float32), got {max_len}")
  return _check_max_phase(max_phase) / max_len


def emulation_amplitudes(slopes, *, head_dim: int, theta) -> np.ndarray:
  """Per-head amplitudes ``N_h = m_h sqrt(H) / theta`` in float64 on the host.

  Args:
    slopes: ``[N]`` ALiBi slopes m_h (> 0), array-like.
    head_dim: H, the original (content) head dim; positive.
    theta: frequency of the (first) emulation pair in radians per token; ``> 0``; float or ``[N]``.

  Returns:
    ``[N]`` float64 amplitudes.

  Raises:
    ValueError: slopes not ``[N]`` (N >= 1), not finite or <= 0; head_dim not a positive int; theta
      not finite and > 0 (NaN, inf, 0, negative) or of another shape than ``[N]``.
    TypeError: non-numeric slopes or theta (a string, a bool).
  """
  slopes = _slopes_array(slopes)
  _checks.check_slopes("slopes", slopes)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  if np.ndim(theta) == 0:
    _check_real("theta", theta)
  theta = np.asarray(theta, np.float64)
  if theta.ndim == 0:
    theta = np.float64(_checks.check_positive_float("theta", float(theta)))
  elif theta.shape != slopes.shape or not np.all(np.isfinite(theta)) or np.any(theta <= 0):
    raise ValueError(f"theta must be a number > 0 or [N] = {slopes.shape} of them, got {theta.tolist()}")
  return slopes * math.sqrt(head_dim) / theta


@dataclasses.dataclass(frozen=True)
class EmulationPlan:
  """Per-head parameters of the emulation and their predicted worst-case deviation from ALiBi.

  All arrays are float64 numpy, ``[N]`` unless noted; deviations are in logits (after the
  ``1/sqrt(H)`` scale), maximised over query and key positions ``0 <= j <= i < max_len``.

  Attributes:
    slopes: m_h.
    head_dim: H (content dims).
    max_len: longest context in tokens.
    order: k, number of emulation pairs.
    dtype: dtype carrying the emulation dims (``"float32"`` under the policy).
    theta: base frequency per head (radians per token); pair r rotates at ``r theta``.
    weights: ``[k]`` pair weights w_r.
    amplitudes: N_h = m_h sqrt(H) / theta_h (pair r carries ``w_r N_h``).
    max_phase: ``theta (max_len - 1)``, the largest phase of the first pair.
    truncation_bound: ``(m / theta) e_k(max_phase)``.
    rounding_bound: ``ROUNDING_CONSTANT u m S_k 2 (max_len - 1)``.
  """

  slopes: np.ndarray
  head_dim: int
  max_len: int
  order: int
  dtype: str
  theta: np.ndarray
  weights: np.ndarray
  amplitudes: np.ndarray
  max_phase: np.ndarray
  truncation_bound: np.ndarray
  rounding_bound: np.ndarray

  @property
  def bound(self) -> np.ndarray:
    """``[N]`` predicted worst-case deviation: truncation + rounding."""
    return self.truncation_bound + self.rounding_bound

  def bound_at(self, distance, position) -> np.ndarray:
    """``[N, ...]`` predicted deviation at distance d and query position i (``emulation_error_bound``)."""
    return emulation_error_bound(
      self.slopes, theta=self.theta, distance=distance, position=position, order=self.order, dtype=self.dtype
    )


def _check_representable(amplitudes: np.ndarray, weights: np.ndarray, dtype: str, hint: str) -> None:
  biggest = float(np.max(np.abs(amplitudes)) * np.max(np.abs(weights)))
  if not math.isfinite(biggest) or biggest >= DTYPE_MAX[dtype]:
    raise ValueError(
      f"amplitude N = {biggest:.4g} is not representable in {dtype} (max {DTYPE_MAX[dtype]:.6g}); "
      f"carry the emulation dims in float32 (the policy) or {hint}"
    )


def _solve_phase(slope: float, dist: int, order: int, budget: float) -> float:
  """Largest phase x <= _MAX_SOLVED_PHASE with ``slope * dist * e_k(x) / x <= budget`` (bisection)."""
  if dist == 0:
    return _MAX_SOLVED_PHASE

  def err(x: float) -> float:
    return slope * dist * float(truncation_error_bound(x, order=order)) / x

  if err(_MAX_SOLVED_PHASE) <= budget:
    return _MAX_SOLVED_PHASE
  lo, hi = 0.0, _MAX_SOLVED_PHASE
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if mid <= 0.0 or mid == lo or mid == hi:
      break
    lo, hi = (mid, hi) if err(mid) <= budget else (lo, mid)
  if lo <= 0.0:
    raise ValueError(f"no phase meets an error budget of {budget:.3g} logits at distance {dist}")
  return lo


def solve_emulation(
  slopes=None,
  *,
  num_heads: int | None = None,
  head_dim: int,
  max_len: int,
  order: int = 1,
  max_phase: float | None = None,
  target_error: float | None = None,
  dtype="float32",
  shared_theta: bool = True,
) -> EmulationPlan:
  """Chooses theta and N per head for a context and predicts the worst deviation from ALiBi.

  Either ``max_phase`` fixes ``theta = max_phase / max_len`` (the published rule), or
  ``target_error`` (logits) asks for the largest theta whose predicted deviation over
  ``max_len`` stays within it (the rounding part does not depend on theta; what is left is given to
  truncation; phases are capped at 1 radian). With ``shared_theta`` (default, what one RoPE
  frequency table gives and what keeps k free of heads) all heads use the smallest per-head theta.

  Args:
    slopes: ``[N]`` ALiBi slopes (> 0); or give ``num_heads`` for the paper's slopes.
    num_heads: N, when ``slopes`` is None.
    head_dim: H, content dims per head (the score scale is ``1/sqrt(H)``); positive.
    max_len: longest context in tokens; 1..2^24 (positions must be exact in float32).
    order: k, number of emulation pairs (1 = published construction); 1..8.
    max_phase: largest phase of the first pair in radians, in (0, pi/2).
    target_error: wanted worst-case deviation in logits, > 0.
    dtype: dtype carrying the emulation dims, ``"float32"`` (default, the policy), ``"bfloat16"``
      or ``"float16"``.
    shared_theta: one theta for all heads (True) or one per head.

  Returns:
    An ``EmulationPlan``.

  Raises:
    ValueError: both or neither of slopes/num_heads or max_phase/target_error; non-positive
      slopes; phase >= pi/2; a target below the dtype's rounding floor; an amplitude N that
      overflows ``dtype``; bad sizes. Each message says what to change.
    TypeError: a non-bool ``shared_theta``; a string or bool ``max_phase`` / ``target_error``.
  """
  slopes = _slopes_or_heads(slopes, num_heads)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  max_len = _checks.check_positive_int("max_len", max_len)
  if max_len > MAX_POSITION:
    raise ValueError(f"max_len must be <= 2^24 = {MAX_POSITION} (positions exact in float32), got {max_len}")
  if not isinstance(shared_theta, bool | np.bool_):
    raise TypeError(f"shared_theta must be a bool, got {shared_theta!r}")
  if target_error is not None:
    _check_real("target_error", target_error)
  order = _check_order(order)
  dtype = _dtype_name(dtype)
  if (max_phase is None) == (target_error is None):
    raise ValueError("give exactly one of max_phase (radians) or target_error (logits)")
  weights = emulation_weights(order)
  dist = max_len - 1
  u = UNIT_ROUNDOFF[dtype]
  rounding = ROUNDING_CONSTANT * u * slopes * rounding_sum(order) * 2.0 * dist
  if max_phase is not None:
    theta = np.full(slopes.shape, emulation_theta(max_phase=max_phase, max_len=max_len))
  else:
    target = _checks.check_positive_float("target_error", target_error)
    if np.any(rounding >= target):
      raise ValueError(
        f"target_error {target:.3g} logits is below the {dtype} rounding floor "
        f"{float(rounding.max()):.3g} at context {max_len}; raise target_error or shorten max_len"
        + ("" if dtype == "float32" else ", or carry the emulation dims in float32 (the policy)")
      )
    phases = np.asarray([_solve_phase(m, dist, order, target - r) for m, r in zip(slopes, rounding)])
    theta = phases / max(dist, 1)
    if shared_theta:
      theta = np.full(slopes.shape, theta.min())
  # The op rounds theta to float32 before use; plan with that value, rounded down (a larger theta
  # would exceed a target error).
  theta32 = theta.astype(np.float32)
  theta32 = np.where(theta32.astype(np.float64) > theta, np.nextafter(theta32, np.float32(0)), theta32)
  theta = np.asarray(theta32, np.float64)
  amplitudes = slopes * math.sqrt(head_dim) / theta
  _check_representable(
    amplitudes, weights, dtype, "raise max_phase (N = m sqrt(H) / theta shrinks as theta grows)"
  )
  x = theta * dist
  return EmulationPlan(
    slopes=slopes,
    head_dim=head_dim,
    max_len=max_len,
    order=order,
    dtype=dtype,
    theta=theta,
    weights=weights,
    amplitudes=amplitudes,
    max_phase=x,
    truncation_bound=slopes / theta * truncation_error_bound(x, order=order),
    rounding_bound=rounding,
  )


# ------------------------------------------------------------------------------------ ops


def pad_head_dim(x: jax.Array, *, multiple: int = 8) -> jax.Array:
  """Appends zero dims so the last axis becomes a multiple of ``multiple``.

  Zero dims add nothing to ``q . k`` and zero value dims produce zero outputs that are sliced off,
  so padding q, k and v changes no result; kernels that want head dims in multiples of 8 need it.

  Args:
    x: ``[..., H]`` array (q ``[B, T, N, Hq]``, k ``[B, S, K, Hq]`` or v ``[B, S, K, H]``).
    multiple: int in 1..4096 (``MAX_PAD_MULTIPLE``; kernels use 8 or 128).

  Returns:
    ``[..., ceil(H / multiple) * multiple]`` array of ``x.dtype``.

  Raises:
    ValueError: ``multiple`` not an integer in 1..``MAX_PAD_MULTIPLE`` (4096).
    TypeError: ``x`` not a jax or numpy array of rank >= 1.
  """
  multiple = _checks.check_positive_int("multiple", multiple)
  if multiple > MAX_PAD_MULTIPLE:
    raise ValueError(
      f"multiple must be in 1..{MAX_PAD_MULTIPLE} (a kernel's head-dim multiple), got {multiple}"
    )
  if not isinstance(x, jax.Array | np.ndarray) or x.ndim == 0:
    raise TypeError(f"x must be an array of rank >= 1 ([..., H]), got {type(x).__name__} {jnp.shape(x)}")
  extra = -x.shape[-1] % multiple
  if extra == 0:
    return x
  return jnp.concatenate([x, jnp.zeros((*x.shape[:-1], extra), x.dtype)], axis=-1)


def _check_qk(q, k, q_positions, k_positions):
  _checks.check_rank("q", q, 4, "[B, T, N, H]")
  _checks.check_rank("k", k, 4, "[B, S, K, H]")
  _checks.check_float("q", q)
  _checks.check_float("k", k)
  batch, t_len, num_heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"k must have shape [B, S, K, H] = [{batch}, S, K, {head_dim}], got {k.shape}")
  if num_heads == 0 or k.shape[2] == 0:
    raise ValueError(f"q and k need at least one head (N >= 1, K >= 1), got N={num_heads}, K={k.shape[2]}")
  if num_heads % k.shape[2]:
    raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads K={k.shape[2]}")
  for name, pos, x in (("q_positions", q_positions, q), ("k_positions", k_positions, k)):
    _checks.check_rank(name, pos, 2, "[B, T]" if name[0] == "q" else "[B, S]")
    _checks.check_positions(name, pos)
    if pos.shape != x.shape[:2]:
      raise ValueError(f"{name} shape {pos.shape} must equal {name[0]}.shape[:2] = {x.shape[:2]}")
    if not isinstance(pos, jax.core.Tracer) and np.asarray(pos).size:
      if int(np.asarray(pos).max()) >= MAX_POSITION:
        raise ValueError(f"{name} must be < 2^24 (exact in float32), got max {int(np.asarray(pos).max())}")


def apply_rope_alibi(
  q: jax.Array,
  k: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  theta,
  order: int = 1,
  out_dtype=jnp.float32,
  pad_multiple: int = 1,
) -> tuple[jax.Array, jax.Array]:
  """Appends the 2k emulation dims to q and k and rotates them (content dims at frequency 0).

  Score with the returned arrays, scaled by ``1/sqrt(H)`` of the *original* head dim:
  ``q_aug . k_aug / sqrt(H) = q . k / sqrt(H) - (m_h / theta) sum_r w_r sin(r (i - j) theta)``.
  Layout: ``[content H | pair 1 | ... | pair k | zero padding]``, each pair ``(re, im)`` (complex,
  interleaved layout); pair r of q is ``-w_r N_h (cos, sin)(r i theta)``, of k ``(-sin, cos)(r j theta)``.

  Args:
    q: ``[B, T, N, H]`` float queries (position-free content).
    k: ``[B, S, K, H]`` float keys (K kv heads; the key part of the emulation is head-independent
      when theta is shared).
    q_positions: ``[B, T]`` integer token indices of the queries, ``< 2^24``.
    k_positions: ``[B, S]`` integer token indices of the keys, ``< 2^24``.
    slopes: ``[N]`` ALiBi slopes (> 0), concrete (numpy or Python), one per query head.
    theta: base frequency in radians per token (``> 0``): a float (e.g. ``emulation_theta(...)``)
      or ``[N]`` per head (e.g. ``solve_emulation(...).theta``); rounded to float32.
    order: k, number of emulation pairs (1 = the published construction); 1..8.
    out_dtype: dtype of the returned q, k. float32 (default) is the precision policy; bfloat16
      only to measure what the policy avoids; float16 raises when an amplitude overflows it.
    pad_multiple: append zero dims so ``H + 2k`` becomes a multiple of this (8 for kernels that
      need it); 1 = no padding.

  Returns:
    ``(q_aug [B, T, N, Ha], k_aug [B, S, K', Ha])`` of ``out_dtype``, ``Ha = H + 2k`` rounded up to
    ``pad_multiple``; ``K' = K`` for a shared theta, N (keys repeated per group) for per-head theta.

  Raises:
    ValueError: wrong ranks or sizes, slope count != N, bad theta/order/slopes/positions, an
      amplitude that overflows ``out_dtype``.
    TypeError: non-float q/k, non-integer positions, non-numeric slopes (or theta). Traced slopes or
      theta: ValueError.
  """
  _check_qk(q, k, q_positions, k_positions)
  num_heads, head_dim = q.shape[2], q.shape[3]
  out_name = _dtype_name(out_dtype)
  order = _check_order(order)
  weights = emulation_weights(order)
  for name, value in (("slopes", slopes), ("theta", theta)):
    if isinstance(value, jax.core.Tracer):
      raise ValueError(f"{name} must be concrete (numpy or Python numbers), not traced under jit")
  slopes = _slopes_array(slopes)
  _checks.check_slopes("slopes", slopes)
  if slopes.shape[0] != num_heads:
    raise ValueError(f"slopes must have one entry per head (N = {num_heads}), got {slopes.shape[0]}")
  if np.ndim(theta) == 0:
    _check_real("theta", theta)
  theta = np.asarray(theta, np.float64)
  if not any(isinstance(p, jax.core.Tracer) for p in (q_positions, k_positions)):
    # sin(d theta) must stay monotonic: the largest base phase theta * |i - j| below pi/2.
    qp_np, kp_np = np.asarray(q_positions, np.int64), np.asarray(k_positions, np.int64)
    if qp_np.size and kp_np.size:
      span = max(qp_np.max() - kp_np.min(), kp_np.max() - qp_np.min())
      if span * float(np.max(theta)) >= math.pi / 2:
        raise ValueError(
          f"theta too large for these positions: theta * max|i - j| = {span * float(np.max(theta)):.3g} "
          ">= pi/2 rad; use a smaller theta (solve_emulation / emulation_theta with the real context)"
        )
  theta32 = np.asarray(theta.astype(np.float32), np.float64)  # the frequency the phases will use
  amplitudes = emulation_amplitudes(slopes, head_dim=head_dim, theta=theta32)  # validates theta
  _check_representable(amplitudes, weights, out_name, "use a larger theta (max_phase)")
  shared = theta.ndim == 0 or bool(np.all(theta == theta.reshape(-1)[0]))
  # Pair r of head h rotates at r theta_h; float32 like every RoPE phase.
  freqs = np.broadcast_to(theta32, (num_heads,))[:, None] * np.arange(1, order + 1)[None, :]  # [N, k]
  if shared:
    freqs = freqs[:1]
  freqs = jnp.asarray(freqs, jnp.float32)  # [N or 1, k]
  amp = jnp.asarray(-amplitudes[:, None] * weights[None, :], jnp.float32)  # [N, k]

  def phases(pos):  # [B, T] -> [B, T, N or 1, k] radians, float32
    return pos.astype(jnp.float32)[:, :, None, None] * freqs[None, None, :, :]

  qp, kp = phases(q_positions), phases(k_positions)
  q_pairs = jnp.stack([amp[None, None] * jnp.cos(qp), amp[None, None] * jnp.sin(qp)], axis=-1)
  q_pairs = jnp.broadcast_to(q_pairs, (*q.shape[:2], num_heads, order, 2))
  k_pairs = jnp.stack([-jnp.sin(kp), jnp.cos(kp)], axis=-1)  # [B, S, N or 1, k, 2]
  k_cont = k.astype(jnp.float32)
  if not shared and k.shape[2] != num_heads:
    k_cont = jnp.repeat(k_cont, num_heads // k.shape[2], axis=2)
  k_pairs = jnp.broadcast_to(k_pairs, (*k_cont.shape[:3], order, 2))
  return _append_dims(
    q.astype(jnp.float32),
    k_cont,
    q_pairs.reshape(*q.shape[:3], 2 * order),
    k_pairs.reshape(*k_cont.shape[:3], 2 * order),
    out_dtype=out_dtype,
    pad_multiple=pad_multiple,
  )


def _append_dims(q, k, q_extra, k_extra, *, out_dtype, pad_multiple):
  """``[q | q_extra]``, ``[k | k_extra]`` in ``out_dtype``, zero-padded to ``pad_multiple`` dims."""
  if (
    isinstance(pad_multiple, bool)
    or not isinstance(pad_multiple, int)
    or not 1 <= pad_multiple <= MAX_PAD_MULTIPLE
  ):
    raise ValueError(f"pad_multiple must be an int in 1..{MAX_PAD_MULTIPLE}, got {pad_multiple!r}")
  q_aug = jnp.concatenate([q.astype(jnp.float32), q_extra], axis=-1)
  k_aug = jnp.concatenate([k.astype(jnp.float32), k_extra], axis=-1)
  return (
    pad_head_dim(q_aug.astype(out_dtype), multiple=pad_multiple),
    pad_head_dim(k_aug.astype(out_dtype), multiple=pad_multiple),
  )


def apply_augmented_alibi(
  q: jax.Array,
  k: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  out_dtype=jnp.float32,
  pad_multiple: int = 1,
) -> tuple[jax.Array, jax.Array]:
  """Exact ALiBi for bias-free kernels: two extra dims carrying positions linearly.

  ``q_aug = [q, m_h sqrt(H) (-i, 1)]``, ``k_aug = [k, (1, j)]``, so
  ``q_aug . k_aug / sqrt(H) = q . k / sqrt(H) - m_h (i - j)`` with no truncation error. The extra
  products have size ``m sqrt(H) i``: the rounding error grows with the absolute position exactly
  as for the rotated form (``ROUNDING_CONSTANT u m (i + j + d)``); float32 is the policy.

  Args:
    q: ``[B, T, N, H]`` float queries.
    k: ``[B, S, K, H]`` float keys.
    q_positions: ``[B, T]`` integer token indices, ``< 2^24``.
    k_positions: ``[B, S]`` integer token indices, ``< 2^24``.
    slopes: ``[N]`` ALiBi slopes (> 0), concrete.
    out_dtype: dtype of the results (float32 = the policy; bfloat16/float16 for measurement).
    pad_multiple: pad ``H + 2`` with zero dims to a multiple of this; 1 = no padding.

  Returns:
    ``(q_aug [B, T, N, Ha], k_aug [B, S, K, Ha])`` of ``out_dtype``, ``Ha = H + 2`` rounded up.

  Raises:
    ValueError: wrong ranks or sizes, slope count != N, bad slopes or positions.
    TypeError: non-float q/k, non-integer positions, non-numeric slopes (or theta). Traced slopes or
      theta: ValueError.

  Source: the linear-position form of ALiBi's bias (Press et al., arXiv 2108.12409), written as a
  dot product.
  """
  _check_qk(q, k, q_positions, k_positions)
  num_heads, head_dim = q.shape[2], q.shape[3]
  _dtype_name(out_dtype)
  slopes = _slopes_array(slopes)
  _checks.check_slopes("slopes", slopes)
  if slopes.shape[0] != num_heads:
    raise ValueError(f"slopes must have one entry per head (N = {num_heads}), got {slopes.shape[0]}")
  scale = jnp.asarray(slopes * math.sqrt(head_dim), jnp.float32)  # [N]
  i = q_positions.astype(jnp.float32)[:, :, None]  # [B, T, 1]
  j = k_positions.astype(jnp.float32)[:, :, None, None]  # [B, S, 1, 1]
  q_extra = jnp.stack(
    [-scale[None, None, :] * i, jnp.broadcast_to(scale[None, None, :], i.shape[:2] + scale.shape)], -1
  )
  k_extra = jnp.concatenate([jnp.ones_like(j), j], axis=-1)  # [B, S, 1, 2]
  k_extra = jnp.broadcast_to(k_extra, (*k.shape[:3], 2))
  return _append_dims(q, k, q_extra, k_extra, out_dtype=out_dtype, pad_multiple=pad_multiple)


def emulated_alibi_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  theta=None,
  order: int | None = 1,
  mask: jax.Array | None = None,
  is_causal: bool = False,
  implementation: str | None = None,
  interpret: bool = False,
) -> jax.Array:
  """ALiBi attention without a bias tensor: a thin wrapper over ``jaxpe.kernels.attention``.

  ``xla`` (``implementation`` None or ``"xla"``): q and k get the float32 emulation dims
  (``apply_rope_alibi``, or ``apply_augmented_alibi`` for ``order=None``) and go through the einsum
  path with those dims contracted at ``precision=HIGHEST`` (``precise_dims``), so TF32 / bf16-pass
  default matmul precision cannot round them. Fused kernels (``"cudnn"``, ``"splash"``,
  ``"pallas_gpu"``): ``kernels.attention`` with an ``AlibiSpec`` (the exact form for ``order=None``,
  else the rotated form of that order), whose emulation dims are bf16-exact (cuDNN reads bf16/fp16
  only; float32 emulation dims rounded to bf16 cost whole logits). The score scale is ``1/sqrt(H)``
  of the original head dim; head-dim padding is the kernel's (``kernels.padded_head_dim``).

  Args:
    q: ``[B, T, N, H]`` float queries.
    k: ``[B, S, K, H]`` float keys.
    v: ``[B, S, K, H]`` float values.
    q_positions: ``[B, T]`` integer token indices.
    k_positions: ``[B, S]`` integer token indices.
    slopes: ``[N]`` ALiBi slopes (> 0), concrete.
    theta: base frequency (radians per token) of the rotated form; unused for ``order=None``.
    order: k for the rotated form, None for the exact augmented form.
    mask: optional bool mask broadcastable to ``[B, N, T, S]`` (True = may attend); ``xla`` only
      (fused kernels take ``kernels.attention(mask=AttentionMask(...))``).
    is_causal: causal mask (query index >= key index in the arrays).
    implementation: None or ``"xla"``, or a fused backend of ``jaxpe.kernels.BACKENDS``.
    interpret: run the Pallas kernels in interpret mode (CPU).

  Returns:
    ``[B, T, N, H]`` array of ``v.dtype``.

  Raises:
    ValueError: as ``apply_rope_alibi`` / ``kernels.attention`` (an unavailable backend lists the
      available ones); ``v`` not ``[B, S, K, H]``; theta missing for the rotated form; a dense
      ``mask`` on a fused kernel.
    TypeError: a non-bool ``is_causal`` or ``interpret``; as ``kernels.attention``.
  """
  from jaxpe.attention import kernels  # kernels imports this module
  from jaxpe.attention.reference import AttentionMask

  if not isinstance(is_causal, bool | np.bool_):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  if not isinstance(interpret, bool | np.bool_):
    raise TypeError(f"interpret must be a bool, got {interpret!r}")
  _checks.check_rank("v", v, 4, "[B, S, K, H]")
  if v.shape != k.shape:
    raise ValueError(f"v must have the shape of k, [B, S, K, H] = {k.shape}, got {v.shape}")
  if order is not None and theta is None:
    raise ValueError("theta (radians per token) is required for the rotated form (order >= 1)")
  impl = kernels.resolve_backend(implementation or "xla", interpret=interpret)
  head_dim = q.shape[-1]
  scale = 1.0 / math.sqrt(head_dim)
  if impl != "xla":
    if mask is not None:
      raise ValueError(
        f"implementation {impl!r} takes no dense mask: use jaxpe.kernels.attention with "
        "mask=AttentionMask(valid=..., segment_ids=..., causal=...), or implementation='xla'"
      )
    bound = 65536
    for pos in (q_positions, k_positions):
      bound = max(bound, pos.shape[1])
      if not isinstance(pos, jax.core.Tracer):
        bound = max(bound, int(np.max(np.asarray(pos), initial=0)) + 1)
    spec = kernels.AlibiSpec(
      slopes=np.asarray(slopes, np.float64),
      q_positions=q_positions,
      k_positions=k_positions,
      max_position=bound,
      form="exact" if order is None else "rotated",
      order=1 if order is None else order,
      theta=theta,
    )
    return kernels.attention(
      q,
      k,
      v,
      scale=scale,
      mask=AttentionMask(causal=is_causal),
      alibi_spec=spec,
      impl=impl,
      interpret=interpret,
    )
  if order is None:
    q_aug, k_aug = apply_augmented_alibi(q, k, q_positions, k_positions, slopes=slopes)
  else:
    q_aug, k_aug = apply_rope_alibi(q, k, q_positions, k_positions, slopes=slopes, theta=theta, order=order)
    if k_aug.shape[2] != v.shape[2]:
      v = jnp.repeat(v, k_aug.shape[2] // v.shape[2], axis=2)
  if is_causal:
    t_len, s_len = q.shape[1], k.shape[1]
    causal = jnp.tril(jnp.ones((t_len, s_len), bool))[None, None]
    mask = causal if mask is None else mask & causal
  return kernels.attention(
    q_aug, k_aug, v, scale=scale, mask=mask, precise_dims=q_aug.shape[-1] - head_dim, impl="xla"
  )


# ------------------------------------------------------------------------------------ base-constrained


@dataclasses.dataclass(frozen=True)
class BaseConstrainedPlan:
  """Emulation placed on a standard RoPE frequency table ``base^(-2r/R)``, r < R/2.

  Attributes:
    slopes: ``[N]`` m_h.
    head_dim: H, content dims (kept outside the rotary block, so they do not rotate).
    rotary_dim: R, the engine's rotary block; the engine's head dim is ``R + H``.
    base: the engine's RoPE base.
    layout: the engine's pair layout, ``"interleaved"`` or ``"half"``.
    max_len: context the plan is for.
    dtype: dtype carrying the emulation dims.
    wanted_theta: the frequency the unconstrained solver would use (radians per token): the
      smaller of ``max_phase / max_len`` and the ``target_error`` solution, when given.
    pair_index: r, the rotary pair carrying the emulation (the largest frequency <= wanted_theta,
      or the lowest one when all are above).
    theta: ``base^(-2r/R)`` as the engine computes it (float32), radians per token.
    amplitudes: ``[N]`` N_h = m_h sqrt(H) / theta.
    truncation_bound: ``[N]`` ``(m / theta) e_1(theta (max_len - 1))``.
    rounding_bound: ``[N]`` rounding model at ``max_len``.
    target_error: the error (logits) used for ``max_context``; None if not given.
    max_context: longest context whose predicted deviation stays <= ``target_error`` for every head
      with this base (None without a target).
    base_needed: smallest base whose lowest frequency meets ``target_error`` at ``max_len``, when
      the given base does not (else None; ``inf`` when R = 2 offers no low frequency).
  """

  slopes: np.ndarray
  head_dim: int
  rotary_dim: int
  base: float
  layout: str
  max_len: int
  dtype: str
  wanted_theta: float
  pair_index: int
  theta: float
  amplitudes: np.ndarray
  truncation_bound: np.ndarray
  rounding_bound: np.ndarray
  target_error: float | None
  max_context: int | None
  base_needed: float | None

  @property
  def bound(self) -> np.ndarray:
    """``[N]`` predicted worst-case deviation over ``max_len``: truncation + rounding."""
    return self.truncation_bound + self.rounding_bound

  def inv_freq(self) -> np.ndarray:
    """``[R/2]`` float32 engine frequencies ``base^(-2r/R)`` (as ``jaxpe.rope.rope_inv_freq``)."""
    return np.asarray(rope_inv_freq(self.rotary_dim, base=self.base))


def _base_bound(slopes, theta, length, order, dtype):
  dist = max(length - 1, 0)
  trunc = slopes / theta * truncation_error_bound(theta * dist, order=order)
  return trunc, ROUNDING_CONSTANT * UNIT_ROUNDOFF[dtype] * slopes * rounding_sum(order) * 2.0 * dist


def solve_base_constrained(
  slopes=None,
  *,
  num_heads: int | None = None,
  head_dim: int,
  rotary_dim: int,
  base: float = 10000.0,
  max_len: int,
  max_phase: float | None = None,
  target_error: float | None = None,
  layout: str = "interleaved",
  dtype="float32",
) -> BaseConstrainedPlan:
  """Emulation for a RoPE engine whose only controls are a base and a rotary block.

  The engine rotates the first R dims of each head at ``base^(-2r/R)`` and passes the rest through
  (partial rotary, e.g. GPT-NeoX ``rotary_pct``). The emulation pair goes to pair ``r`` (the
  largest frequency not above the wanted theta, else the lowest), every other rotary dim of q and k
  is zero, and the content dims sit after the rotary block. Only order 1 is possible (the table
  rarely holds 2 theta too).

  Args:
    slopes: ``[N]`` ALiBi slopes; or ``num_heads`` for the paper's slopes.
    num_heads: N, when ``slopes`` is None.
    head_dim: H, content dims; positive.
    rotary_dim: R, even, >= 2.
    base: the engine's RoPE base, > 1.
    max_len: context in tokens, 1..2^24.
    max_phase: wanted largest phase (radians, in (0, pi/2)): wanted theta <= max_phase / max_len.
    target_error: error in logits: wanted theta <= the solver's theta for this error; also sets
      ``max_context`` / ``base_needed``.
    layout: the engine's pair layout: ``"interleaved"`` (pair r = dims 2r, 2r+1) or ``"half"``
      (dims r, r + R/2).
    dtype: dtype carrying the emulation dims (float32 = the policy).

  Returns:
    A ``BaseConstrainedPlan``.

  Raises:
    ValueError: neither max_phase nor target_error; odd or too small rotary_dim; base <= 1; bad
      layout; the chosen frequency makes the phase reach pi/2 within max_len (message gives the
      longest usable context and the base that would be needed); amplitude overflow.
  """
  slopes = _slopes_or_heads(slopes, num_heads)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  max_len = _checks.check_positive_int("max_len", max_len)
  if max_len > MAX_POSITION:
    raise ValueError(f"max_len must be <= 2^24 = {MAX_POSITION}, got {max_len}")
  base = _checks.check_positive_float("base", base)
  if base <= 1.0:
    raise ValueError(f"base must be > 1 (frequencies base^(-2r/R) must fall with r), got {base}")
  if layout not in ("interleaved", "half"):
    raise ValueError(f"layout must be 'interleaved' or 'half', got {layout!r}")
  dtype = _dtype_name(dtype)
  if max_phase is None and target_error is None:
    raise ValueError("give max_phase (radians) and/or target_error (logits)")
  if target_error is not None:
    target_error = _checks.check_positive_float("target_error", target_error)
  wanted = math.inf
  if max_phase is not None:
    wanted = emulation_theta(max_phase=max_phase, max_len=max_len)
  if target_error is not None:
    target_theta = solve_emulation(
      slopes, head_dim=head_dim, max_len=max_len, target_error=target_error, dtype=dtype
    ).theta[0]
    wanted = min(wanted, float(target_theta))
  freqs = np.asarray(rope_inv_freq(rotary_dim, base=base))  # float32, as the engine uses them
  below = np.nonzero(freqs.astype(np.float64) <= wanted)[0]
  index = int(below[0]) if below.size else rotary_dim // 2 - 1
  theta = float(freqs[index])
  if theta * (max_len - 1) >= math.pi / 2:
    longest = int(math.pi / 2 / theta)
    raise ValueError(
      f"the lowest frequency of base {base:g}, rotary_dim {rotary_dim} is {theta:.4g} rad/token: the "
      f"phase reaches pi/2 at distance {longest}, below max_len {max_len}; shorten max_len, raise the "
      f"base to >= {_needed_base(wanted, rotary_dim):.4g} or raise rotary_dim"
    )
  amplitudes = slopes * math.sqrt(head_dim) / theta
  _check_representable(amplitudes, np.ones(1), dtype, "use a larger base frequency")
  trunc, rounding = _base_bound(slopes, theta, max_len, 1, dtype)
  max_context = base_needed = None
  if target_error is not None:

    def ok(length: int) -> bool:
      t, r = _base_bound(slopes, theta, length, 1, dtype)
      return bool(np.all(t + r <= target_error)) and theta * (length - 1) < math.pi / 2

    if not ok(1):
      max_context = 0
    else:
      lo, hi = 1, 2
      while hi <= MAX_POSITION and ok(hi):
        lo, hi = hi, hi * 2
      hi = min(hi, MAX_POSITION + 1)
      while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
      max_context = lo
    if max_context < max_len:
      need = solve_emulation(
        slopes, head_dim=head_dim, max_len=max_len, target_error=target_error, dtype=dtype
      ).theta[0]
      base_needed = _needed_base(float(need), rotary_dim)
  return BaseConstrainedPlan(
    slopes=slopes,
    head_dim=head_dim,
    rotary_dim=rotary_dim,
    base=base,
    layout=layout,
    max_len=max_len,
    dtype=dtype,
    wanted_theta=wanted,
    pair_index=index,
    theta=theta,
    amplitudes=amplitudes,
    truncation_bound=trunc,
    rounding_bound=rounding,
    target_error=target_error,
    max_context=max_context,
    base_needed=base_needed,
  )


def _needed_base(theta: float, rotary_dim: int) -> float:
  """Smallest base whose lowest frequency ``base^(-(R-2)/R)`` is <= theta (inf for R = 2)."""
  if rotary_dim <= 2:
    return math.inf
  return theta ** (-rotary_dim / (rotary_dim - 2))


def base_constrained_qk(
  q: jax.Array, k: jax.Array, *, plan: BaseConstrainedPlan
) -> tuple[jax.Array, jax.Array]:
  """q and k laid out for a standard RoPE engine (``plan.base``, rotary block ``plan.rotary_dim``).

  Returns unrotated ``[rotary block | content]`` arrays: the rotary block is zero except pair
  ``plan.pair_index``, which holds ``(-N_h, 0)`` in q and ``(0, 1)`` in k; the content dims follow
  unchanged. The engine then rotates the block (e.g. ``jaxpe.rope.apply_rope(x, positions,
  inv_freq=plan.inv_freq(), layout=plan.layout)``) and scores with ``1/sqrt(H)`` of the content
  dims: ``q.k / sqrt(H) - (m_h / theta) sin((i - j) theta)``. Positions belong to the engine.

  Args:
    q: ``[B, T, N, H]`` float queries.
    k: ``[B, S, K, H]`` float keys.
    plan: from ``solve_base_constrained``; ``N`` slopes, ``H`` content dims.

  Returns:
    ``(q_eng [B, T, N, R + H], k_eng [B, S, K, R + H])`` float32 (the precision policy).

  Raises:
    ValueError: ranks, batch sizes that differ, or N / H that do not match the plan.
    TypeError: ``plan`` not a ``BaseConstrainedPlan``; non-float q or k.
  """
  if not isinstance(plan, BaseConstrainedPlan):
    raise TypeError(
      f"plan must be a BaseConstrainedPlan (from solve_base_constrained), got {type(plan).__name__}"
    )
  _checks.check_rank("q", q, 4, "[B, T, N, H]")
  _checks.check_rank("k", k, 4, "[B, S, K, H]")
  _checks.check_float("q", q)
  _checks.check_float("k", k)
  num_heads, head_dim = q.shape[2], q.shape[3]
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"q and k must have the same batch size B, got {q.shape[0]} and {k.shape[0]}")
  if head_dim != plan.head_dim or k.shape[3] != head_dim:
    raise ValueError(f"q and k must have H = plan.head_dim = {plan.head_dim}, got {q.shape} and {k.shape}")
  if num_heads != plan.slopes.shape[0]:
    raise ValueError(f"q must have N = {plan.slopes.shape[0]} heads (one per slope), got {num_heads}")
  r, half = plan.pair_index, plan.rotary_dim // 2
  re, im = (2 * r, 2 * r + 1) if plan.layout == "interleaved" else (r, r + half)
  amp = jnp.asarray(-plan.amplitudes, jnp.float32)
  q_block = jnp.zeros((*q.shape[:3], plan.rotary_dim), jnp.float32)
  q_block = q_block.at[..., re].set(jnp.broadcast_to(amp[None, None, :], q.shape[:3]))
  k_block = jnp.zeros((*k.shape[:3], plan.rotary_dim), jnp.float32).at[..., im].set(1.0)
  return (
    jnp.concatenate([q_block, q.astype(jnp.float32)], axis=-1),
    jnp.concatenate([k_block, k.astype(jnp.float32)], axis=-1),
  )
