"""The base-constrained mode: the emulation on a standard RoPE engine's own frequency table.

An engine whose only controls are a base and a rotary block (``base^(-2r/R)``, partial rotary as in
GPT-NeoX ``rotary_pct``) carries the order-1 emulation on the pair whose frequency is closest below
the solver's theta (``jaxpe.emulation.solver``); ``solve_base_constrained`` picks the pair and
predicts the error (``jaxpe.emulation.bounds``), ``base_constrained_qk`` lays q and k out for the
engine.

Source: jaxpe's extension of the construction in ``shared/DESIGN.md`` section 3 (``docs/emulation.md``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
R rotary dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.emulation.bounds import ROUNDING_CONSTANT, rounding_sum, truncation_error_bound
from jaxpe.emulation.checks import (
  MAX_POSITION,
  UNIT_ROUNDOFF,
  check_representable,
  dtype_name,
  slopes_or_heads,
)
from jaxpe.emulation.solver import emulation_theta, solve_emulation
from jaxpe.ops import checks as _checks
from jaxpe.ops.layouts import REQUIRED, check_layout
from jaxpe.ops.rope import rope_inv_freq


@dataclasses.dataclass(frozen=True)
class BaseConstrainedPlan:
  """Emulation placed on a standard RoPE frequency table ``base^(-2r/R)``, r < R/2.

  Attributes:
    slopes: ``[N]`` m_h.
    head_dim: H, content dims (kept outside the rotary block, so they do not rotate).
    rotary_dim: R, the engine's rotary block; the engine's head dim is ``R + H``.
    base: the engine's RoPE base.
    layout: the engine's pair layout, ``"interleaved"`` or ``"half"``.
    max_len: context the plan is for.
    dtype: dtype carrying the emulation dims.
    wanted_theta: the frequency the unconstrained solver would use (radians per token): the
      smaller of ``max_phase / max_len`` and the ``target_error`` solution, when given.
    pair_index: r, the rotary pair carrying the emulation (the largest frequency <= wanted_theta,
      or the lowest one when all are above).
    theta: ``base^(-2r/R)`` as the engine computes it (float32), radians per token.
    amplitudes: ``[N]`` N_h = m_h sqrt(H) / theta.
    truncation_bound: ``[N]`` ``(m / theta) e_1(theta (max_len - 1))``.
    rounding_bound: ``[N]`` rounding model at ``max_len``.
    target_error: the error (logits) used for ``max_context``; None if not given.
    max_context: longest context whose predicted deviation stays <= ``target_error`` for every head
      with this base (None without a target).
    base_needed: smallest base whose lowest frequency meets ``target_error`` at ``max_len``, when
      the given base does not (else None; ``inf`` when R = 2 offers no low frequency).
  """

  slopes: np.ndarray
  head_dim: int
  rotary_dim: int
  base: float
  layout: str
  max_len: int
  dtype: str
  wanted_theta: float
  pair_index: int
  theta: float
  amplitudes: np.ndarray
  truncation_bound: np.ndarray
  rounding_bound: np.ndarray
  target_error: float | None
  max_context: int | None
  base_needed: float | None

  @property
  def bound(self) -> np.ndarray:
    """``[N]`` predicted worst-case deviation over ``max_len``: truncation + rounding."""
    return self.truncation_bound + self.rounding_bound

  def inv_freq(self) -> np.ndarray:
    """``[R/2]`` float32 engine frequencies ``base^(-2r/R)`` (as ``jaxpe.rope.rope_inv_freq``)."""
    return np.asarray(rope_inv_freq(self.rotary_dim, base=self.base))


def _base_bound(slopes, theta, length, order, dtype):
  dist = max(length - 1, 0)
  trunc = slopes / theta * truncation_error_bound(theta * dist, order=order)
  return trunc, ROUNDING_CONSTANT * UNIT_ROUNDOFF[dtype] * slopes * rounding_sum(order) * 2.0 * dist


def solve_base_constrained(
  slopes=None,
  *,
  num_heads: int | None = None,
  head_dim: int,
  rotary_dim: int,
  base: float = 10000.0,
  max_len: int,
  max_phase: float | None = None,
  target_error: float | None = None,
  layout: str = REQUIRED,
  dtype="float32",
) -> BaseConstrainedPlan:
  """Emulation for a RoPE engine whose only controls are a base and a rotary block.

  The engine rotates the first R dims of each head at ``base^(-2r/R)`` and passes the rest through
  (partial rotary, e.g. GPT-NeoX ``rotary_pct``). The emulation pair goes to pair ``r`` (the
  largest frequency not above the wanted theta, else the lowest), every other rotary dim of q and k
  is zero, and the content dims sit after the rotary block. Only order 1 is possible (the table
  rarely holds 2 theta too).

  Args:
    slopes: ``[N]`` ALiBi slopes; or ``num_heads`` for the paper's slopes.
    num_heads: N, when ``slopes`` is None.
    head_dim: H, content dims; positive.
    rotary_dim: R, even, >= 2.
    base: the engine's RoPE base, > 1.
    max_len: context in tokens, 1..2^24.
    max_phase: wanted largest phase (radians, in (0, pi/2)): wanted theta <= max_phase / max_len.
    target_error: error in logits: wanted theta <= the solver's theta for this error; also sets
      ``max_context`` / ``base_needed``.
    layout: the engine's pair layout, required (no default, as for ``apply_rope``: the wrong one
      gives wrong scores without an error): ``"interleaved"`` (pair r = dims 2r, 2r+1; Meta's
      llama, EasyLM) or ``"half"`` (dims r, r + R/2; HF transformers' ``rotate_half``, GPT-NeoX).
    dtype: dtype carrying the emulation dims (float32 = the policy).

  Returns:
    A ``BaseConstrainedPlan``.

  Raises:
    TypeError: ``layout`` not given.
    ValueError: neither max_phase nor target_error; odd or too small rotary_dim; base <= 1; bad
      layout; the chosen frequency makes the phase reach pi/2 within max_len (message gives the
      longest usable context and the base that would be needed); amplitude overflow.
  """
  slopes = slopes_or_heads(slopes, num_heads)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  max_len = _checks.check_positive_int("max_len", max_len)
  if max_len > MAX_POSITION:
    raise ValueError(f"max_len must be <= 2^24 = {MAX_POSITION}, got {max_len}")
  base = _checks.check_positive_float("base", base)
  if base <= 1.0:
    raise ValueError(f"base must be > 1 (frequencies base^(-2r/R) must fall with r), got {base}")
  if layout is REQUIRED:
    check_layout(layout, "solve_base_constrained")
  if layout not in ("interleaved", "half"):
    raise ValueError(f"layout must be 'interleaved' or 'half', got {layout!r}")
  dtype = dtype_name(dtype)
  if max_phase is None and target_error is None:
    raise ValueError("give max_phase (radians) and/or target_error (logits)")
  if target_error is not None:
    target_error = _checks.check_positive_float("target_error", target_error)
  wanted = math.inf
  if max_phase is not None:
    wanted = emulation_theta(max_phase=max_phase, max_len=max_len)
  if target_error is not None:
    target_theta = solve_emulation(
      slopes, head_dim=head_dim, max_len=max_len, target_error=target_error, dtype=dtype
    ).theta[0]
    wanted = min(wanted, float(target_theta))
  freqs = np.asarray(rope_inv_freq(rotary_dim, base=base))  # float32, as the engine uses them
  below = np.nonzero(freqs.astype(np.float64) <= wanted)[0]
  index = int(below[0]) if below.size else rotary_dim // 2 - 1
  theta = float(freqs[index])
  if theta * (max_len - 1) >= math.pi / 2:
    longest = int(math.pi / 2 / theta)
    raise ValueError(
      f"the lowest frequency of base {base:g}, rotary_dim {rotary_dim} is {theta:.4g} rad/token: the "
      f"phase reaches pi/2 at distance {longest}, below max_len {max_len}; shorten max_len, raise the "
      f"base to >= {_needed_base(wanted, rotary_dim):.4g} or raise rotary_dim"
    )
  amplitudes = slopes * math.sqrt(head_dim) / theta
  check_representable(amplitudes, np.ones(1), dtype, "use a larger base frequency")
  trunc, rounding = _base_bound(slopes, theta, max_len, 1, dtype)
  max_context = base_needed = None
  if target_error is not None:

    def ok(length: int) -> bool:
      t, r = _base_bound(slopes, theta, length, 1, dtype)
      return bool(np.all(t + r <= target_error)) and theta * (length - 1) < math.pi / 2

    if not ok(1):
      max_context = 0
    else:
      lo, hi = 1, 2
      while hi <= MAX_POSITION and ok(hi):
        lo, hi = hi, hi * 2
      hi = min(hi, MAX_POSITION + 1)
      while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
      max_context = lo
    if max_context < max_len:
      need = solve_emulation(
        slopes, head_dim=head_dim, max_len=max_len, target_error=target_error, dtype=dtype
      ).theta[0]
      base_needed = _needed_base(float(need), rotary_dim)
  return BaseConstrainedPlan(
    slopes=slopes,
    head_dim=head_dim,
    rotary_dim=rotary_dim,
    base=base,
    layout=layout,
    max_len=max_len,
    dtype=dtype,
    wanted_theta=wanted,
    pair_index=index,
    theta=theta,
    amplitudes=amplitudes,
    truncation_bound=trunc,
    rounding_bound=rounding,
    target_error=target_error,
    max_context=max_context,
    base_needed=base_needed,
  )


def _needed_base(theta: float, rotary_dim: int) -> float:
  """Smallest base whose lowest frequency ``base^(-(R-2)/R)`` is <= theta (inf for R = 2)."""
  if rotary_dim <= 2:
    return math.inf
  return theta ** (-rotary_dim / (rotary_dim - 2))


def base_constrained_qk(
  q: jax.Array, k: jax.Array, *, plan: BaseConstrainedPlan
) -> tuple[jax.Array, jax.Array]:
  """q and k laid out for a standard RoPE engine (``plan.base``, rotary block ``plan.rotary_dim``).

  Returns unrotated ``[rotary block | content]`` arrays: the rotary block is zero except pair
  ``plan.pair_index``, which holds ``(-N_h, 0)`` in q and ``(0, 1)`` in k; the content dims follow
  unchanged. The engine then rotates the block (e.g. ``jaxpe.rope.apply_rope(x, positions,
  inv_freq=plan.inv_freq(), layout=plan.layout)``) and scores with ``1/sqrt(H)`` of the content
  dims: ``q.k / sqrt(H) - (m_h / theta) sin((i - j) theta)``. Positions belong to the engine.

  Args:
    q: ``[B, T, N, H]`` float queries.
    k: ``[B, S, K, H]`` float keys.
    plan: from ``solve_base_constrained``; ``N`` slopes, ``H`` content dims.

  Returns:
    ``(q_eng [B, T, N, R + H], k_eng [B, S, K, R + H])`` float32 (the precision policy).

  Raises:
    ValueError: ranks, batch sizes that differ, or N / H that do not match the plan.
    TypeError: ``plan`` not a ``BaseConstrainedPlan``; non-float q or k.
  """
  if not isinstance(plan, BaseConstrainedPlan):
    raise TypeError(
      f"plan must be a BaseConstrainedPlan (from solve_base_constrained), got {type(plan).__name__}"
    )
  _checks.check_rank("q", q, 4, "[B, T, N, H]")
  _checks.check_rank("k", k, 4, "[B, S, K, H]")
  _checks.check_float("q", q)
  _checks.check_float("k", k)
  num_heads, head_dim = q.shape[2], q.shape[3]
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"q and k must have the same batch size B, got {q.shape[0]} and {k.shape[0]}")
  if head_dim != plan.head_dim or k.shape[3] != head_dim:
    raise ValueError(f"q and k must have H = plan.head_dim = {plan.head_dim}, got {q.shape} and {k.shape}")
  if num_heads != plan.slopes.shape[0]:
    raise ValueError(f"q must have N = {plan.slopes.shape[0]} heads (one per slope), got {num_heads}")
  r, half = plan.pair_index, plan.rotary_dim // 2
  re, im = (2 * r, 2 * r + 1) if plan.layout == "interleaved" else (r, r + half)
  amp = jnp.asarray(-plan.amplitudes, jnp.float32)
  q_block = jnp.zeros((*q.shape[:3], plan.rotary_dim), jnp.float32)
  q_block = q_block.at[..., re].set(jnp.broadcast_to(amp[None, None, :], q.shape[:3]))
  k_block = jnp.zeros((*k.shape[:3], plan.rotary_dim), jnp.float32).at[..., im].set(1.0)
  return (
    jnp.concatenate([q_block, q.astype(jnp.float32)], axis=-1),
    jnp.concatenate([k_block, k.astype(jnp.float32)], axis=-1),
  )
