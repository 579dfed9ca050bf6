"""Rotary position embedding (RoPE) written with complex numbers.

Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
arXiv 2104.09864. The complex formulation matches Meta's LLaMA reference
(``precompute_freqs_cis`` / ``apply_rotary_emb`` in facebookresearch/llama ``model.py``).

Pair layouts (see ``Layout``):

* ``"interleaved"`` (Meta LLaMA, complex): dims ``(2i, 2i+1)`` form the complex number
  ``x[2i] + 1j * x[2i+1]``.
* ``"half"`` (GPT-NeoX / HF ``rotate_half``): dims ``(i, i + R/2)`` form
  ``x[i] + 1j * x[i + R/2]``.

Pair ``i`` rotates by ``positions * inv_freq[i]`` radians. Only the first ``R = 2 * len(inv_freq)``
dims (the rotary block) rotate; dims ``R..H-1`` pass through unchanged (partial rotary).
Phases are computed in float32 from float32 inv_freq, the rotation in complex64, and the result is
cast back to the input dtype (JAX has no bf16 complex).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe import _checks

Layout = Literal["interleaved", "half"]
LAYOUTS: tuple[str, ...] = ("interleaved", "half")


def rope_inv_freq(head_dim: int, *, base: float = 10000.0, rotary_dim: int | None = None) -> jax.Array:
  """Default RoPE inverse frequencies ``base ** (-2i / rotary_dim)``, ``i < rotary_dim / 2``.

  Args:
    head_dim: H, the per-head dimension of q and k; positive.
    base: rope_theta, > 0. Default 10000 (RoFormer, LLaMA).
    rotary_dim: R, number of leading dims that rotate; even, ``0 < R <= H``. Default ``H``.

  Returns:
    inv_freq: ``[R/2]`` float32, radians per token.

  Raises:
    ValueError: ``head_dim``/``rotary_dim`` not positive, ``rotary_dim`` odd or > ``head_dim``,
      ``base`` not a finite number > 0.
  """
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  rotary_dim = head_dim if rotary_dim is None else rotary_dim
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  if rotary_dim > head_dim:
    raise ValueError(f"rotary_dim must be <= head_dim = {head_dim}, got {rotary_dim}")
  base = _checks.check_positive_float("base", base)
  # float64 on the host, rounded once to float32 (HF computes base ** (arange / dim) in float32;
  # the two agree to 1 ulp).
  exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
  return jnp.asarray(base**-exponents, dtype=jnp.float32)


def rope_phases(positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotation angles ``positions[..., None] * inv_freq`` in float32.

  Args:
    positions: ``[B, T]`` integer token indices, >= 0.
    inv_freq: ``[R/2]`` float, radians per token.

  Returns:
    ``[B, T, R/2]`` float32 radians.

  Raises:
    ValueError: ``positions`` not ``[B, T]`` or negative, ``inv_freq`` not ``[R/2]``.
    TypeError: non-integer ``positions``.
  """
  _checks.check_rank("positions", positions, 2, "[B, T]")
  _checks.check_positions("positions", positions)
  _checks.check_rank("inv_freq", inv_freq, 1, "[R/2]")
  inv_freq = jnp.asarray(inv_freq, jnp.float32)
  return positions.astype(jnp.float32)[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))


def apply_rope(
  x: jax.Array,
  positions: jax.Array,
  *,
  inv_freq: jax.Array | None = None,
  base: float = 10000.0,
  layout: Layout = "interleaved",
  scale: float | jax.Array = 1.0,
) -> jax.Array:
  """Rotates queries or keys by their positions: ``x_pair * exp(1j * position * inv_freq)``.

  Args:
    x: ``[B, T, N, H]`` float array (queries ``[B, T, N, H]`` or keys ``[B, S, K, H]``).
    positions: ``[B, T]`` integer token indices (>= 0) of the rows of ``x``.
    inv_freq: ``[R/2]`` float radians per token, ``R <= H``; dims ``R..H-1`` pass through.
      Default: ``rope_inv_freq(H, base=base)``.
    base: rope_theta used when ``inv_freq`` is None.
    layout: ``"interleaved"`` (complex, Meta) or ``"half"`` (rotate-half, GPT-NeoX/HF).
    scale: multiplies each rotated pair: a scalar (HF's ``attention_scaling`` for YaRN/LongRoPE)
      or a float array broadcastable to ``[B, T, N, R/2]`` (xPos). Default 1.

  Returns:
    ``[B, T, N, H]`` array of ``x.dtype``.

  Raises:
    ValueError: wrong ranks, mismatched B/T, odd H, ``R > H``, unknown ``layout``, negative
      positions, ``scale`` not finite or not broadcastable to ``[B, T, N, R/2]``.
    TypeError: non-float ``x`` or ``inv_freq``, non-integer ``positions``.
  """
  _checks.check_rank("x", x, 4, "[B, T, N, H]")
  _checks.check_float("x", x)
  _checks.check_rank("positions", positions, 2, "[B, T]")
  _checks.check_positions("positions", positions)
  if positions.shape != x.shape[:2]:
    raise ValueError(f"positions shape {positions.shape} must equal x.shape[:2] = {x.shape[:2]} ([B, T])")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  head_dim = x.shape[-1]
  if inv_freq is None:
    _checks.check_positive_int("x.shape[-1] (head_dim)", head_dim, even=True)
    inv_freq = rope_inv_freq(head_dim, base=base)
  if not isinstance(inv_freq, jax.Array | np.ndarray):
    inv_freq = np.asarray(inv_freq)  # a list or tuple of frequencies
  _checks.check_rank("inv_freq", inv_freq, 1, "[R/2]")
  if not isinstance(inv_freq, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(inv_freq, np.float64))):
    raise ValueError("inv_freq must be finite (radians per token)")
  rotary_dim = 2 * inv_freq.shape[0]
  if rotary_dim > head_dim:
    raise ValueError(
      f"inv_freq has {inv_freq.shape[0]} frequencies (rotary_dim {rotary_dim}) but head_dim is "
      f"{head_dim}; rotary_dim must be <= head_dim"
    )

  _checks.check_float("inv_freq", inv_freq)
  if isinstance(scale, list | tuple):
    scale = np.asarray(scale, np.float32)
  if isinstance(scale, jax.Array | np.ndarray) and jnp.ndim(scale) > 0:
    _checks.broadcastable("scale", scale.shape, (*x.shape[:3], rotary_dim // 2), "[B, T, N, R/2]")
  elif not isinstance(scale, jax.core.Tracer) and not np.isfinite(float(scale)):
    raise ValueError(f"scale must be finite, got {scale!r}")
  phases = rope_phases(positions, inv_freq)[:, :, None, :]  # [B, T, 1, R/2] float32
  cos, sin = jnp.cos(phases), jnp.sin(phases)
  if isinstance(scale, jax.Array | np.ndarray) or float(scale) != 1.0:
    scale = jnp.asarray(scale, jnp.float32)
    cos, sin = cos * scale, sin * scale
  rot = jax.lax.complex(cos, sin)  # exp(1j * phase), complex64
  x_rot, x_pass = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
  if layout == "interleaved":
    pairs = x_rot.reshape(*x_rot.shape[:-1], rotary_dim // 2, 2)
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * rot
    out = jnp.stack([z.real, z.imag], axis=-1).reshape(x_rot.shape)
  else:
    half = rotary_dim // 2
    z = jax.lax.complex(x_rot[..., :half], x_rot[..., half:]) * rot
    out = jnp.concatenate([z.real, z.imag], axis=-1)
  return jnp.concatenate([out.astype(x.dtype), x_pass], axis=-1)
