"""Limits and argument checks shared by the emulation modules (solver, bounds, ops, base-constrained).

The dtype tables (unit roundoff, largest finite value) of the dtypes that can carry the emulation
dims, the position and padding limits, and the checks of orders, phases, slopes and dtypes whose
messages every public function of ``jaxpe.emulation`` shares.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.alibi import alibi_slopes_f64

# Unit roundoff (half the machine epsilon) of the dtypes that can carry the emulation dims.
UNIT_ROUNDOFF: dict[str, float] = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# Largest finite value of those dtypes.
DTYPE_MAX: dict[str, float] = {
  "float32": 3.4028234663852886e38,
  "bfloat16": 3.3895313892515355e38,
  "float16": 65504.0,
}
# Positions must be exact in float32 (phases are computed as float32(position) * theta).
MAX_POSITION = 2**24
# Largest head-dim multiple pad_head_dim pads to (kernels use 8 or 128; 2^30 would allocate gigabytes).
MAX_PAD_MULTIPLE = 4096

DTYPE_NAMES = tuple(UNIT_ROUNDOFF)


def dtype_name(dtype) -> str:
  """Canonical name of a dtype-like (``"float32"``, ``jnp.bfloat16``, ...); ValueError otherwise."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = str(dtype)
  if name not in DTYPE_NAMES:
    raise ValueError(f"dtype must be one of {DTYPE_NAMES} for the emulation dims, got {dtype!r}")
  return name


def check_order(order) -> int:
  """k, the number of emulation pairs, as an int in 1..8; ValueError otherwise."""
  order = _checks.check_positive_int("order", order)
  if order > 8:
    raise ValueError(f"order must be in 1..8 (weights grow and cancel badly beyond), got {order}")
  return order


def check_real(name: str, value) -> None:
  """TypeError for a value that is not a real number (bool, str, bytes, None, an array of > 1 value)."""
  if isinstance(value, bool | np.bool_ | str | bytes) or value is None or np.ndim(value) != 0:
    raise TypeError(f"{name} must be a real number, got {value!r}")
  if isinstance(value, jax.core.Tracer):
    raise TypeError(_checks.traced_message(name, "a concrete Python number"))


def check_max_phase(max_phase) -> float:
  """``max_phase`` as a float in (0, pi/2) radians; TypeError for a non-number, ValueError outside."""
  check_real("max_phase", max_phase)
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


def slopes_or_heads(slopes, num_heads) -> np.ndarray:
  """``[N]`` float64 slopes, finite and > 0: the given ones, or the paper's for ``num_heads``."""
  if (slopes is None) == (num_heads is None):
    raise ValueError("give exactly one of slopes ([N] ALiBi slopes) or num_heads (paper slopes)")
  if slopes is None:
    return alibi_slopes_f64(num_heads)
  slopes = slopes_array(slopes)
  if slopes.ndim != 1 or slopes.size == 0:
    raise ValueError(f"slopes must have shape [N] with N >= 1, got shape {slopes.shape}")
  if not np.all(np.isfinite(slopes)) or np.any(slopes <= 0):
    raise ValueError(f"slopes must be finite and > 0 (ALiBi penalises distance), got {slopes.tolist()}")
  return slopes


def slopes_array(slopes) -> np.ndarray:
  """Concrete slopes as float64 numpy; TypeError for traced, non-numeric or bool slopes."""
  if isinstance(slopes, jax.core.Tracer):
    raise ValueError(_checks.traced_message("slopes"))
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


def check_representable(amplitudes: np.ndarray, weights: np.ndarray, dtype: str, hint: str) -> None:
  """ValueError when the largest emulation value ``max|N| max|w|`` overflows ``dtype`` (``hint``: the fix)."""
  biggest = float(np.max(np.abs(amplitudes)) * np.max(np.abs(weights)))
  if not math.isfinite(biggest) or biggest >= DTYPE_MAX[dtype]:
    raise ValueError(
      f"amplitude N = {biggest:.4g} is not representable in {dtype} (max {DTYPE_MAX[dtype]:.6g}); "
      f"carry the emulation dims in float32 (the policy) or {hint}"
    )
