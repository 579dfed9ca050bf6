"""RoPE-emulated ALiBi on a standard RoPE engine's frequency table (jaxpe.emulation.base_constrained).

References are independent of the code under test: exact ALiBi ``-m (i - j)`` in numpy float64 and
``jaxpe.ops.rope.apply_rope`` as the "engine".
"""

import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe import emulation
from jaxpe.ops import rope


def paper_slopes(n):
  """ALiBi slopes for a power-of-two head count, 2^(-8h/n), written out."""
  return np.asarray([2.0 ** (-8.0 * h / n) for h in range(1, n + 1)])


def scores(qa, ka, head_dim):
  """float32 ``q.k / sqrt(H)`` as the attention path computes it: ``[B, N, T, S]`` float64 copy."""
  if ka.shape[2] != qa.shape[2]:
    ka = jnp.repeat(ka, qa.shape[2] // ka.shape[2], axis=2)
  out = jnp.einsum("BTNH,BSNH->BNTS", qa, ka, preferred_element_type=jnp.float32)
  return np.asarray(out * jnp.float32(1.0 / math.sqrt(head_dim)), np.float64)


def normal(seed, shape):
  """Standard-normal float32 test data from numpy's generator (a jax.random draw compiles once per
  shape: 1-3 s of CPU each)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def alibi_reference(slopes, qpos, kpos):
  """Exact ALiBi ``-m (i - j)`` in float64, ``[B, N, T, S]``, and the distances ``[B, 1, T, S]``."""
  d = np.asarray(qpos, np.float64)[:, None, :, None] - np.asarray(kpos, np.float64)[:, None, None, :]
  return -np.asarray(slopes, np.float64)[None, :, None, None] * d, d


def sample_queries(length, count):
  return np.unique(np.concatenate([np.linspace(0, length - 1, count).astype(np.int64), [length - 1]]))


# ---------------------------------------------------------------- base-constrained mode


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_base_constrained_base_10000_achieves_its_prediction(layout):
  slopes, h, rotary, length = paper_slopes(4), 16, 32, 1024
  plan = emulation.solve_base_constrained(
    slopes,
    head_dim=h,
    rotary_dim=rotary,
    base=10000.0,
    max_len=length,
    max_phase=0.1,
    target_error=0.05,
    layout=layout,
  )
  lowest = 10000.0 ** (-(rotary - 2) / rotary)
  assert plan.pair_index == rotary // 2 - 1  # every frequency is above the wanted 1e-4
  np.testing.assert_allclose(plan.theta, lowest, rtol=1e-6)

  qpos = sample_queries(length, 4)
  kpos = np.arange(length)
  q = normal(7, (1, len(qpos), 4, h))
  k = normal(8, (1, length, 4, h))
  qe, ke = emulation.base_constrained_qk(q, k, plan=plan)
  chex.assert_shape((qe, ke), [(1, len(qpos), 4, rotary + h), (1, length, 4, rotary + h)])
  # the engine: standard partial-rotary RoPE with base 10000 over the first `rotary` dims
  inv_freq = rope.rope_inv_freq(rotary + h, base=10000.0, rotary_dim=rotary)
  qp, kp = jnp.asarray(qpos[None], jnp.int32), jnp.asarray(kpos[None], jnp.int32)
  qr = rope.apply_rope(qe, qp, inv_freq=inv_freq, layout=layout)
  kr = rope.apply_rope(ke, kp, inv_freq=inv_freq, layout=layout)
  np.testing.assert_array_equal(qr[..., rotary:], q)  # content dims do not rotate
  content = np.einsum("BTNH,BSNH->BNTS", np.asarray(q, np.float64), np.asarray(k, np.float64)) / math.sqrt(h)
  ref, d = alibi_reference(slopes, qpos[None], kpos[None])
  dev = np.where(d >= 0, np.abs(scores(qr, kr, h) - content - ref), 0)[0].max(axis=(1, 2))
  content_rounding = 1e-5
  assert np.all(dev <= plan.bound + content_rounding)
  assert np.all(dev >= 0.95 * plan.truncation_bound)  # achieved, not just bounded
  # reported longest context for 0.05 logits: the bound there is within the target, not beyond
  assert plan.max_context < length
  ctx = plan.max_context
  x = plan.theta * (ctx - 1)
  assert slopes[0] / plan.theta * (x - math.sin(x)) <= 0.05  # head 0 has the largest slope
  x = plan.theta * (int(ctx * 1.05) - 1)
  assert slopes[0] / plan.theta * (x - math.sin(x)) > 0.05  # and 5% more context would miss it
  # the base it asks for does reach the context
  again = emulation.solve_base_constrained(
    slopes,
    head_dim=h,
    rotary_dim=rotary,
    base=plan.base_needed * 1.0001,
    max_len=length,
    max_phase=0.1,
    target_error=0.05,
    layout="interleaved",
  )
  assert again.max_context >= length and again.base_needed is None


def test_base_constrained_picks_the_largest_frequency_below_the_wanted_one():
  wanted = 0.1 / 64
  for base, length in [(1e6, 64), (10.0, 8)]:
    plan = emulation.solve_base_constrained(
      num_heads=2, head_dim=8, rotary_dim=16, base=base, max_len=length, max_phase=0.1, layout="interleaved"
    )
    freqs = base ** (-np.arange(0, 16, 2) / 16)
    wanted = 0.1 / length
    below = [f for f in freqs if f <= wanted]
    want = max(below) if below else freqs.min()  # base 10: all above, take the lowest
    np.testing.assert_allclose(plan.theta, want, rtol=1e-6)
    assert (base == 10.0) == (not below)
