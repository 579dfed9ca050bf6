"""Rotary position embedding (RoPE) written with complex numbers, with exact phases.

Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
arXiv 2104.09864. The complex formulation matches Meta's LLaMA reference
(``precompute_freqs_cis`` / ``apply_rotary_emb`` in facebookresearch/llama ``model.py``).

Pair layouts (``layout=``, required: ``jaxpe.ops.layouts`` says why there is no default):

* ``"interleaved"`` (Meta LLaMA, EasyLM, complex): dims ``(2i, 2i+1)`` form the complex number
  ``x[2i] + 1j * x[2i+1]``.
* ``"half"`` (GPT-NeoX / HF ``rotate_half``, Gemma): dims ``(i, i + R/2)`` form
  ``x[i] + 1j * x[i + R/2]``. HF checkpoints need it.

Pair ``i`` rotates by ``positions * inv_freq[i]`` radians. ``R = 2 * len(inv_freq)`` dims rotate: the
first R of the head (``rotated_slice="leading"``, GPT-NeoX / GPT-J partial rotary) or the last R
(``"trailing"``, DeepSeek-V2/V3 MLA's ``q_pe``/``k_pe``); the others pass through unchanged.

Exact phases (``phase_precision="exact"``, the default): cos/sin of ``p * theta`` within 3e-7 of
the exact value for every position below 2^31, by a fixed-point reduction in turns
(``jaxpe.ops.exact_phases``), where every float32 implementation's ``float32(p) * float32(theta)``
drifts by half an ulp of the phase (3.9e-3 rad at p = 131072). ``phase_precision="float32"`` keeps
the phase ``float32(p) * float32(theta)`` bit for bit as HF transformers / Meta / vLLM compute it,
and XLA's float32 ``cos``/``sin`` of it (to match an engine that uses them).

The rotation is complex64; the result is cast back to the input dtype (JAX has no bf16 complex).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.exact_phases import exact_cos_sin
from jaxpe.ops.layouts import LAYOUTS, REQUIRED, Layout, check_layout

__all__ = [
  "LAYOUTS",
  "PHASE_PRECISIONS",
  "Layout",
  "PhasePrecision",
  "RotatedSlice",
  "apply_rope",
  "rope_cos_sin",
  "rope_inv_freq",
  "rope_phases",
]

PhasePrecision = Literal["exact", "float32"]
PHASE_PRECISIONS: tuple[str, ...] = ("exact", "float32")
RotatedSlice = Literal["leading", "trailing"]


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
    phase_precision: ``"exact"`` (default; cos/sin within 3e-7 of the float64 value, see
      ``jaxpe.ops.exact_phases``) or ``"float32"`` (``cos(float32(p) * float32(theta))``,
      bit-matching HF / Meta / vLLM).

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
  ``Qwen2VLRotaryEmbedding`` (mrope_section); exact reduction: ``jaxpe.ops.exact_phases``.
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
    cos, sin = exact_cos_sin(positions, inv_freq, lead)
  if wide:
    p = given_wide if mrope_section is None else jnp.moveaxis(given_wide, 0, -1)[..., axis_of]
    p = p if mrope_section is not None else p[..., None]
    if jnp.issubdtype(p.dtype, jnp.signedinteger):
      bad = (p < -_checks.MAX_POSITION) | (p >= _checks.MAX_POSITION)
    else:
      bad = p >= _checks.MAX_POSITION
    cos, sin = jnp.where(bad, jnp.nan, cos), jnp.where(bad, jnp.nan, sin)
  return cos, sin


def _check_scale(scale, target: tuple[int, ...], name: str = "attention_factor"):
  """``scale``: a real number or a real array broadcastable to ``target`` ``[B, T, N, R/2]``; finite
  when concrete. ArgTypeError for strings, bools, complex; ValueError otherwise."""
  if isinstance(scale, (str, bytes, bool, np.bool_, complex, np.complexfloating)):
    raise _checks.ArgTypeError(f"{name} must be a float (or float array), got {scale!r}")
  scale = _checks.as_array(name, scale)
  if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
    raise _checks.ArgTypeError(f"{name} must be a float (or float array), got dtype {scale.dtype}")
  if jnp.ndim(scale) > 0:
    _checks.broadcastable(name, scale.shape, target, "[B, T, N, R/2]")
  if not isinstance(scale, jax.core.Tracer):
    if not np.all(np.isfinite(np.asarray(scale, np.float64))):
      raise ValueError(f"{name} must be finite")
    if jnp.ndim(scale) == 0:
      return float(scale)
  return scale


def check_frequency_dtype(name: str, dtype) -> None:
  """Refuses frequencies in a float narrower than float32 (bfloat16, float16): the phase
  ``position * inv_freq`` carries the frequency's rounding times the position.

  Raises:
    TypeError: naming ``name``, the dtype, the phase error it causes and what to pass instead.
  """
  info = jnp.finfo(dtype)
  if info.nmant >= 23:
    return
  rel = 2.0 ** -(info.nmant + 1)
  raise TypeError(
    f"{name} must be float32 or float64, got {jnp.dtype(dtype).name}: its {info.nmant + 1}-bit significand rounds "
    f"each frequency by up to {rel:.2g} of itself, so the phase position * {name} is off by up to "
    f"{rel:.2g} x position rad ({1000 * rel:.2g} rad at position 1000 for a frequency of 1); pass the "
    "frequencies as float32 (or float64: rope_inv_freq(..., dtype=np.float64)); q and k may stay "
    f"{jnp.dtype(dtype).name}"
  )


def _check_inv_freq(inv_freq):
  inv_freq = _checks.as_array("inv_freq", inv_freq)
  if isinstance(inv_freq, np.ndarray) and inv_freq.dtype.kind in "iu":
    inv_freq = inv_freq.astype(np.float64)  # a list or tuple of Python numbers, e.g. [1, 0.5]
  _checks.check_rank("inv_freq", inv_freq, 1, "[R/2]")
  _checks.check_float("inv_freq", inv_freq)
  check_frequency_dtype("inv_freq", inv_freq.dtype)
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
  base: float | None = None,
  layout: Layout = REQUIRED,
  attention_factor: float | jax.Array = _checks.UNSET,
  rotated_slice: RotatedSlice = "leading",
  mrope_section=None,
  phase_precision: PhasePrecision = "exact",
  scale: float | jax.Array = _checks.UNSET,
) -> jax.Array:
  """Rotates queries or keys by their positions: ``x_pair * exp(1j * position * inv_freq)``.

  Args:
    x: ``[B, T, N, H]`` float array (queries ``[B, T, N, H]`` or keys ``[B, S, K, H]``).
    positions: token indices of the rows of ``x``: ``[B, T]``, or ``[1, T]`` / ``[T]`` shared by
      the batch; integers (any int dtype, values in ``[0, 2^31)``) or floats (see
      ``rope_cos_sin``). With ``mrope_section``: ``[A, B, T]``, ``[A, 1, T]`` or ``[A, T]``.
    inv_freq: ``[R/2]`` float radians per token, ``R <= H``; the other ``H - R`` dims pass
      through. Default: ``rope_inv_freq(H, base=base)`` in float64.
    base: rope_theta (> 0) of the default ``inv_freq``; None = 10000. Only without ``inv_freq``:
      giving both is a ValueError (the base would be ignored).
    layout: required, the pair layout within the rotated slice: ``"half"`` (rotate-half, pairs
      ``(i, i + R/2)``: HF transformers' Llama, Mistral, Qwen, Gemma, GPT-NeoX checkpoints) or
      ``"interleaved"`` (complex, pairs ``(2i, 2i+1)``: Meta's llama reference, EasyLM, GPT-J). No
      default: HF and Gemma rotate halves, Meta and EasyLM interleaved pairs, MaxText either per
      model, and weights of one convention under the other give wrong scores without an error
      (``jaxpe.ops.layouts`` cites them). ``rope_from_hf_config(config).layout`` reads it from an
      HF config; ``convert_qk_proj_weight`` moves weights between the layouts.
    attention_factor: multiplies each rotated pair (cos and sin): a scalar (``RopeSpec`` /
      ``HFRope.attention_factor``, HF's ``attention_scaling`` for YaRN/LongRoPE) or a float array
      broadcastable to ``[B, T, N, R/2]`` (xPos). Default 1. It is not position interpolation
      (gemma's ``scale_factor``, HF's linear ``rope_scaling`` factor): that divides ``inv_freq``.
    scale: the deprecated spelling of ``attention_factor`` (a ``DeprecationWarning`` saying what it
      is not); giving both is a TypeError.
    rotated_slice: which R dims rotate: ``"leading"`` (``x[..., :R]``, default) or ``"trailing"``
      (``x[..., H-R:]``, MLA-style ``[nope | rope]`` heads such as DeepSeek-V2/V3).
    mrope_section: multi-axis RoPE (Qwen2-VL); see ``rope_cos_sin``.
    phase_precision: ``"exact"`` (default) or ``"float32"``; see ``rope_cos_sin``.

  Returns:
    ``[B, T, N, H]`` array of ``x.dtype``.

  Raises:
    TypeError: ``layout`` not given (the message names both values).
    ValueError: wrong ranks, positions not ``[B, T]``/``[1, T]``/``[T]`` for x's B and T, odd H,
      ``R > H``, empty ``inv_freq``, ``base`` given with ``inv_freq``, unknown ``layout``/``rotated_slice``/``phase_precision``,
      concrete positions negative, >= 2^31, not finite or (float64) not held by float32,
      ``attention_factor`` not finite or not broadcastable to ``[B, T, N, R/2]``, bad ``mrope_section``.
    TypeError: non-float ``x`` or ``inv_freq`` (int, bool, complex, strings), an ``inv_freq``
      narrower than float32 (bfloat16, float16: the phases would carry its rounding times the
      position), positions neither integer nor float, ``attention_factor`` a string, bool or complex, ``base`` not a real
      number; both ``attention_factor`` and ``scale``.

  Under jit, traced positions are not checked: see ``rope_cos_sin`` for what negative, non-finite
  and too-wide positions give (exact rotations, or NaN rows). ``x`` of any float dtype (bfloat16,
  float16) is rotated in float32 and cast back; NaN in ``x`` stays in its pair.

  Source: RoFormer arXiv 2104.09864; Meta LLaMA ``apply_rotary_emb`` (interleaved), HF
  ``apply_rotary_pos_emb`` (half), HF ``Qwen2VLRotaryEmbedding`` (mrope_section).
  """
  check_layout(layout, "apply_rope")
  scale = _checks.renamed_attention_factor(
    "apply_rope", "scale", "attention_factor", scale, attention_factor, 1.0
  )
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 4, "[B, T, N, H]")
  _checks.check_float("x", x)
  if rotated_slice not in ("leading", "trailing"):
    raise ValueError(f"rotated_slice must be 'leading' or 'trailing', got {rotated_slice!r}")
  positions = _batch_positions(positions, x.shape[:2], multi_axis=mrope_section is not None)
  head_dim = x.shape[-1]
  if inv_freq is None:
    _checks.check_positive_int("x.shape[-1] (head_dim)", head_dim, even=True)
    inv_freq = rope_inv_freq(head_dim, base=10000.0 if base is None else base, dtype=np.float64)
  elif base is not None:
    raise ValueError(
      f"apply_rope: give base= or inv_freq=, not both (got base={base!r}): inv_freq fixes the frequencies "
      "and base would be ignored; build them from the base with rope_inv_freq(H, base=...) (or a scaled "
      "rope_frequencies(...)) and pass inv_freq only"
    )
  inv_freq = _check_inv_freq(inv_freq)
  rotary_dim = 2 * inv_freq.shape[0]
  if rotary_dim > head_dim:
    raise ValueError(
      f"inv_freq has {inv_freq.shape[0]} frequencies (rotary_dim {rotary_dim}) but head_dim is "
      f"{head_dim}; rotary_dim must be <= head_dim"
    )
  scale = _check_scale(scale, (*x.shape[:3], rotary_dim // 2))  # the attention factor, checked
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
