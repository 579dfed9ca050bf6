"""Sinusoidal absolute position encodings.

Vaswani et al., "Attention Is All You Need", arXiv 1706.03762, section 3.5:
``PE[p, 2i] = sin(p / base ** (2i / D))``, ``PE[p, 2i + 1] = cos(p / base ** (2i / D))``.
``layout="concat"`` gives ``[sin(...) for all i, cos(...) for all i]`` instead (tensor2tensor's
``get_timing_signal_1d`` and many reimplementations).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe import _checks


def sinusoidal_embedding(
  positions: jax.Array,
  *,
  d_model: int,
  base: float = 10000.0,
  layout: Literal["interleaved", "concat"] = "interleaved",
  dtype=jnp.float32,
) -> jax.Array:
  """Sinusoidal position encoding added to token embeddings.

  Args:
    positions: ``[B, T]`` integer token indices (>= 0).
    d_model: D, even and positive.
    base: > 0, the wavelength base (10000 in the paper).
    layout: ``"interleaved"`` (paper: sin at even dims, cos at odd) or ``"concat"`` (sin half, then
      cos half).
    dtype: output dtype; phases are computed in float32.

  Returns:
    ``[B, T, D]`` array of ``dtype``.

  Raises:
    ValueError: wrong rank, negative positions, odd or non-positive ``d_model``, bad ``base`` or
      ``layout``.
    TypeError: non-integer positions.
  """
  _checks.check_rank("positions", positions, 2, "[B, T]")
  _checks.check_positions("positions", positions)
  d_model = _checks.check_positive_int("d_model", d_model, even=True)
  base = _checks.check_positive_float("base", base)
  if layout not in ("interleaved", "concat"):
    raise ValueError(f"layout must be 'interleaved' or 'concat', got {layout!r}")
  inv_freq = jnp.asarray(base ** -(np.arange(0, d_model, 2, dtype=np.float64) / d_model), jnp.float32)
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, D/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if layout == "interleaved":
    out = jnp.stack([sin, cos], axis=-1).reshape(*positions.shape, d_model)
  else:
    out = jnp.concatenate([sin, cos], axis=-1)
  return out.astype(dtype)
