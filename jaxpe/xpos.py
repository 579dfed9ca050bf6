"""xPos: RoPE with an exponential decay that keeps attention scores relative.

Sun et al., "A Length-Extrapolatable Transformer", arXiv 2212.10554; reference code
microsoft/torchscale ``torchscale/component/xpos_relative_position.py`` (``XPOS``).

Pair i of a query at position n is multiplied by ``zeta_i ** (n / scale_base)`` and pair i of a key
at position m by ``zeta_i ** (-m / scale_base)``, with ``zeta_i = (2i / R + gamma) / (1 + gamma)``
(torchscale: ``(arange(0, R, 2) + 0.4 R) / (1.4 R)``). The score of the pair then carries
``zeta_i ** ((n - m) / scale_base)``: it depends only on the distance, and decays with it.
The rotation is RoPE (``jaxpe.rope.apply_rope``) with the same inv_freq.

Large positions: ``zeta_0 ** (n / 512)`` underflows float32 near n = 40,000 (gamma 0.4). Give
queries and keys the same ``offset`` (torchscale centres positions the same way): the score is
unchanged and the scales stay near 1.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe import _checks
from jaxpe.rope import Layout, _batch_positions, apply_rope, rope_inv_freq


def xpos_zeta(rotary_dim: int, *, gamma: float = 0.4) -> np.ndarray:
  """Per-pair decay bases ``zeta_i = (2i / R + gamma) / (1 + gamma)``, i < R/2, in float64.

  Args:
    rotary_dim: R, even and positive.
    gamma: > 0; 0.4 in the paper and torchscale.

  Returns:
    ``[R/2]`` float64 numbers in ``(0, 1)``.

  Raises:
    ValueError: odd or non-positive ``rotary_dim``; ``gamma`` not a finite number > 0.
  """
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  gamma = _checks.check_positive_float("gamma", gamma)
  return (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim + gamma) / (1.0 + gamma)


def xpos_scale(
  positions: jax.Array,
  *,
  rotary_dim: int,
  kind: Literal["query", "key"],
  scale_base: float = 512.0,
  gamma: float = 0.4,
  offset: int = 0,
) -> jax.Array:
  """xPos scale per pair: ``zeta ** ((p - offset) / scale_base)`` for queries, its inverse for keys.

  Args:
    positions: ``[B, T]`` integer token indices (>= 0).
    rotary_dim: R, even, positive.
    kind: ``"query"`` (scale up) or ``"key"`` (scale down, the inverse).
    scale_base: > 0, positions per e-fold of the exponent; 512 in the paper.
    gamma: > 0, see ``xpos_zeta``.
    offset: integer subtracted from every position before exponentiation (use the same for
      queries and keys; it cancels in the score).

  Returns:
    ``[B, T, 1, R/2]`` float32, broadcastable against ``[B, T, N, R/2]`` (``apply_rope``'s ``scale``).

  Raises:
    ValueError: wrong rank, negative positions, bad ``kind``/``scale_base``/``gamma``/``offset``.
    TypeError: non-integer positions.
  """
  _checks.check_rank("positions", positions, 2, "[B, T]")
  _checks.check_positions("positions", positions)
  if kind not in ("query", "key"):
    raise ValueError(f"kind must be 'query' or 'key', got {kind!r}")
  scale_base = _checks.check_positive_float("scale_base", scale_base)
  if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
    raise ValueError(f"offset must be an integer (token index), got {offset!r}")
  log_zeta = jnp.asarray(np.log(xpos_zeta(rotary_dim, gamma=gamma)), jnp.float32)  # [R/2]
  sign = 1.0 if kind == "query" else -1.0
  exponent = (positions - jnp.asarray(offset, positions.dtype)).astype(jnp.float32) * jnp.float32(
    sign / scale_base
  )
  return jnp.exp(exponent[:, :, None, None] * log_zeta[None, None, None, :])


def apply_xpos(
  x: jax.Array,
  positions: jax.Array,
  *,
  kind: Literal["query", "key"],
  inv_freq: jax.Array | None = None,
  base: float = 10000.0,
  layout: Layout = "interleaved",
  scale_base: float = 512.0,
  gamma: float = 0.4,
  offset: int = 0,
  attention_factor: float = 1.0,
) -> jax.Array:
  """Rotates ``x`` like RoPE and scales each pair by the xPos factor.

  Args:
    x: ``[B, T, N, H]`` float queries (``kind="query"``) or keys ``[B, S, K, H]`` (``kind="key"``).
    positions: integer token indices in ``[0, 2^31)``: ``[B, T]``, or ``[1, T]`` / ``[T]`` shared
      by the batch. Phases are exact (``apply_rope``'s default).
    kind: ``"query"`` or ``"key"``.
    inv_freq: ``[R/2]`` float radians per token (``R <= H``, dims R..H-1 pass through unscaled);
      default ``rope_inv_freq(H, base=base)`` in float64.
    base: rope_theta when ``inv_freq`` is None.
    layout: ``"interleaved"`` (torchscale's ``rotate_every_two``) or ``"half"``.
    scale_base, gamma, offset: see ``xpos_scale``.
    attention_factor: extra constant on the rotated pairs (HF's ``attention_scaling`` of YaRN /
      LongRoPE frequencies, see ``jaxpe.rope_scaling``); > 0, default 1.

  Returns:
    ``[B, T, N, H]`` array of ``x.dtype``.

  Raises:
    ValueError / TypeError: as ``apply_rope`` and ``xpos_scale``.
  """
  _checks.check_rank("x", x, 4, "[B, T, N, H]")
  if inv_freq is None:
    head_dim = _checks.check_positive_int("x.shape[-1] (head_dim)", x.shape[-1], even=True)
    inv_freq = rope_inv_freq(head_dim, base=base, dtype=np.float64)
  elif not isinstance(inv_freq, jax.Array | np.ndarray):
    inv_freq = np.asarray(inv_freq, np.float64)
  _checks.check_rank("inv_freq", inv_freq, 1, "[R/2]")
  positions = _batch_positions(positions, x.shape[:2], multi_axis=False)  # [B or 1, T]
  scale = xpos_scale(
    positions,
    rotary_dim=2 * inv_freq.shape[0],
    kind=kind,
    scale_base=scale_base,
    gamma=gamma,
    offset=offset,
  )
  attention_factor = _checks.check_positive_float("attention_factor", attention_factor)
  return apply_rope(
    x, positions, inv_freq=inv_freq, layout=layout, scale=scale * jnp.float32(attention_factor)
  )
