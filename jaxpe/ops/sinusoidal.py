"""Sinusoidal absolute position encodings, in the three conventions in use.

* ``"vaswani"``: Vaswani et al., "Attention Is All You Need", arXiv 1706.03762, section 3.5:
  ``PE[p, 2i] = sin(p * w_i)``, ``PE[p, 2i + 1] = cos(p * w_i)``, ``w_i = base ** (-2i / D)``
  (sin and cos interleaved). Also the PyTorch and Harvard "Annotated Transformer" tables.
* ``"tensor2tensor"``: tensor2tensor ``common_attention.get_timing_signal_1d`` (min_timescale 1,
  max_timescale ``base``), fairseq ``SinusoidalPositionalEmbedding.get_embedding`` and the Flax
  lm1b/wmt examples' ``sinusoidal_init``: ``[sin(p * w_i) for all i | cos(p * w_i) for all i]``
  with ``w_i = base ** (-i / (D/2 - 1))`` (the lowest frequency is exactly ``1 / base``; t2t uses
  ``max(D/2 - 1, 1)`` so D = 2 works). D = 8: ``w = [1, 0.046416, 0.0021544, 1e-4]``.
* ``"concat"``: ``[sin | cos]`` with the paper's ``w_i = base ** (-2i / D)`` (e.g. TensorFlow's
  Transformer tutorial ``positional_encoding``).

The two frequency rules differ (by up to 1.95 in the table at D = 8); a checkpoint trained with one
needs the same one. Phases are exact (``jaxpe.ops.rope.rope_cos_sin``): within 3e-7 of float64 at any
integer position below 2^31.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.rope import _computed_once, rope_cos_sin

Convention = Literal["vaswani", "tensor2tensor", "concat"]
CONVENTIONS: tuple[str, ...] = ("vaswani", "tensor2tensor", "concat")


def sinusoidal_frequencies(
  d_model: int, *, base: float = 10000.0, convention: Convention = "vaswani"
) -> np.ndarray:
  """The ``D/2`` angular frequencies ``w_i`` (radians per token) of a convention, in float64.

  Args:
    d_model: D, even and positive.
    base: > 0, the longest wavelength over 2 pi (10000 in all three sources).
    convention: ``"vaswani"`` / ``"concat"``: ``base ** (-2i / D)``; ``"tensor2tensor"``:
      ``base ** (-i / max(D/2 - 1, 1))``.

  Returns:
    ``[D/2]`` float64 numpy array.

  Raises:
    ValueError: odd or non-positive ``d_model``, bad ``base`` or ``convention``.

  Source: arXiv 1706.03762 section 3.5; tensor2tensor ``get_timing_signal_1d``; fairseq
  ``SinusoidalPositionalEmbedding``.
  """
  d_model = _checks.check_positive_int("d_model", d_model, even=True, maximum=_checks.MAX_DIM)
  base = _checks.check_positive_float("base", base)
  if convention not in CONVENTIONS:
    raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
  i = np.arange(d_model // 2, dtype=np.float64)
  if convention == "tensor2tensor":
    return np.exp(-np.log(base) * i / max(d_model // 2 - 1, 1))
  return base ** (-2.0 * i / d_model)


def sinusoidal_embedding(
  positions: jax.Array,
  *,
  d_model: int,
  base: float = 10000.0,
  convention: Convention = "vaswani",
  dtype=jnp.float32,
) -> jax.Array:
  """Sinusoidal position encoding added to token embeddings.

  Args:
    positions: ``[B, T]`` (or any shape, e.g. ``[T]``) token indices: integers in ``[0, 2^31)``,
      or floats (taken as float32; see ``jaxpe.ops.rope.rope_cos_sin``).
    d_model: D, even and positive.
    base: > 0, the wavelength base (10000 in the paper).
    convention: ``"vaswani"`` (sin at even dims, cos at odd), ``"tensor2tensor"`` (t2t / fairseq /
      Flax examples: ``[sin | cos]``, frequencies ``base ** (-i / (D/2 - 1))``) or ``"concat"``
      (``[sin | cos]`` with the paper's frequencies). See the module docstring.
    dtype: output float dtype (float32 default, bfloat16, float16, float64 under x64); cos/sin are
      computed in float32 with exact phases.

  Returns:
    ``[B, T, D]`` (``positions.shape + (D,)``) array of ``dtype``.

  Raises:
    ValueError: concrete positions negative or >= 2^31, odd or non-positive ``d_model``, bad
      ``base`` or ``convention``.
    TypeError: positions neither integer nor float.

  Source: see the module docstring (arXiv 1706.03762; tensor2tensor; fairseq).
  """
  freqs = sinusoidal_frequencies(d_model, base=base, convention=convention)
  dtype = _checks.check_float_dtype("dtype", dtype)
  positions = _checks.rope_positions("positions", positions)  # value checks before any tracing

  def table(p):  # positions [...] -> [..., D] of dtype
    cos, sin = rope_cos_sin(p, freqs)  # [..., D/2] each, exact phases
    if convention == "vaswani":
      out = jnp.stack([sin, cos], axis=-1).reshape(*cos.shape[:-1], d_model)
    else:
      out = jnp.concatenate([sin, cos], axis=-1)
    return out.astype(dtype)

  if positions.ndim < 2 or positions.shape[0] == 1 or not jnp.issubdtype(positions.dtype, jnp.integer):
    return table(positions)  # float positions: per row, so their gradients reach every row
  return _rows_computed_once(table, positions)


def _rows_computed_once(table, positions: jax.Array) -> jax.Array:
  """``table(positions)``, computed for one row and broadcast when all rows of the integer
  ``positions`` are equal (a batch sharing its positions, the usual case), else per row.

  ``table`` maps positions elementwise (``[R, ...] -> [R, ..., D]``), so both ways give the same
  bits. The choice is made at run time (``jax.lax.cond``), so the per-position work (about 60
  operations per value for exact phases) is done ``T * D/2`` times instead of ``B * T * D/2``;
  when XLA can prove the rows equal (positions built from ``arange`` in the same program) it keeps
  only the first branch, where ``_computed_once`` stops it from fusing the table into the broadcast
  (which would recompute it per batch row again).
  """

  def shared(p):
    (row,) = _computed_once(table(p[:1]))
    return jnp.broadcast_to(row, p.shape + row.shape[p.ndim :])

  return jax.lax.cond(jnp.all(positions == positions[:1]), shared, table, positions)
