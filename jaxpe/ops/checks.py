"""Trace-time argument checks shared by the ops.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong dtype) with a message that names
the argument and the accepted range. Checks look only at static information (shapes, dtypes,
Python scalars) so they run while tracing under ``jax.jit``; value checks on arrays run only when
the array is concrete (not a tracer).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class ArgTypeError(TypeError, ValueError):
  """A wrong type or dtype: a ``TypeError``, and a ``ValueError`` for callers that caught the
  ``ValueError`` these checks raised for wrong-typed scalars before the contracts of issue 17."""


# The largest head, model or rotary dim and head count the ops accept: far above any model, and small
# enough that the host tables (np.arange of it) stay small. Larger values are refused, not allocated.
MAX_DIM = 2**20
# float32, the dtype every op computes in: magnitudes above FLOAT32_MAX (~3.4e38) become inf, positive
# values below FLOAT32_TINY (~1.2e-38, the smallest normal) become subnormal, which XLA flushes to 0.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
MAX_INT32 = 2**31 - 1  # int32 counters (the optimizer's step count) hold at most this


def float32_problem(value: float, *, positive: bool = False) -> str | None:
  """Why the finite number ``value`` is no usable float32, or None: ``|value| > FLOAT32_MAX`` (it
  becomes inf) or, when it must be ``positive``, ``0 < value < FLOAT32_TINY`` (subnormal: 0 once
  flushed). The range is in the message; the caller names the argument or config key."""
  if abs(value) > FLOAT32_MAX:
    return f"must be at most {FLOAT32_MAX:.7g} in magnitude (it is used as a float32, where {value!r} is inf)"
  if positive and 0 < value < FLOAT32_TINY:
    return f"must be >= {FLOAT32_TINY:.7g} (the smallest normal float32; {value!r} is subnormal, flushed to 0 by XLA)"
  return None


def check_rank(name: str, x, rank: int, shape_hint: str) -> None:
  """Raises ValueError unless ``x`` has ``rank`` dimensions (``shape_hint`` like '[B, T, N, H]')."""
  if jnp.ndim(x) != rank:
    raise ValueError(f"{name} must have shape {shape_hint} (rank {rank}), got shape {jnp.shape(x)}")


def check_dim(name: str, x, axis: int, size: int, what: str) -> None:
  """Raises ValueError unless ``x.shape[axis] == size``."""
  if x.shape[axis] != size:
    raise ValueError(f"{name}.shape[{axis}] must equal {what} = {size}, got shape {x.shape}")


def check_float(name: str, x) -> None:
  """Raises TypeError unless ``x`` has a floating dtype."""
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype {jnp.result_type(x)}")


def traced_message(name: str, what: str = "concrete (numpy or Python numbers)") -> str:
  """The message for a value that must be concrete (slopes, theta, a scale) but is traced: what it
  must be, and how to keep it concrete, the usual cause being a constant kept on a module."""
  return (
    f"{name} must be {what}, not traced under jit. Keep it a host constant: a Python number or tuple, "
    "or a numpy array closed over or computed inside the function, not a jit argument. NNX modules "
    "trace array attributes under nnx.jit (numpy arrays too): keep it as a tuple, e.g. "
    f"self.{name} = tuple(np.asarray(...).tolist()); in Flax Linen, a module field or a constant in "
    "__call__, not a param or variable"
  )


MAX_POSITION = 2**31  # int32 token indices; the exact RoPE phases hold below it


def check_positions(name: str, positions) -> None:
  """Positions are token indices: integer dtype and, when concrete, in ``[0, 2^31)``."""
  if not jnp.issubdtype(jnp.result_type(positions), jnp.integer):
    raise TypeError(
      f"{name} must be an integer array of token indices, got dtype {jnp.result_type(positions)}"
    )
  if not isinstance(positions, jax.core.Tracer):
    arr = np.asarray(positions)
    if arr.size and arr.min() < 0:
      raise ValueError(f"{name} must be >= 0 (token indices), got min {arr.min()}")
    if arr.size and arr.max() >= MAX_POSITION:
      raise ValueError(f"{name} must be < 2^31 (int32 token indices), got max {arr.max()}")


def rope_positions(name: str, positions):
  """Positions for rotary phases, as an int32 or float32 JAX array.

  Integers (any int dtype) must be in ``[0, 2^31)``; floats must be finite, in ``[0, 2^31)`` and,
  when given in float64, exactly representable in float32 (what the phases use). Value checks run
  only on concrete arrays. Raises TypeError for other dtypes (bool, complex), ValueError otherwise.
  """
  positions = as_array(name, positions)
  dtype = jnp.result_type(positions)
  if jnp.issubdtype(dtype, jnp.integer):
    check_positions(name, positions)
    return jnp.asarray(positions).astype(jnp.int32) if dtype != jnp.int32 else jnp.asarray(positions)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be an integer or float array of token indices, got dtype {dtype}")
  if not isinstance(positions, jax.core.Tracer):
    arr = np.asarray(positions).astype(np.float64)
    if arr.size and not np.all(np.isfinite(arr)):
      raise ValueError(f"{name} must be finite (token indices)")
    if arr.size and (arr.min() < 0 or arr.max() >= MAX_POSITION):
      raise ValueError(
        f"{name} must be in [0, 2^31) (token indices), got values in [{arr.min()}, {arr.max()}]"
      )
    lost = arr != arr.astype(np.float32).astype(np.float64)
    if np.any(lost):
      bad = arr[lost][0]
      raise ValueError(
        f"{name}: float positions are used as float32, and float32 cannot hold {float(bad)!r} (it "
        f"would become {float(np.float32(bad))!r}); pass integer positions or values float32 holds exactly"
      )
    positions = np.asarray(positions, np.float32) if isinstance(positions, np.ndarray) else positions
  return jnp.asarray(positions).astype(jnp.float32)


def check_index_range(name: str, x, upper: int, what: str) -> None:
  """When ``x`` is concrete: all values in ``[0, upper)``, else ValueError naming ``what``."""
  if isinstance(x, jax.core.Tracer):
    return
  arr = np.asarray(x)
  if arr.size and (arr.min() < 0 or arr.max() >= upper):
    raise ValueError(f"{name} must be in [0, {what} = {upper}), got values in [{arr.min()}, {arr.max()}]")


def is_int(value) -> bool:
  """Whether ``value`` is an integer scalar as the public surface takes it: a Python int or a numpy
  integer (``np.int64(64)``, the result of numpy arithmetic), not a bool (``True`` is no count). Every
  ``isinstance(x, int)`` check of an argument goes through this, so numpy integers pass everywhere
  ints are taken; the callers convert with ``int(x)``."""
  return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def check_positive_int(name: str, value, *, even: bool = False, maximum: int | None = None) -> int:
  """Returns ``value`` as int. Raises ``ArgTypeError`` (a TypeError and a ValueError) unless it is a
  Python or numpy int (not a bool), ValueError unless it is > 0, even (``even``) and <= ``maximum``."""
  if not is_int(value):
    raise ArgTypeError(f"{name} must be a positive integer, got {value!r} ({type(value).__name__})")
  if value <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  if even and value % 2:
    raise ValueError(f"{name} must be even, got {value}")
  if maximum is not None and value > maximum:
    raise ValueError(f"{name} must be <= {maximum}, got {value}")
  return int(value)


def check_positive_float(name: str, value) -> float:
  """Returns ``value`` as float. Raises ``ArgTypeError`` unless it is a real number (Python or numpy
  int/float, or a concrete 0-d array; not a bool, string or complex), ValueError unless finite and > 0."""
  if isinstance(value, (bool, np.bool_, str, bytes, complex, np.complexfloating)):
    raise ArgTypeError(f"{name} must be a finite number > 0, got {value!r} ({type(value).__name__})")
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ArgTypeError(f"{name} must be a finite number > 0, got {value!r}") from None
  if not math.isfinite(v) or v <= 0:
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
  return v


def check_slopes(name: str, slopes, *, allow_zero: bool = False) -> None:
  """Slopes: rank 1, a float (or Python number) array and, when concrete, finite and > 0
  (>= 0 with ``allow_zero``: slope 0 turns ALiBi off for that head). Returns ``slopes`` (lists
  as numpy arrays)."""
  slopes = as_array(name, slopes)
  check_rank(name, slopes, 1, "[N]")
  dtype = jnp.result_type(slopes)
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"{name} must be a float array, got dtype {dtype}")
  if not isinstance(slopes, jax.core.Tracer):
    arr = np.asarray(slopes, dtype=np.float64)
    bad = np.any(arr < 0) if allow_zero else np.any(arr <= 0)
    if not np.all(np.isfinite(arr)) or bad:
      raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {arr.tolist()}")
  return slopes


def broadcastable(name: str, shape: Sequence[int], target: Sequence[int], hint: str) -> None:
  """Raises ValueError unless ``shape`` broadcasts to ``target`` (same rank)."""
  ok = len(shape) == len(target) and all(a in (1, b) for a, b in zip(shape, target))
  if not ok:
    raise ValueError(f"{name} must broadcast to {hint} = {tuple(target)}, got shape {tuple(shape)}")


def as_array(name: str, x):
  """``x`` as an array: JAX and numpy arrays (and tracers) pass through; Python numbers and (nested)
  lists or tuples of numbers become numpy arrays. Anything else (strings, ragged lists, objects)
  raises ``ArgTypeError`` naming ``name``."""
  if isinstance(x, jax.Array | np.ndarray | jax.core.Tracer):
    arr = x
  else:
    try:
      arr = np.asarray(x)
    except (TypeError, ValueError):
      raise ArgTypeError(f"{name} must be an array of numbers, got {type(x).__name__} {x!r:.80}") from None
  if not (arr.dtype == np.bool_ or jnp.issubdtype(arr.dtype, jnp.number)):  # bfloat16 counts as a number
    raise ArgTypeError(f"{name} must be an array of numbers, got dtype {arr.dtype}")
  return arr


def check_index(name: str, value, *, upper: int | None = None, what: str = "") -> int:
  """An integer token index (Python or numpy int, not a bool) in ``[0, upper]``: ArgTypeError for
  another type, ValueError when out of range."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ArgTypeError(f"{name} must be >= 0, an integer token index, got {value!r} ({type(value).__name__})")
  if value < 0:
    raise ValueError(f"{name} must be >= 0 (an integer token index), got {value}")
  if upper is not None and value > upper:
    raise ValueError(f"{name} must be <= {what or upper}, got {value}")
  return int(value)


def check_float_dtype(name: str, dtype, allowed=None):
  """``dtype`` as a numpy dtype; ArgTypeError unless it names a float dtype (in ``allowed`` if given)."""
  accepted = "a float dtype" if allowed is None else " or ".join(np.dtype(a).name for a in allowed)
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    raise ArgTypeError(f"{name} must be {accepted}, got {dtype!r}") from None
  ok = jnp.issubdtype(dt, jnp.floating) if allowed is None else any(dt == np.dtype(a) for a in allowed)
  if not ok:
    raise ArgTypeError(f"{name} must be {accepted}, got {dt}")
  return dt


def check_bool(name: str, value) -> bool:
  """A Python or numpy bool; ArgTypeError otherwise (a string such as 'no' is not False)."""
  if not isinstance(value, (bool, np.bool_)):
    raise ArgTypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
  return bool(value)


ENV_TRUE = ("1", "true", "on", "yes")
ENV_FALSE = ("0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
  """The on/off environment variable ``name``: ``default`` when unset or empty; ``1``, ``true``,
  ``on``, ``yes`` (any case, surrounding blanks ignored) turn it on, ``0``, ``false``, ``off``,
  ``no`` off. Any other value raises ValueError naming the variable and the accepted values (a
  setting such as ``disabled`` is not taken as on)."""
  raw = os.environ.get(name)
  if raw is None or not raw.strip():
    return default
  value = raw.strip().lower()
  if value in ENV_TRUE:
    return True
  if value in ENV_FALSE:
    return False
  raise ValueError(
    f"{name}={raw!r} is not an on/off setting: use one of {', '.join(ENV_TRUE)} (on) or "
    f"{', '.join(ENV_FALSE)} (off), or leave it unset"
  )


def host_memory_bytes() -> int:
  """The machine's physical memory in bytes (``SC_PHYS_PAGES`` pages of ``SC_PAGE_SIZE``)."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_bytes() -> int:
  """The memory of JAX's devices together: each accelerator's ``bytes_limit`` (``memory_stats``),
  the machine's physical memory once per process for CPU devices and devices without statistics
  (a multi-process job's hosts each hold their own; the other hosts are taken to have this one's).
  A size beyond it cannot fit however the array is sharded, so checks against it never refuse what
  could run."""
  total, hosts = 0, set()
  for device in jax.devices():
    try:
      stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (backends without memory statistics; another process's devices)
      stats = None
    if stats and stats.get("bytes_limit"):
      total += int(stats["bytes_limit"])
    else:
      hosts.add(getattr(device, "process_index", 0))
  return total + len(hosts) * host_memory_bytes()


def check_fits(name: str, need: int, available: int, what: str, fix: str) -> None:
  """Raises ValueError naming ``name`` unless ``need <= available`` bytes: what the bytes are for,
  both sizes in GiB and how to make it fit (``fix``). Called before an allocation that the user's
  argument sizes, so a size too large is one line, not ``std::bad_alloc`` or RESOURCE_EXHAUSTED."""
  if need > available:
    raise ValueError(
      f"{name}: {what} needs {need / 2**30:,.2f} GiB, more than the {available / 2**30:,.2f} GiB available; {fix}"
    )


def check_dense_fits(name: str, shape: Sequence[int], dtype, fix: str) -> None:
  """ValueError naming ``name`` unless a dense ``shape`` array of ``dtype`` fits the memory of JAX's
  devices (``device_memory_bytes``): the floor of what an op that materializes it needs."""
  need = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
  what = f"a dense {list(shape)} {np.dtype(dtype).name} array"
  check_fits(name, need, device_memory_bytes(), what, fix)


def check_position_pair(q_positions, k_positions, *, heads: int = 1):
  """Query positions ``[B, T]`` and key positions ``[B, S]``: integer, >= 0 when concrete, same B;
  returns them as arrays (``as_array``: numpy stays numpy). Shared by ALiBi and the learned
  relative biases, whose result is a dense float32 ``[B, heads, T, S]`` bias: refused before it is
  computed when it cannot fit the device (``check_dense_fits``).

  Raises:
    ValueError: wrong ranks, different B, concrete negative positions, a bias too large.
    TypeError: non-integer positions.
  """
  q_positions = as_array("q_positions", q_positions)
  k_positions = as_array("k_positions", k_positions)
  check_rank("q_positions", q_positions, 2, "[B, T]")
  check_rank("k_positions", k_positions, 2, "[B, S]")
  check_positions("q_positions", q_positions)
  check_positions("k_positions", k_positions)
  if q_positions.shape[0] != k_positions.shape[0]:
    raise ValueError(
      f"q_positions and k_positions must have the same batch size B, got "
      f"{q_positions.shape[0]} and {k_positions.shape[0]}"
    )
  (batch, t_len), s_len = q_positions.shape, k_positions.shape[1]
  fix = "the bias is dense [B, N, T, S]: give fewer positions, or attention's blockwise path (AlibiSpec, PositionBias)"
  check_dense_fits("q_positions / k_positions", (batch, heads, t_len, s_len), np.float32, fix)
  return q_positions, k_positions


def checked_positions(name: str, positions, shape: tuple[int, int]):
  """``positions`` as an array (``as_array``), integer and >= 0 when concrete (``check_positions``),
  of ``shape`` (``[B, T]`` or ``[B, S]`` of the attention's q / k).

  Raises:
    ValueError: another shape, concrete negative positions.
    TypeError: non-integer positions.
  """
  positions = as_array(name, positions)
  check_positions(name, positions)
  if tuple(positions.shape) != shape:
    raise ValueError(
      f"{name} must have shape {list(shape)} (q/k's [B, T] / [B, S]), got {tuple(positions.shape)}"
    )
  return positions


UNSET = object()
"""The default of a deprecated keyword (``apply_rope(scale=)``): tells "not given" from any value."""

ATTENTION_FACTOR_IS_NOT = (
  "attention_factor multiplies cos and sin (RopeSpec.attention_factor, HF's attention_scaling: YaRN's "
  "0.1 ln(s) + 1, LongRoPE's); it is NOT position interpolation (gemma's scale_factor, HF's rope_scaling "
  "'factor' with rope_type 'linear'), which divides the frequencies: pass inv_freq=rope_inv_freq(H, "
  "base=...) / factor, or rope_from_hf_config(...) with rope_scaling {'rope_type': 'linear', 'factor': f}"
)
"""What ``attention_factor`` is and is not: the deprecation message of its old spellings."""


def renamed_attention_factor(fn: str, old: str, new: str, old_value, new_value, default):
  """The value of ``new`` (``attention_factor``) given either spelling: ``old`` (deprecated, with a
  ``DeprecationWarning`` that says what the argument is not) or ``new``.

  Raises:
    TypeError: both spellings given.
  """
  if old_value is UNSET:
    return default if new_value is UNSET else new_value
  if new_value is not UNSET:
    raise TypeError(f"{fn}: give {new}= only ({old}= is its deprecated spelling), not both")
  import warnings  # noqa: PLC0415 (only a deprecated call needs it)

  warnings.warn(
    f"{fn}({old}=) is deprecated: use {new}= (the same value). {ATTENTION_FACTOR_IS_NOT}",
    DeprecationWarning,
    stacklevel=3,
  )
  return old_value
