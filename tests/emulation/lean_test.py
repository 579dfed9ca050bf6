"""The lean ALiBi emulation (jaxpe.emulation.lean): exact products, ALiBi up to a per-row constant,
and its precision under the hardware rounding model at 2k, 8k and 64k positions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.emulation import bf16_exact, bounds, lean
from jaxpe.ops import alibi


def _alibi64(slopes, qpos, kpos):
  """Float64 ALiBi bias ``-m (i - j)`` from the paper's formula: ``[T, S, N]``."""
  return -np.asarray(slopes)[None, None, :] * (qpos[:, None, None] - kpos[None, :, None])


@pytest.mark.parametrize(
  "max_position,digits", [(2, 1), (257, 1), (258, 2), (65536, 2), (65537, 2), (65538, 3)]
)
def test_digit_count_covers_half_the_window(max_position, digits):
  assert lean.lean_digit_count(max_position) == digits
  assert 128 * 256 ** (digits - 1) >= max_position // 2


def test_slope_parts_one_for_powers_of_two_three_otherwise():
  assert lean.lean_slope_parts([0.5, 0.25, 0.0], 1 / 8).shape == (1, 3)  # c = 4, 2, 0
  parts = lean.lean_slope_parts(alibi.alibi_slopes_f64(16), 1 / 8)
  assert parts.shape[0] == 3
  np.testing.assert_array_equal(parts.astype(jnp.bfloat16).astype(np.float64), parts)
  np.testing.assert_allclose(parts.sum(0), alibi.alibi_slopes_f64(16) * 8, rtol=2**-25)


@pytest.mark.parametrize("slopes", [[0.5, 0.25, 0.125, 0.0], alibi.alibi_slopes_f64(12)[:4] * [1, 1, 1, 0]])
def test_lean_dims_are_alibi_up_to_a_row_constant_with_exact_products(slopes):
  # Positions of two rows (different spans), 2 kv heads; products exact in float32, sum equals
  # m (j - j0) exactly up to the slope split, so softmax rows equal ALiBi's.
  slopes = np.asarray(slopes, np.float64)
  rng = np.random.default_rng(0)
  kp = np.stack([np.sort(rng.choice(60000, 50, replace=False)), np.arange(50) + 7])
  qp = kp[:, ::5]
  q_e, k_e = jax.jit(
    lambda a, b: lean.lean_alibi_dims(
      a, b, slopes=slopes, dot_scale=1 / 8, max_position=65536, num_kv_heads=2
    )
  )(jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32))
  parts = 1 if np.all(np.log2(slopes[slopes > 0] * 8) % 1 == 0) else 3
  assert q_e.shape == (2, 10, 4, 2 * parts) and k_e.shape == (2, 50, 2, 2 * parts)
  np.testing.assert_array_equal(np.asarray(k_e[:, :, 0]), np.asarray(k_e[:, :, 1]))
  q64, k64 = np.asarray(q_e, np.float64), np.asarray(k_e[:, :, 0], np.float64)
  for x in (q64, k64):
    np.testing.assert_array_equal(x.astype(jnp.bfloat16).astype(np.float64), x)
  prods = q64[:, :, None, :, :] * k64[:, None, :, None, :]  # [B, T, S, N, E]
  np.testing.assert_array_equal(prods.astype(np.float32).astype(np.float64), prods)
  for b in range(2):
    got = prods[b].sum(-1) / 8
    j0 = (kp[b].min() + kp[b].max()) // 2
    row_constant = -slopes[None, None, :] * (qp[b][:, None, None] - j0)
    np.testing.assert_allclose(got, _alibi64(slopes, qp[b], kp[b]) - row_constant, rtol=2**-24, atol=1e-9)


def test_magnitude_bound_holds_and_is_reached():
  slopes = alibi.alibi_slopes_f64(16)
  kp = jnp.arange(0, 65536, 97, dtype=jnp.int32)[None]
  q_e, k_e = lean.lean_alibi_dims(
    kp[:, :1], kp, slopes=slopes, dot_scale=1 / 8, max_position=65536, num_kv_heads=1
  )
  got = np.abs(
    np.einsum("ne,se->sn", np.asarray(q_e[0, 0], np.float64), np.asarray(k_e[0, :, 0], np.float64))
  )
  span = int(kp.max() - kp.min()) + 1
  bound = bounds.lean_alibi_magnitude(slopes, dot_scale=1 / 8, span=span)
  assert np.all(got.max(0) <= bound * (1 + 2**-20)) and np.all(got.max(0) >= 0.99 * bound)


# ------------------------------------------------------------------ precision under a hardware model


def _positions(ctx):
  q = np.array([ctx // 2, ctx - 1])
  k = np.unique(
    np.concatenate(
      [np.arange(0, ctx, ctx // 256), np.arange(ctx - 32, ctx), np.arange(ctx // 2 - 32, ctx // 2)]
    )
  )
  return q, k


def _deviation(form, ctx, fmt, content):
  """``[N]`` max |emulated bias - float64 ALiBi| (logits; lean modulo its row constant) over sampled
  ``j <= i``, 16 heads, H 64; ``content``: 64 N(0, 1) dims summed first (the kernels' order)."""
  slopes = alibi.alibi_slopes_f64(16)
  qpos, kpos = _positions(ctx)
  q, k = bf16_exact.alibi_term_dims(form, qpos, kpos, slopes=slopes, head_dim=64, max_len=ctx)
  ref = _alibi64(slopes, qpos, kpos)
  if form == "lean":  # compare modulo the per-row constant m (i - j0)
    ref = ref + slopes[None, None, :] * (qpos[:, None, None] - (kpos.min() + kpos.max()) // 2)
  base = 0.0
  if content:
    rng = np.random.default_rng(1)
    qc, kc = rng.normal(size=(len(qpos), 16, 64)), rng.normal(size=(len(kpos), 64))
    q, k = np.concatenate([qc, q], -1), np.concatenate([kc, k], -1)
    base = np.einsum("tnh,sh->tsn", bf16_exact.round_mantissa(qc, fmt), bf16_exact.round_mantissa(kc, fmt))
  scores = (bf16_exact.float32_accumulated_dot(q, k, fmt).astype(np.float64) - base) / 8.0
  visible = (kpos[None, :] <= qpos[:, None])[:, :, None]
  return np.where(visible, np.abs(scores - ref), 0.0).max(axis=(0, 1))


@pytest.mark.parametrize("ctx", (2048, 8192, 65536))
def test_lean_form_meets_the_goal_and_is_no_worse_than_exact(ctx):
  # bf16 and TF32 inputs, products rounded to float32, float32 accumulation in dim order: the lean
  # form within 1e-2 logits of float64 ALiBi, alone and after 64 content dims, and no worse than
  # the exact form (its worst head against the exact form's worst head).
  for fmt in ("bfloat16", "tf32"):
    for content in (False, True):
      lean_dev = _deviation("lean", ctx, fmt, content)
      exact_dev = _deviation("exact", ctx, fmt, content)
      assert lean_dev.max() <= 1e-2, (ctx, fmt, content, lean_dev.max())
      assert lean_dev.max() <= exact_dev.max(), (ctx, fmt, content, lean_dev.max(), exact_dev.max())
  assert math.isfinite(float(lean_dev.max()))


def test_three_digits_reach_the_largest_positions_exactly():
  # Positions up to 2^24 - 1 (three digits, top digit 128): m (j - j0) still exact up to the slope split.
  kp = np.array([[0, 1, 2**23, 2**24 - 2, 2**24 - 1]])
  q_e, k_e = lean.lean_alibi_dims(
    jnp.asarray(kp[:, :1], jnp.int32),
    jnp.asarray(kp, jnp.int32),
    slopes=[0.5],
    dot_scale=1.0,
    max_position=2**24,
    num_kv_heads=1,
  )
  assert k_e.shape[-1] == 3
  k64 = np.asarray(k_e[0, :, 0], np.float64)
  np.testing.assert_array_equal(k64.astype(jnp.bfloat16).astype(np.float64), k64)
  np.testing.assert_array_equal(k64.sum(-1), kp[0] - (2**24 - 1) // 2)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(slopes=[-0.5]), "slopes"),
    (dict(slopes=[np.nan]), "slopes"),
    (dict(dot_scale=0.0), "dot_scale"),
    (dict(max_position=0), "max_position"),
    (dict(max_position=2**24 + 1), "max_position"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(max_position=4), "positions must be in"),  # concrete positions >= max_position
  ],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
  args = dict(slopes=[0.5], dot_scale=1.0, max_position=8, num_kv_heads=1) | kwargs
  pos = jnp.arange(6, dtype=jnp.int32)[None]
  with pytest.raises(ValueError, match=match):
    lean.lean_alibi_dims(pos, pos, **args)
  with pytest.raises(TypeError):
    lean.lean_alibi_dims(
      pos, pos.astype(jnp.float32), slopes=[0.5], dot_scale=1.0, max_position=8, num_kv_heads=1
    )
