"""RoPE frequency scaling configured by HF-style ``rope_scaling`` / ``rope_parameters`` dicts.

``rope_frequencies(params, head_dim=...)`` turns the dict that HF model configs carry
(``{"rope_type": "yarn", "factor": 4.0, ...}``; the old key ``"type"`` is accepted too) into
``(inv_freq, attention_factor)``: the inverse frequencies ``[R/2]`` float32 in radians per token and
the factor that multiplies cos and sin (so q.k scales by its square). Pass them to
``jaxpe.apply_rope(x, positions, inv_freq=inv_freq, layout=..., attention_factor=attention_factor)`` with the
model's pair layout. The dict's spelling, keys and values are read by ``jaxpe.ops.rope_parameters``.

Types (``ROPE_TYPES``) and their sources:

* ``default``: ``base ** (-2i / R)`` (RoFormer, arXiv 2104.09864).
* ``linear``: position interpolation, ``inv_freq / factor`` (Chen et al., arXiv 2306.15595);
  ``factor`` may be below 1 (compression), as for ``yarn``; the other types need ``factor >= 1``.
* ``dynamic``: dynamic NTK, base grown with the sequence length (bloc97/emozilla, HF
  ``_compute_dynamic_ntk_parameters``). Stateless here: the result depends only on ``seq_len``.
* ``ntk``: static NTK-aware base ``base * factor ** (R / (R - 2))`` (bloc97, "NTK-aware scaled
  RoPE"; not an HF type, it equals ``dynamic`` at ``seq_len = L (2 factor - 1) / factor``).
* ``yarn``: YaRN ramp between interpolation and extrapolation plus attention factor (Peng et al.,
  arXiv 2309.00071), with ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``,
  ``mscale_all_dim``, ``truncate``. ``factor`` is required, as transformers requires it (no factor
  is guessed from ``max_position_embeddings / original_max_position_embeddings``).
* ``longrope``: per-frequency short/long factors (Ding et al., arXiv 2402.13753; Phi-3).
* ``llama3``: Llama 3.1 low/high-frequency smoothing (Meta ``apply_scaling`` in llama-models);
  ``low_freq_factor == high_freq_factor`` (Llama-4) has no smoothing band, a step at that wavelength.
* ``proportional``: Gemma-4's partial rotary: the first ``int(H * partial_rotary_factor) // 2``
  pairs get ``base ** (-2i / H)`` (exponent over the whole head), the other pairs frequency 0, and
  ``inv_freq`` has ``H/2`` entries (rotate-half pairs span the head); divided by ``factor``
  (default 1, below 1 allowed). HF ``_compute_proportional_rope_parameters``.

Every formula matches HF transformers' ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (5.x) for the
same dict, ``head_dim`` and ``max_position_embeddings``; jaxpe evaluates them in float64 on the
host and rounds once to float32 (HF computes in float32), see ``docs/rope.md`` for the measured
deviations. All functions are pure: the same inputs always give the same outputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.rope_parameters import (
  ROPE_TYPES,
  check_original_not_above_max,
  check_seq_len,
  check_type_keys,
  normalize_rope_parameters,
  original_length,
  param_factor,
  param_float,
  param_int,
  read_base,
  read_max_positions,
  resolve_rotary_dim,
)

__all__ = ["ROPE_TYPES", "normalize_rope_parameters", "ntk_aware_base", "p_rope_inv_freq", "rope_frequencies"]


def _exponents(rotary_dim: int) -> np.ndarray:
  """``2i / R`` for ``i < R/2``, float64."""
  return np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim


def _to_f32(inv_freq: np.ndarray, dtype=jnp.float32) -> jax.Array | np.ndarray:
  """The float64 host table rounded once to a float32 JAX array, or kept float64 (numpy) for
  ``dtype=np.float64``: what exact phases need to be exact for the float64 frequencies."""
  if dtype == np.float64:
    return np.asarray(inv_freq, np.float64)
  return jnp.asarray(np.asarray(inv_freq, np.float64), jnp.float32)


def ntk_aware_base(base: float, *, factor: float, rotary_dim: int) -> float:
  """Static NTK-aware RoPE base ``base * factor ** (R / (R - 2))``.

  Stretches the lowest frequency by ``factor`` while leaving the highest (pair 0) unchanged.

  Args:
    base: rope_theta, finite and > 0.
    factor: context extension factor, >= 1 (1 gives ``base``).
    rotary_dim: R, even and > 2 (the exponent ``R / (R - 2)`` needs R > 2).

  Returns:
    The scaled base (Python float).

  Raises:
    ValueError: ``base`` not > 0, ``factor`` < 1, ``rotary_dim`` odd or <= 2.

  Source: bloc97, "NTK-Aware Scaled RoPE" (r/LocalLLaMA, 2023); the same exponent HF's dynamic NTK
  uses.
  """
  base = _checks.check_positive_float("base", base)
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  if rotary_dim <= 2:
    raise ValueError(f"rotary_dim must be > 2 for NTK scaling (exponent R / (R - 2)), got {rotary_dim}")
  if isinstance(factor, (bool, str, bytes, complex)):
    raise _checks.ArgTypeError(f"factor must be a number >= 1, got {factor!r}")
  try:
    factor = float(factor)
  except (TypeError, ValueError):
    raise _checks.ArgTypeError(f"factor must be a number >= 1, got {factor!r}") from None
  if not math.isfinite(factor) or factor < 1:
    raise ValueError(f"factor must be a finite number >= 1, got {factor!r}")
  return base * factor ** (rotary_dim / (rotary_dim - 2))


def _dynamic(params, base, rotary_dim, max_position_embeddings, seq_len, dtype):
  factor = param_factor(params["factor"], "dynamic")
  if rotary_dim <= 2:
    raise ValueError(f"rotary_dim must be > 2 for dynamic NTK (exponent R / (R - 2)), got {rotary_dim}")
  ref_len = params.get("original_max_position_embeddings") or max_position_embeddings
  if ref_len is None:
    raise ValueError(
      "rope_type='dynamic' needs max_position_embeddings (the pretraining context; or "
      "rope_scaling['original_max_position_embeddings'])"
    )
  ref_len = param_int("max_position_embeddings", ref_len)
  power = rotary_dim / (rotary_dim - 2)
  if seq_len is None or not isinstance(seq_len, jax.core.Tracer):
    s = max(ref_len if seq_len is None else seq_len, ref_len)
    new_base = base * ((factor * s / ref_len) - (factor - 1)) ** power
    return _to_f32(new_base ** -_exponents(rotary_dim), dtype)
  # Traced seq_len (under jit): same formula in float32 on the device.
  s = jnp.maximum(seq_len.astype(jnp.float32), jnp.float32(ref_len))
  log_base = jnp.float32(math.log(base)) + jnp.float32(power) * jnp.log(
    jnp.float32(factor) * s / jnp.float32(ref_len) - jnp.float32(factor - 1)
  )
  return jnp.exp(-log_base * jnp.asarray(_exponents(rotary_dim), jnp.float32))


def _yarn(params, base, rotary_dim, max_position_embeddings, dtype):
  orig = original_length(params, max_position_embeddings, "yarn")
  # transformers requires the key (its compute function's implicit max / original is unreachable
  # through a validated config); rope_frequencies refused a missing or None factor already.
  factor = param_factor(params["factor"], "yarn")

  def get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

  attention_factor = params.get("attention_factor")
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  if mscale is not None:
    mscale = param_float("mscale", mscale)
  if mscale_all_dim is not None:
    mscale_all_dim = param_float("mscale_all_dim", mscale_all_dim)
  if attention_factor is None:
    if mscale and mscale_all_dim:
      attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    else:
      attention_factor = get_mscale(factor)
  attention_factor = param_float("attention_factor", attention_factor, minimum=0.0, strict=True)
  # HF: `get("beta_fast") or 32`, `get("beta_slow") or 1`.
  beta_fast = param_float("beta_fast", params.get("beta_fast") or 32, minimum=0.0, strict=True)
  beta_slow = param_float("beta_slow", params.get("beta_slow") or 1, minimum=0.0, strict=True)
  if beta_fast < beta_slow:
    raise ValueError(
      f"rope_scaling['beta_fast'] ({beta_fast}) must be >= rope_scaling['beta_slow'] ({beta_slow})"
    )
  truncate = params.get("truncate", True)
  if truncate is None:
    truncate = True
  if not isinstance(truncate, bool):
    raise ValueError(f"rope_scaling['truncate'] must be a bool, got {truncate!r}")

  def correction_dim(num_rotations):
    return (rotary_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rotary_dim - 1)
  if low == high:
    high += 0.001  # HF: prevent singularity
  ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate by factor
  pos_freqs = base ** _exponents(rotary_dim)
  inv_freq = (1.0 / (factor * pos_freqs)) * (1.0 - extrapolation) + (1.0 / pos_freqs) * extrapolation
  return _to_f32(inv_freq, dtype), float(attention_factor)


def _longrope(params, base, rotary_dim, max_position_embeddings, seq_len, dtype):
  orig = original_length(params, max_position_embeddings, "longrope")
  factors = {}
  for key in ("short_factor", "long_factor"):
    value = params[key]
    numbers = isinstance(value, (list, tuple, np.ndarray)) and all(
      isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in value
    )
    if not numbers:
      raise ValueError(f"rope_scaling[{key!r}] must be a list of numbers, got {value!r}")
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != (rotary_dim // 2,):
      raise ValueError(
        f"rope_scaling[{key!r}] must have rotary_dim / 2 = {rotary_dim // 2} entries, got shape {arr.shape}"
      )
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
      raise ValueError(f"rope_scaling[{key!r}] entries must be finite and > 0, got {arr.tolist()}")
    factors[key] = arr
  factor = params.get("factor")
  if factor is None:
    if max_position_embeddings is None:
      raise ValueError("rope_type='longrope' needs rope_scaling['factor'] (or max_position_embeddings)")
    check_original_not_above_max(orig, max_position_embeddings, "longrope")
    factor = max_position_embeddings / orig  # HF: Phi-3 style implicit factor (>= 1: _original_len)
  else:
    factor = param_factor(factor, "longrope")
  attention_factor = params.get("attention_factor")
  if attention_factor is None:
    attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
  attention_factor = param_float("attention_factor", attention_factor, minimum=0.0, strict=True)
  pos_freqs = base ** _exponents(rotary_dim)
  short = 1.0 / (factors["short_factor"] * pos_freqs)
  long = 1.0 / (factors["long_factor"] * pos_freqs)
  if seq_len is None or not isinstance(seq_len, jax.core.Tracer):
    inv_freq = _to_f32(long if (seq_len and seq_len > orig) else short, dtype)
  else:  # traced seq_len: chosen on the device, float32
    inv_freq = jnp.where(seq_len > orig, _to_f32(long), _to_f32(short))
  return inv_freq, float(attention_factor)


def _llama3(params, base, rotary_dim, max_position_embeddings, dtype):
  orig = original_length(params, max_position_embeddings, "llama3")
  check_original_not_above_max(orig, max_position_embeddings, "llama3")
  factor = param_factor(params["factor"], "llama3")
  low_freq_factor = param_float("low_freq_factor", params["low_freq_factor"], minimum=0.0, strict=True)
  high_freq_factor = param_float("high_freq_factor", params["high_freq_factor"], minimum=0.0, strict=True)
  if high_freq_factor < low_freq_factor:
    raise ValueError(
      f"rope_scaling['high_freq_factor'] ({high_freq_factor}) must be >= "
      f"rope_scaling['low_freq_factor'] ({low_freq_factor})"
    )
  inv_freq = base ** -_exponents(rotary_dim)
  low_freq_wavelen = orig / low_freq_factor
  high_freq_wavelen = orig / high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  if high_freq_factor == low_freq_factor:
    # Llama-4: no smoothing band, a step at wavelength original / low_freq_factor.
    return _to_f32(scaled, dtype)
  smooth = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return _to_f32(np.where(medium, smoothed, scaled), dtype)


def _proportional(params, base, head_dim, rotary_dim, dtype=jnp.float32):
  head_dim = _checks.check_positive_int("head_dim", head_dim, even=True, maximum=_checks.MAX_DIM)
  if rotary_dim is not None and rotary_dim != head_dim:
    raise ValueError(
      f"rope_type='proportional' rotates the whole head (zero frequencies past the rotated share): "
      f"rotary_dim must be None or head_dim = {head_dim}, got {rotary_dim}"
    )
  prf = 1.0
  if params.get("partial_rotary_factor") is not None:
    prf = param_float("partial_rotary_factor", params["partial_rotary_factor"], minimum=0.0, strict=True)
    if prf > 1:
      raise ValueError(f"rope_scaling['partial_rotary_factor'] must be in (0, 1], got {prf}")
  factor = param_factor(1.0 if params.get("factor") is None else params["factor"], "proportional")
  angles = int(prf * head_dim // 2)  # HF: int(rope_proportion * head_dim // 2)
  inv_freq = np.zeros(head_dim // 2, np.float64)
  inv_freq[:angles] = base ** -(np.arange(0, 2 * angles, 2, dtype=np.float64) / head_dim)
  return _to_f32(inv_freq / factor, dtype)


def p_rope_inv_freq(
  head_dim: int, *, proportion: float, rope_theta: float = 10000.0, factor: float = 1.0, dtype=jnp.float32
):
  """p-RoPE's inverse frequencies: the highest ``int(proportion * H // 2)`` keep RoPE's
  ``rope_theta ** (-2i / H)`` (exponent over the whole head), the lowest are 0 (position-free).

  Rotate with ``jaxpe.ops.rope.apply_rope(x, positions, inv_freq=..., layout="half")`` (Gemma's
  pairs ``(i, i + H/2)``): the zero-frequency pairs pass through unchanged, so those dims carry
  content only (Barbero et al., "Round and Round We Go! What makes Rotary Positional Encodings
  useful?", arXiv 2410.06205: 0.75-RoPE beat RoPE on Gemma 2B). ``proportion=1`` is plain RoPE.

  Args:
    head_dim: H, even, positive.
    proportion: p in (0, 1], the share of the H/2 pairs that rotate.
    rope_theta: RoPE base (> 0), default 10000.
    factor: linear position interpolation (a finite number > 0, or None for 1): every frequency
      divided by it, as Gemma's ``scale_factor`` (HF's ``factor`` of ``proportional``); default 1.
    dtype: ``jnp.float32`` (default, a JAX array: the frequencies engines use) or ``np.float64``
      (a numpy array: give it to ``apply_rope`` for phases exact for the float64 frequencies; a
      float32 table shifts the phase by up to ``p * 6e-8 * theta``: 1.25e-2 at H 128 and positions
      near 131072, against 2.7e-7 from float64).

  Returns:
    ``[H/2]`` radians per token of ``dtype`` (computed in float64, rounded once for float32).

  Raises:
    ValueError: ``head_dim`` not a positive even int, ``proportion`` outside (0, 1], a
      ``rope_theta`` or ``factor`` not finite and > 0.
    TypeError: ``head_dim``, ``proportion``, ``rope_theta`` or ``factor`` not a real number (a bool,
      a string).

  Source: google-deepmind/gemma ``gemma/gm/math/_positional_embeddings.py`` ``apply_rope``
  (``rope_angles = int(rope_proportion * head_dim // 2)``, timescale ``base ** (2i / H)`` padded with
  inf); HF ``_compute_proportional_rope_parameters`` (Gemma-4's ``rope_type="proportional"``, which
  this is: ``rope_frequencies({"rope_type": "proportional", "partial_rotary_factor": p}, ...)``).
  """
  for name, value, accepted in (
    ("proportion", proportion, "in (0, 1]"),
    ("rope_theta", rope_theta, "finite and > 0"),
  ):
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
      raise TypeError(f"{name} must be a number {accepted}, got {value!r}")
    if not (0 < float(value) < math.inf and (name != "proportion" or float(value) <= 1)):
      raise ValueError(f"{name} must be {accepted}, got {value!r}")
  factor = 1.0 if factor is None else _checks.check_positive_float("factor", factor)
  dtype = _checks.check_float_dtype("dtype", dtype, allowed=(np.float32, np.float64))
  params = {"rope_type": "proportional", "partial_rotary_factor": float(proportion), "factor": factor}
  return _proportional(params, float(rope_theta), head_dim, None, dtype)


def rope_frequencies(
  rope_scaling: Mapping[str, Any] | None,
  *,
  head_dim: int,
  rope_theta: float = 10000.0,
  rotary_dim: int | None = None,
  max_position_embeddings: int | None = None,
  seq_len: int | jax.Array | None = None,
  dtype=jnp.float32,
) -> tuple[jax.Array | np.ndarray, float]:
  """``(inv_freq, attention_factor)`` for an HF-style ``rope_scaling`` / ``rope_parameters`` dict.

  Args:
    rope_scaling: mapping with ``"rope_type"`` (or the old ``"type"``; legacy ``"su"`` reads as
      ``"longrope"``, see ``normalize_rope_parameters``) in ``ROPE_TYPES`` and that
      type's keys (HF names: ``factor``, ``original_max_position_embeddings``,
      ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
      ``truncate``, ``short_factor``, ``long_factor``, ``low_freq_factor``, ``high_freq_factor``,
      and ``rope_theta`` / ``partial_rotary_factor`` which override the arguments). None or ``{}``
      mean ``default``.
    head_dim: H, per-head dim of q and k; positive.
    rope_theta: base (> 0) when the dict has no ``rope_theta``. Default 10000.
    rotary_dim: R, leading dims that rotate (even, ``<= H``); default H, or
      ``int(H * partial_rotary_factor)`` from the dict (the two must agree when both are given).
    max_position_embeddings: HF's ``config.max_position_embeddings`` in tokens. Default for
      ``original_max_position_embeddings`` (yarn, longrope, llama3), the implicit factor
      ``max_position_embeddings / original`` when ``factor`` is missing (longrope only), and the
      pretraining length of ``dynamic`` (which prefers ``original_max_position_embeddings`` when the
      dict has it, a jaxpe extension).
    seq_len: current sequence length in tokens (``dynamic``: the base grows once ``seq_len``
      exceeds the pretraining length; ``longrope``: long factors when ``seq_len > original``). A
      Python int, or a traced scalar int under jit. Default None: HF's init-time behaviour
      (``dynamic`` at its pretraining length, ``longrope`` short factors). Ignored by other types.
    dtype: ``jnp.float32`` (default: a JAX array, rounded once from float64, within 1 ulp of HF's
      float32 table) or ``np.float64`` (the float64 table as a numpy array, for phases exact for the
      float64 frequencies under ``apply_rope``'s exact phases: a float32 table is itself off by
      up to 6e-8 relative, ``p * 6e-8 * theta`` radians at position p). A traced ``seq_len``
      (``dynamic``, ``longrope``) gives a float32 table on the device whatever ``dtype``.

  Returns:
    ``inv_freq``: ``[R/2]`` radians per token of ``dtype``; ``attention_factor``: Python float
    that multiplies cos and sin (1.0 except yarn and longrope).

  Raises:
    ValueError: unknown ``rope_type`` or unknown key (named); a key the type does not read (e.g.
      ``beta_fast`` in a ``linear`` dict: transformers warns about it, jaxpe refuses); a missing
      required key (named; the same keys transformers 5.24 requires: ``factor`` for linear,
      dynamic, ntk, yarn and llama3, ``short_factor``/``long_factor`` for longrope,
      ``low_freq_factor``/``high_freq_factor`` for llama3; a value of None counts as missing);
      invalid values (not finite, ``factor <= 0``, ``factor < 1`` except for ``linear``, ``yarn``
      and ``proportional``, ``beta_fast < beta_slow``, ``high_freq_factor < low_freq_factor``,
      ``original_max_position_embeddings > max_position_embeddings`` for llama3 and for an implicit
      longrope factor, factor lists not of length R/2, ...); bad ``head_dim`` / ``rotary_dim`` /
      ``max_position_embeddings`` / ``seq_len`` values.
    TypeError (also a ValueError): ``rope_scaling`` not a mapping; a dict value, ``head_dim``,
      ``rotary_dim``, ``max_position_embeddings`` or ``seq_len`` of the wrong type (strings, bools,
      floats where ints are needed).

  Deliberate differences from transformers' validation (which raises only for missing keys and
  warns otherwise) are listed in docs/contracts.md and tested beside it in
  tests/ops/rope_parameters_test.py.

  Source: HF transformers ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (and
  ``LlamaRotaryEmbedding.compute_default_rope_parameters`` for ``default``).
  """
  dtype = _checks.check_float_dtype("dtype", dtype, allowed=(np.float32, np.float64))
  params = normalize_rope_parameters(rope_scaling)
  rope_type = params["rope_type"]
  check_type_keys(params)
  base = read_base(params, rope_theta)
  if rope_type == "proportional":
    return _proportional(params, base, head_dim, rotary_dim, dtype), 1.0
  rotary_dim = resolve_rotary_dim(params, head_dim, rotary_dim)
  max_position_embeddings = read_max_positions(params, max_position_embeddings)
  seq_len = check_seq_len(seq_len)

  if rope_type == "default":
    return _to_f32(base ** -_exponents(rotary_dim), dtype), 1.0
  if rope_type == "linear":
    factor = param_factor(params["factor"], rope_type)
    return _to_f32(base ** -_exponents(rotary_dim) / factor, dtype), 1.0
  if rope_type == "ntk":
    new_base = ntk_aware_base(base, factor=param_factor(params["factor"], rope_type), rotary_dim=rotary_dim)
    return _to_f32(new_base ** -_exponents(rotary_dim), dtype), 1.0
  if rope_type == "dynamic":
    return _dynamic(params, base, rotary_dim, max_position_embeddings, seq_len, dtype), 1.0
  if rope_type == "yarn":
    return _yarn(params, base, rotary_dim, max_position_embeddings, dtype)
  if rope_type == "longrope":
    return _longrope(params, base, rotary_dim, max_position_embeddings, seq_len, dtype)
  return _llama3(params, base, rotary_dim, max_position_embeddings, dtype), 1.0
