"""The solver: theta and the per-head amplitudes N_h of the emulation for a context, and the plan.

``solve_emulation`` chooses the frequency theta (radians per token) either from a largest phase
(``max_phase / max_len``, the published rule) or from a target error in logits (the largest theta
whose predicted deviation, ``jaxpe.emulation.bounds``, stays within it), and returns an
``EmulationPlan`` with the amplitudes ``N_h = m_h sqrt(H) / theta`` and the predicted worst case.
Host-side float64 numpy; the ops (``jaxpe.emulation.ops``) build the dims from the plan's numbers.

Shape alphabet: N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpe.emulation.bounds import (
  ROUNDING_CONSTANT,
  emulation_error_bound,
  emulation_weights,
  rounding_sum,
  truncation_error_bound,
)
from jaxpe.emulation.checks import (
  MAX_POSITION,
  UNIT_ROUNDOFF,
  check_max_phase,
  check_order,
  check_real,
  check_representable,
  dtype_name,
  slopes_array,
  slopes_or_heads,
)
from jaxpe.ops import checks as _checks

# Cap on the phase the target-error solver may choose (radians); well below pi/2.
_MAX_SOLVED_PHASE = 1.0


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
  return check_max_phase(max_phase) / max_len


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
  slopes = slopes_array(slopes)
  _checks.check_slopes("slopes", slopes)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  if np.ndim(theta) == 0:
    check_real("theta", theta)
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
  slopes = slopes_or_heads(slopes, num_heads)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  max_len = _checks.check_positive_int("max_len", max_len)
  if max_len > MAX_POSITION:
    raise ValueError(f"max_len must be <= 2^24 = {MAX_POSITION} (positions exact in float32), got {max_len}")
  if not isinstance(shared_theta, bool | np.bool_):
    raise TypeError(f"shared_theta must be a bool, got {shared_theta!r}")
  if target_error is not None:
    check_real("target_error", target_error)
  order = check_order(order)
  dtype = dtype_name(dtype)
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
  check_representable(
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


DEFAULT_BUDGET = 1.5  # the default plan's target, in units of its float32 rounding floor


def default_theta(slopes, *, head_dim: int, max_len: int, order: int = 1) -> float:
  """The theta (radians per token) that ``emulated_alibi_attention`` uses when none is given: the
  largest one whose predicted deviation stays within ``DEFAULT_BUDGET`` = 1.5 times the float32
  rounding floor at ``max_len`` (``solve_emulation(target_error=...)``, one theta for all heads),
  so truncation adds at most half of what float32 rounding costs anyway.

  Measured against native ALiBi's logits (float64) over causal pairs up to ``max_len`` with order 1:
  1.4e-4 logits at N 4, H 16, 2048 tokens (predicted bound 3.7e-4); 2.7e-4 at N 8, H 64, 2048
  tokens; 8e-6 at 64 tokens. Orders 2 and 3 measured 2-2.3x more (their rounding floor is higher).

  Raises:
    ValueError, TypeError: as ``solve_emulation`` (slopes, head_dim, max_len, order).
  """
  slopes = slopes_array(slopes)
  max_len = max(_checks.check_positive_int("max_len", max_len), 2)
  order = check_order(order)
  weights_sum = rounding_sum(order)
  floor = (
    ROUNDING_CONSTANT * UNIT_ROUNDOFF["float32"] * float(np.max(slopes)) * weights_sum * 2.0 * (max_len - 1)
  )
  plan = solve_emulation(
    slopes, head_dim=head_dim, max_len=max_len, order=order, target_error=DEFAULT_BUDGET * floor
  )
  return float(plan.theta[0])
