"""The emulation's weights and its error model: truncation (a bound) and rounding (a calibrated model).

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

Source: the construction in ``shared/DESIGN.md`` section 3 (RoPE: Su et al., arXiv 2104.09864;
ALiBi: Press et al., arXiv 2108.12409); the higher orders and the rounding model are jaxpe's
(derivations above and in ``docs/emulation.md``).
"""

from __future__ import annotations

import math

import numpy as np

from jaxpe.emulation.checks import UNIT_ROUNDOFF, check_order, check_real, dtype_name, slopes_or_heads

# Constant of the rounding model (see the module docstring); measured worst cases are below 1/2 of it.
ROUNDING_CONSTANT = 4.0


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
  k = check_order(order)
  f = math.factorial
  return np.asarray(
    [2.0 * (-1) ** (r + 1) * f(k) ** 2 / (r * f(k - r) * f(k + r)) for r in range(1, k + 1)], np.float64
  )


def leading_error_coefficient(order: int) -> float:
  """``|c_k|`` in ``x - sum_r w_r sin(r x) = c_k x^(2k+1) + ...`` (1/6, 1/30, 1/140 for k = 1, 2, 3).

  Raises:
    ValueError: ``order`` not an integer in 1..8.
  """
  k = check_order(order)
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
  k = check_order(order)
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
  k = check_order(order)
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
  slopes = slopes_or_heads(slopes, None)
  u = UNIT_ROUNDOFF[dtype_name(dtype)]
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
    check_real("theta", theta)
  theta = np.asarray(theta, np.float64)
  if theta.shape not in ((), slopes.shape):
    raise ValueError(f"theta must be a number or [N] = {list(slopes.shape)} of them, got shape {theta.shape}")
  theta = np.broadcast_to(theta, slopes.shape)
  if not np.all(np.isfinite(theta)) or np.any(theta <= 0):
    raise ValueError(f"theta must be finite and > 0 radians per token, got {theta.tolist()}")
  th = theta[(slice(None), *extra)]
  trunc = m / th * truncation_error_bound(d[None] * th, order=order)
  return trunc + ROUNDING_CONSTANT * u * m * rounding_sum(order) * (i + j + d)[None]


def lean_alibi_magnitude(slopes, *, dot_scale: float, span: int) -> np.ndarray:
  """Largest ``|c_h (j - j0)|`` the lean form adds to the score before the kernel's scale, per head.

  ``c_h = m_h / dot_scale`` and ``|j - j0| <= ceil(span / 2)`` for a row whose key positions lie in a
  window of ``span`` tokens (``j0`` their centre; ``jaxpe.emulation.lean``). A float32 accumulator
  that holds this value rounds each later addition to ``u`` times it (``u = 2^-24``): with the content
  dims summed first and the ``E`` lean dims after, the deviation from ALiBi is at most about
  ``E x u x magnitude x dot_scale`` logits (0.002 to 0.003 measured at 65536 positions, 16 heads,
  H 64; ``benchmarks/kernel_precision.py``). The exact form's accumulator holds ``c_h (j - i)``
  instead (the distance, up to twice the lean form's ``span / 2``).

  Args:
    slopes: ``[N]`` ALiBi slopes, finite, >= 0.
    dot_scale: the factor the kernel applies to ``q . k`` (``1/sqrt(H)``, or 1 on splash where q is
      pre-scaled); finite, > 0.
    span: positions in a row's window (max - min + 1), an int >= 1.

  Returns:
    ``[N]`` float64 (score units before ``dot_scale``; times ``dot_scale`` for logits).

  Raises:
    ValueError: negative or non-finite slopes, dot_scale not finite > 0, span not an int >= 1.
  """
  slopes = np.asarray(slopes, np.float64)
  if slopes.ndim != 1 or not np.all(np.isfinite(slopes)) or np.any(slopes < 0):
    raise ValueError(f"slopes must be [N] finite and >= 0, got {slopes.tolist()}")
  check_real("dot_scale", dot_scale)
  if not math.isfinite(dot_scale) or dot_scale <= 0:
    raise ValueError(f"dot_scale must be finite and > 0, got {dot_scale}")
  if isinstance(span, bool) or not isinstance(span, int | np.integer) or span < 1:
    raise ValueError(f"span must be an int >= 1 (tokens), got {span!r}")
  return slopes / float(dot_scale) * (int(span) // 2)
