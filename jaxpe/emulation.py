"""RoPE-emulated ALiBi: ALiBi carried by RoPE machinery.

Per head h with slope m_h, two dims are appended to q and k with fixed parts
``q_fixed = (-N_h, 0)`` and ``k_fixed = (0, 1)``. The original H dims get RoPE frequency 0 (no
rotation); the new pair gets frequency theta (radians per token). After rotation (complex layout,
query at i, key at j):

    (R_i q_fixed) . (R_j k_fixed) = N_h sin((j - i) theta) = -N_h sin(d theta),   d = i - j,

and after the usual ``1/sqrt(H)`` scaling (H the *original* head dim) the score term is
``-(N_h / sqrt(H)) sin(d theta) ~= -m_h d`` when ``N_h = m_h sqrt(H) / theta``. The relative error
of the bias is about ``(d theta)^2 / 6`` (small-angle expansion of sin).

Precision: the emulation dims are built and rotated in float32 whatever the input dtype, and the
augmented q and k are returned in float32 so that their product is float32 too (``N_h`` is ~1e6:
it overflows float16 and bf16 loses whole logits). See ``jaxpe/DESIGN`` notes in the README.

Source: the construction in ``shared/DESIGN.md`` section 3 (RoPE from arXiv 2104.09864, ALiBi from
arXiv 2108.12409).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe import _checks
from jaxpe.rope import apply_rope


def emulation_theta(*, max_phase: float, max_len: int) -> float:
  """Frequency theta = max_phase / max_len, so that the largest phase ``d theta`` stays ``<= max_phase``.

  Args:
    max_phase: largest rotation angle in radians over the context; ``0 < max_phase < pi/2``
      (sin is monotonic only below pi/2; 0.1 gives a 1.7e-3 relative bias error).
    max_len: longest context in tokens (the largest distance is ``max_len - 1``); positive.

  Returns:
    theta in radians per token (Python float).

  Raises:
    ValueError: ``max_phase`` outside (0, pi/2) or ``max_len`` not a positive integer.
  """
  max_len = _checks.check_positive_int("max_len", max_len)
  try:
    phase = float(max_phase)
  except (TypeError, ValueError):
    raise ValueError(f"max_phase must be a number in (0, pi/2), got {max_phase!r}") from None
  if not (0.0 < phase < math.pi / 2):
    raise ValueError(
      f"max_phase must be in (0, pi/2) radians (sin(d theta) must stay monotonic), got {phase}"
    )
  return phase / max_len


def emulation_amplitudes(slopes, *, head_dim: int, theta: float) -> np.ndarray:
  """Per-head amplitudes ``N_h = m_h sqrt(H) / theta`` in float64 on the host.

  Args:
    slopes: ``[N]`` ALiBi slopes m_h (> 0), array-like.
    head_dim: H, the original (content) head dim; positive.
    theta: frequency of the emulation pair in radians per token; ``> 0``.

  Returns:
    ``[N]`` float64 amplitudes.

  Raises:
    ValueError: bad slopes, head_dim or theta.
  """
  slopes = np.asarray(slopes, dtype=np.float64)
  _checks.check_slopes("slopes", slopes)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  theta = _checks.check_positive_float("theta", theta)
  return slopes * math.sqrt(head_dim) / theta


def apply_rope_alibi(
  q: jax.Array,
  k: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  theta: float,
) -> tuple[jax.Array, jax.Array]:
  """Appends the two emulation dims to q and k and rotates them (original dims at frequency 0).

  Score with the returned arrays, scaled by ``1/sqrt(H)`` of the *original* head dim:
  ``q_aug . k_aug / sqrt(H) = q . k / sqrt(H) - (N_h / sqrt(H)) sin((i - j) theta)``.

  Args:
    q: ``[B, T, N, H]`` float queries (already position-free content).
    k: ``[B, S, K, H]`` float keys (K kv heads; the key part of the emulation is head-independent).
    q_positions: ``[B, T]`` integer token indices of the queries.
    k_positions: ``[B, S]`` integer token indices of the keys.
    slopes: ``[N]`` ALiBi slopes (> 0), concrete (numpy or Python), one per query head.
    theta: emulation frequency in radians per token (``> 0``), e.g. ``emulation_theta(...)``.

  Returns:
    ``(q_aug [B, T, N, H + 2], k_aug [B, S, N, H + 2])`` float32.

  Raises:
    ValueError: wrong ranks, slope count != N, q/k head counts differ, bad theta or slopes.
  """
  _checks.check_rank("q", q, 4, "[B, T, N, H]")
  _checks.check_rank("k", k, 4, "[B, S, K, H]")
  batch, _, num_heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"k must have shape [B, S, K, H] = [{batch}, S, K, {head_dim}], got {k.shape}")
  amplitudes = emulation_amplitudes(slopes, head_dim=head_dim, theta=theta)
  if amplitudes.shape[0] != num_heads:
    raise ValueError(f"slopes must have one entry per head (N = {num_heads}), got {amplitudes.shape[0]}")
  if head_dim % 2:
    raise ValueError(f"q.shape[-1] (head_dim) must be even for the pair layout, got {head_dim}")
  inv_freq = jnp.asarray([0.0] * (head_dim // 2) + [theta], jnp.float32)

  amp = jnp.asarray(amplitudes, jnp.float32)
  q_fixed = jnp.stack([-amp, jnp.zeros_like(amp)], axis=-1)  # [N, 2]
  k_fixed = jnp.asarray([0.0, 1.0], jnp.float32)  # [2]
  q_aug = jnp.concatenate(
    [q.astype(jnp.float32), jnp.broadcast_to(q_fixed, (*q.shape[:2], num_heads, 2))], axis=-1
  )
  k_aug = jnp.concatenate([k.astype(jnp.float32), jnp.broadcast_to(k_fixed, (*k.shape[:3], 2))], axis=-1)
  return (
    apply_rope(q_aug, q_positions, inv_freq=inv_freq),
    apply_rope(k_aug, k_positions, inv_freq=inv_freq),
  )
