"""The emulation ops: q and k with the extra dims that carry ALiBi's bias through a dot product.

``apply_rope_alibi`` appends the 2k rotated emulation dims (order k, frequencies ``r theta``;
the construction and its error model are in ``jaxpe.emulation.bounds``), ``apply_augmented_alibi``
the two dims of the exact linear form, and ``pad_head_dim`` pads a head dim to a kernel's multiple.
Score the results with ``1/sqrt(H)`` of the *original* head dim.

Precision policy. The emulation dims are built and rotated in float32 whatever the input dtype
(phases ``position * theta`` in float32; amplitudes from the float32-rounded frequencies) and the
augmented q and k are returned in float32, so that ``jaxpe.attention.dot_product_attention`` (an
einsum with ``preferred_element_type=float32``) forms their product in float32 too: with bf16
activations only the content dims carry bf16 values (exactly representable in float32). Carrying the
emulation dims in bf16 (``out_dtype=jnp.bfloat16``, for measurement) gives errors of whole logits
at positions of a few thousand; float16 is refused when an amplitude overflows it (N_h is ~1e6).

Source: ``shared/DESIGN.md`` section 3 (RoPE: Su et al., arXiv 2104.09864; ALiBi: Press et al.,
arXiv 2108.12409); the higher-order, augmented and padded forms are jaxpe's (``docs/emulation.md``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.emulation.bounds import emulation_weights
from jaxpe.emulation.checks import (
  MAX_PAD_MULTIPLE,
  MAX_POSITION,
  check_order,
  check_real,
  check_representable,
  dtype_name,
  slopes_array,
)
from jaxpe.emulation.solver import emulation_amplitudes
from jaxpe.ops import checks as _checks
from jaxpe.ops import rope as _rope


def pad_head_dim(x: jax.Array, *, multiple: int = 8) -> jax.Array:
  """Appends zero dims so the last axis becomes a multiple of ``multiple``.

  Zero dims add nothing to ``q . k`` and zero value dims produce zero outputs that are sliced off,
  so padding q, k and v changes no result; kernels that want head dims in multiples of 8 need it.

  Args:
    x: ``[..., H]`` array (q ``[B, T, N, Hq]``, k ``[B, S, K, Hq]`` or v ``[B, S, K, H]``).
    multiple: int in 1..4096 (``MAX_PAD_MULTIPLE``; kernels use 8 or 128).

  Returns:
    ``[..., ceil(H / multiple) * multiple]`` array of ``x.dtype``.

  Raises:
    ValueError: ``multiple`` not an integer in 1..``MAX_PAD_MULTIPLE`` (4096).
    TypeError: ``x`` not a jax or numpy array of rank >= 1.
  """
  multiple = _checks.check_positive_int("multiple", multiple)
  if multiple > MAX_PAD_MULTIPLE:
    raise ValueError(
      f"multiple must be in 1..{MAX_PAD_MULTIPLE} (a kernel's head-dim multiple), got {multiple}"
    )
  if not isinstance(x, jax.Array | np.ndarray) or x.ndim == 0:
    raise TypeError(f"x must be an array of rank >= 1 ([..., H]), got {type(x).__name__} {jnp.shape(x)}")
  extra = -x.shape[-1] % multiple
  if extra == 0:
    return x
  return jnp.concatenate([x, jnp.zeros((*x.shape[:-1], extra), x.dtype)], axis=-1)


def _check_qk(q, k, q_positions, k_positions):
  _checks.check_rank("q", q, 4, "[B, T, N, H]")
  _checks.check_rank("k", k, 4, "[B, S, K, H]")
  _checks.check_float("q", q)
  _checks.check_float("k", k)
  batch, t_len, num_heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"k must have shape [B, S, K, H] = [{batch}, S, K, {head_dim}], got {k.shape}")
  if num_heads == 0 or k.shape[2] == 0:
    raise ValueError(f"q and k need at least one head (N >= 1, K >= 1), got N={num_heads}, K={k.shape[2]}")
  if num_heads % k.shape[2]:
    raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads K={k.shape[2]}")
  for name, pos, x in (("q_positions", q_positions, q), ("k_positions", k_positions, k)):
    _checks.check_rank(name, pos, 2, "[B, T]" if name[0] == "q" else "[B, S]")
    _checks.check_positions(name, pos)
    if pos.shape != x.shape[:2]:
      raise ValueError(f"{name} shape {pos.shape} must equal {name[0]}.shape[:2] = {x.shape[:2]}")
    if not isinstance(pos, jax.core.Tracer) and np.asarray(pos).size:
      if int(np.asarray(pos).max()) >= MAX_POSITION:
        raise ValueError(f"{name} must be < 2^24 (exact in float32), got max {int(np.asarray(pos).max())}")


def apply_rope_alibi(
  q: jax.Array,
  k: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  theta,
  order: int = 1,
  out_dtype=jnp.float32,
  pad_multiple: int = 1,
  content_inv_freq=None,
  content_layout: str = "interleaved",
  content_attention_factor: float = _checks.UNSET,
  content_scale: float = _checks.UNSET,
) -> tuple[jax.Array, jax.Array]:
  """Appends the 2k emulation dims to q and k and rotates them (content dims at frequency 0, or at
  ``content_inv_freq``: RoPE and emulated ALiBi in one head).

  Score with the returned arrays, scaled by ``1/sqrt(H)`` of the *original* head dim:
  ``q_aug . k_aug / sqrt(H) = q . k / sqrt(H) - (m_h / theta) sum_r w_r sin(r (i - j) theta)``.
  With ``content_inv_freq`` the content term is RoPE's score ``Re[sum_p q_p conj(k_p)
  exp(1j (i - j) f_p)] / sqrt(H)`` (the content dims rotated by ``jaxpe.ops.rope.apply_rope`` in
  float32) and the emulation dims are unchanged, so the solver's bound on the bias deviation
  (``solve_emulation(...).bound``, ``emulation_error_bound``) holds as it is; ``None`` (default) is
  the published form, bit for bit (an all-zero ``content_inv_freq`` gives the same values).
  Layout: ``[content H | pair 1 | ... | pair k | zero padding]``, each pair ``(re, im)`` (complex,
  interleaved layout); pair r of q is ``-w_r N_h (cos, sin)(r i theta)``, of k ``(-sin, cos)(r j theta)``.

  Args:
    q: ``[B, T, N, H]`` float queries (position-free content).
    k: ``[B, S, K, H]`` float keys (K kv heads; the key part of the emulation is head-independent
      when theta is shared).
    q_positions: ``[B, T]`` integer token indices of the queries, ``< 2^24``.
    k_positions: ``[B, S]`` integer token indices of the keys, ``< 2^24``.
    slopes: ``[N]`` ALiBi slopes (> 0), concrete (numpy or Python), one per query head.
    theta: base frequency in radians per token (``> 0``): a float (e.g. ``emulation_theta(...)``)
      or ``[N]`` per head (e.g. ``solve_emulation(...).theta``); rounded to float32.
    order: k, number of emulation pairs (1 = the published construction); 1..8.
    out_dtype: dtype of the returned q, k. float32 (default) is the precision policy; bfloat16
      only to measure what the policy avoids; float16 raises when an amplitude overflows it.
    pad_multiple: append zero dims so ``H + 2k`` becomes a multiple of this (8 for kernels that
      need it); 1 = no padding.
    content_inv_freq: ``[R/2]`` float radians per token (``R <= H``, e.g. a RoPE config's scaled
      ``inv_freq`` from ``jaxpe.ops.rope_scaling.rope_frequencies``): the first R content dims of q
      and k rotate at these frequencies by ``q_positions`` / ``k_positions`` (the rest stay
      position-free). Default None: content at frequency 0 (the published form).
    content_layout: pair layout of the content rotation, ``"interleaved"`` (default) or ``"half"``
      (``jaxpe.ops.layouts``); read only with ``content_inv_freq``.
    content_attention_factor: multiplies the rotated content pairs (``apply_rope``'s
      ``attention_factor``: ``RopeSpec.attention_factor``, HF's ``attention_scaling`` of
      YaRN/LongRoPE; not position interpolation, which divides ``content_inv_freq``); default 1;
      read only with ``content_inv_freq``.
    content_scale: the deprecated spelling of ``content_attention_factor`` (``DeprecationWarning``).

  Returns:
    ``(q_aug [B, T, N, Ha], k_aug [B, S, K', Ha])`` of ``out_dtype``, ``Ha = H + 2k`` rounded up to
    ``pad_multiple``; ``K' = K`` for a shared theta, N (keys repeated per group) for per-head theta.

  In your own attention: q_aug and k_aug are ``Ha - H`` dims (2k, plus padding) wider than v
  (``[B, S, K, H]``): code that reads the head dim from q to reshape v or the output (Gemma's
  grouped-query reshape, ``q.reshape(B, T, K, N // K, H)`` then ``v`` alike) must take H from v,
  and the softmax scale stays ``1 / sqrt(H)`` of the original head dim. The 2k emulation dims hold
  values of ~1e5-1e6 whose products cancel down to the ALiBi bias: contract them in float32 at
  ``precision=jax.lax.Precision.HIGHEST`` (on GPUs the default float32 matmul is TF32, on TPUs one
  bfloat16 pass, which costs whole logits); ``jaxpe.dot_product_attention`` / ``kernels.attention``
  do that for the last ``precise_dims`` dims (default: the dims beyond v's width), e.g.
  ``jnp.einsum("btnh,bsnh->bnts", q_aug, k_aug, precision="highest")`` in a hand-written one.

  Raises:
    ValueError: wrong ranks or sizes, slope count != N, bad theta/order/slopes/positions, an
      amplitude that overflows ``out_dtype``; ``content_inv_freq`` with more than H/2 entries, not
      finite, or a bad ``content_layout`` / ``content_attention_factor`` (``apply_rope``'s checks).

  Source: the content rotation is RoPE (Su et al., arXiv 2104.09864) on the emulation's content dims;
  the combination is jaxpe's (docs/emulation.md, "RoPE and emulated ALiBi in one head").
    TypeError: non-float q/k, non-integer positions, non-numeric slopes (or theta). Traced slopes or
      theta: ValueError.
  """
  content_attention_factor = _checks.renamed_attention_factor(
    "apply_rope_alibi",
    "content_scale",
    "content_attention_factor",
    content_scale,
    content_attention_factor,
    1.0,
  )
  _check_qk(q, k, q_positions, k_positions)
  num_heads, head_dim = q.shape[2], q.shape[3]
  out_name = dtype_name(out_dtype)
  order = check_order(order)
  weights = emulation_weights(order)
  for name, value in (("slopes", slopes), ("theta", theta)):
    if isinstance(value, jax.core.Tracer):
      raise ValueError(_checks.traced_message(name))
  slopes = slopes_array(slopes)
  _checks.check_slopes("slopes", slopes)
  if slopes.shape[0] != num_heads:
    raise ValueError(f"slopes must have one entry per head (N = {num_heads}), got {slopes.shape[0]}")
  if np.ndim(theta) == 0:
    check_real("theta", theta)
  theta = np.asarray(theta, np.float64)
  if not any(isinstance(p, jax.core.Tracer) for p in (q_positions, k_positions)):
    # sin(d theta) must stay monotonic: the largest base phase theta * |i - j| below pi/2.
    qp_np, kp_np = np.asarray(q_positions, np.int64), np.asarray(k_positions, np.int64)
    if qp_np.size and kp_np.size:
      span = max(qp_np.max() - kp_np.min(), kp_np.max() - qp_np.min())
      if span * float(np.max(theta)) >= math.pi / 2:
        raise ValueError(
          f"theta too large for these positions: theta * max|i - j| = {span * float(np.max(theta)):.3g} "
          ">= pi/2 rad; use a smaller theta (solve_emulation / emulation_theta with the real context)"
        )
  theta32 = np.asarray(theta.astype(np.float32), np.float64)  # the frequency the phases will use
  amplitudes = emulation_amplitudes(slopes, head_dim=head_dim, theta=theta32)  # validates theta
  check_representable(amplitudes, weights, out_name, "use a larger theta (max_phase)")
  shared = theta.ndim == 0 or bool(np.all(theta == theta.reshape(-1)[0]))
  # Pair r of head h rotates at r theta_h; float32 like every RoPE phase.
  freqs = np.broadcast_to(theta32, (num_heads,))[:, None] * np.arange(1, order + 1)[None, :]  # [N, k]
  if shared:
    freqs = freqs[:1]
  freqs = jnp.asarray(freqs, jnp.float32)  # [N or 1, k]
  amp = jnp.asarray(-amplitudes[:, None] * weights[None, :], jnp.float32)  # [N, k]

  def phases(pos):  # [B, T] -> [B, T, N or 1, k] radians, float32
    return pos.astype(jnp.float32)[:, :, None, None] * freqs[None, None, :, :]

  q_cont, k_cont = q.astype(jnp.float32), k.astype(jnp.float32)
  if content_inv_freq is not None:  # RoPE on the content dims, in float32
    kw = dict(inv_freq=content_inv_freq, layout=content_layout, attention_factor=content_attention_factor)
    q_cont = _rope.apply_rope(q_cont, q_positions, **kw)
    k_cont = _rope.apply_rope(k_cont, k_positions, **kw)
  qp, kp = phases(q_positions), phases(k_positions)
  q_pairs = jnp.stack([amp[None, None] * jnp.cos(qp), amp[None, None] * jnp.sin(qp)], axis=-1)
  q_pairs = jnp.broadcast_to(q_pairs, (*q.shape[:2], num_heads, order, 2))
  k_pairs = jnp.stack([-jnp.sin(kp), jnp.cos(kp)], axis=-1)  # [B, S, N or 1, k, 2]
  if not shared and k.shape[2] != num_heads:
    k_cont = jnp.repeat(k_cont, num_heads // k.shape[2], axis=2)
  k_pairs = jnp.broadcast_to(k_pairs, (*k_cont.shape[:3], order, 2))
  return _append_dims(
    q_cont,
    k_cont,
    q_pairs.reshape(*q.shape[:3], 2 * order),
    k_pairs.reshape(*k_cont.shape[:3], 2 * order),
    out_dtype=out_dtype,
    pad_multiple=pad_multiple,
  )


def _append_dims(q, k, q_extra, k_extra, *, out_dtype, pad_multiple):
  """``[q | q_extra]``, ``[k | k_extra]`` in ``out_dtype``, zero-padded to ``pad_multiple`` dims."""
  if not _checks.is_int(pad_multiple) or not 1 <= pad_multiple <= MAX_PAD_MULTIPLE:
    raise ValueError(f"pad_multiple must be an int in 1..{MAX_PAD_MULTIPLE}, got {pad_multiple!r}")
  q_aug = jnp.concatenate([q.astype(jnp.float32), q_extra], axis=-1)
  k_aug = jnp.concatenate([k.astype(jnp.float32), k_extra], axis=-1)
  return (
    pad_head_dim(q_aug.astype(out_dtype), multiple=pad_multiple),
    pad_head_dim(k_aug.astype(out_dtype), multiple=pad_multiple),
  )


def apply_augmented_alibi(
  q: jax.Array,
  k: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  out_dtype=jnp.float32,
  pad_multiple: int = 1,
) -> tuple[jax.Array, jax.Array]:
  """Exact ALiBi for bias-free kernels: two extra dims carrying positions linearly.

  ``q_aug = [q, m_h sqrt(H) (-i, 1)]``, ``k_aug = [k, (1, j)]``, so
  ``q_aug . k_aug / sqrt(H) = q . k / sqrt(H) - m_h (i - j)`` with no truncation error. The extra
  products have size ``m sqrt(H) i``: the rounding error grows with the absolute position exactly
  as for the rotated form (``ROUNDING_CONSTANT u m (i + j + d)``); float32 is the policy.

  Args:
    q: ``[B, T, N, H]`` float queries.
    k: ``[B, S, K, H]`` float keys.
    q_positions: ``[B, T]`` integer token indices, ``< 2^24``.
    k_positions: ``[B, S]`` integer token indices, ``< 2^24``.
    slopes: ``[N]`` ALiBi slopes (> 0), concrete.
    out_dtype: dtype of the results (float32 = the policy; bfloat16/float16 for measurement).
    pad_multiple: pad ``H + 2`` with zero dims to a multiple of this; 1 = no padding.

  Returns:
    ``(q_aug [B, T, N, Ha], k_aug [B, S, K, Ha])`` of ``out_dtype``, ``Ha = H + 2`` rounded up.

  Raises:
    ValueError: wrong ranks or sizes, slope count != N, bad slopes or positions.
    TypeError: non-float q/k, non-integer positions, non-numeric slopes (or theta). Traced slopes or
      theta: ValueError.

  Source: the linear-position form of ALiBi's bias (Press et al., arXiv 2108.12409), written as a
  dot product.
  """
  _check_qk(q, k, q_positions, k_positions)
  num_heads, head_dim = q.shape[2], q.shape[3]
  dtype_name(out_dtype)
  slopes = slopes_array(slopes)
  _checks.check_slopes("slopes", slopes)
  if slopes.shape[0] != num_heads:
    raise ValueError(f"slopes must have one entry per head (N = {num_heads}), got {slopes.shape[0]}")
  scale = jnp.asarray(slopes * math.sqrt(head_dim), jnp.float32)  # [N]
  i = q_positions.astype(jnp.float32)[:, :, None]  # [B, T, 1]
  j = k_positions.astype(jnp.float32)[:, :, None, None]  # [B, S, 1, 1]
  q_extra = jnp.stack(
    [-scale[None, None, :] * i, jnp.broadcast_to(scale[None, None, :], i.shape[:2] + scale.shape)], -1
  )
  k_extra = jnp.concatenate([jnp.ones_like(j), j], axis=-1)  # [B, S, 1, 2]
  k_extra = jnp.broadcast_to(k_extra, (*k.shape[:3], 2))
  return _append_dims(q, k, q_extra, k_extra, out_dtype=out_dtype, pad_multiple=pad_multiple)
