"""Context parallelism with a learned ``PositionBias`` (Kerple log; 8 fake CPU devices, context 4):
zig-zag ordered tokens and positions on both strategies give the one-device dense reference's
output and gradients in q, k, v and the bias parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import PositionBias, context, reference
from jaxpe.attention.masks import IndexMask, dense_attention_mask
from jaxpe.ops import relative_bias
from jaxpe.train import sharding

B, T, N, K, H, SHARDS = 2, 16, 4, 2, 8, 4


def _kerple(params, q_pos, k_pos):
  return relative_bias.kerple_log_bias(params["r1"], params["r2"], q_pos, k_pos)


def _inputs():
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
  params = {
    "r1": jnp.asarray(rng.uniform(0.2, 2, N), jnp.float32),
    "r2": jnp.asarray(rng.uniform(0.2, 1, N), jnp.float32),
  }
  segments = np.zeros((B, T), np.int32)
  segments[1, 7:] = 1  # two packed documents, positions restarting
  positions = np.where(segments == 0, np.arange(T), np.arange(T) - 7).astype(np.int32)
  weights = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  return q, k, v, params, jnp.asarray(segments), jnp.asarray(positions), weights


@pytest.mark.parametrize("strategy", context.STRATEGIES)
def test_context_attention_with_a_position_bias_equals_one_device(strategy):
  q, k, v, params, segments, positions, weights = _inputs()
  mesh = sharding.make_mesh((2, 1, 1, SHARDS))
  slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

  def dense(q, k, v, params):
    mask = dense_attention_mask(slots, slots, q_segment_ids=segments, k_segment_ids=segments)
    bias = _kerple(params, positions, positions)
    return reference.dot_product_attention(q, k, v, scale=0.3, bias=bias, mask=mask)

  def split(q, k, v, params):
    z = lambda x: context.to_zigzag(x, SHARDS)  # noqa: E731
    out = context.context_attention(
      z(q),
      z(k),
      z(v),
      scale=0.3,
      mesh=mesh,
      strategy=strategy,
      mask=IndexMask(z(slots), z(slots), True, None, z(segments), z(segments)),
      position_bias=PositionBias(_kerple, params, z(positions), z(positions)),
    )
    return context.from_zigzag(out, SHARDS)

  def both(fn):
    return jax.jit(lambda *a: (fn(*a), jax.grad(lambda *a: jnp.sum(fn(*a) * weights), (0, 1, 2, 3))(*a)))

  ref, ref_grads = both(dense)(q, k, v, params)
  out, grads = both(split)(q, k, v, params)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=1e-5)
  for got, want in zip(grads[:3], ref_grads[:3]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
  for name in params:
    want = np.asarray(ref_grads[3][name])
    assert np.abs(want).max() > 1e-2
    np.testing.assert_allclose(np.asarray(grads[3][name]), want, rtol=1e-5, atol=1e-5, err_msg=name)
