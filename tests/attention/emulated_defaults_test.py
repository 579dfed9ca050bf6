"""``emulated_alibi_attention`` with its defaults (no theta, order 1): valid, and close to native
ALiBi attention computed in numpy float64, at short and long contexts, eager and under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.emulation import solver


def _alibi_attention_f64(q, k, v, slopes, positions):
  """float64 causal ``softmax(q.k / sqrt(H) - m (i - j)) v``; q, k, v ``[B, T, N, H]``."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  pos = np.asarray(positions, np.float64)
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  s = s - np.asarray(slopes, np.float64)[None, :, None, None] * (
    pos[:, None, :, None] - pos[:, None, None, :]
  )
  s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("t_len", [10, 2048])
def test_defaults_are_valid_and_within_1e4_of_alibi(t_len):
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (1, t_len, 4, 16)) for kk in keys)
  positions = jnp.arange(t_len, dtype=jnp.int32)[None]
  slopes = np.asarray(jaxpe.alibi_slopes(4), np.float64)
  ref = _alibi_attention_f64(q, k, v, slopes, positions)
  out = jaxpe.emulated_alibi_attention(q, k, v, positions, positions, slopes=slopes, is_causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-4)
  jitted = jax.jit(
    lambda q, k, v, p: jaxpe.emulated_alibi_attention(q, k, v, p, p, slopes=slopes, is_causal=True)
  )(q, k, v, positions)
  np.testing.assert_allclose(jitted, ref, atol=1e-4)


def test_default_theta_is_the_planned_one_and_beats_the_published_rule_at_length():
  slopes = np.asarray(jaxpe.alibi_slopes(4), np.float64)
  theta = solver.default_theta(slopes, head_dim=16, max_len=2048)
  plan = solver.solve_emulation(slopes, head_dim=16, max_len=2048, max_phase=0.1)
  # the published rule's truncation dominates at 2048 tokens; the default balances it with rounding
  assert plan.truncation_bound.max() > 100 * plan.rounding_bound.max()
  balanced = solver.solve_emulation(
    slopes, head_dim=16, max_len=2048, target_error=1.5 * plan.rounding_bound.max()
  )
  assert theta == float(balanced.theta[0])
  assert balanced.bound.max() < 4e-4 < plan.bound.max()
