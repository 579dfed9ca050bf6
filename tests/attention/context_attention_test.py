"""Context parallelism at the attention level (8 fake CPU devices): the zig-zag order against its
closed form, and attention split over the ``context`` axis (all-gather and ring, with data
parallelism beside it) against the dense reference on one device, forward and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import context, reference
from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.masks import IndexMask, dense_attention_mask
from jaxpe.ops import alibi
from jaxpe.train import sharding


def test_zigzag_order_closed_form_and_round_trip():
  # T 8 over 2 shards: chunks of 2 slots; shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2.
  np.testing.assert_array_equal(context.zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(context.zigzag_order(6, 1), np.arange(6))
  for length, shards in [(16, 2), (16, 4), (16, 8), (24, 3)]:
    order = context.zigzag_order(length, shards)
    assert sorted(order.tolist()) == list(range(length))  # a permutation
    chunk = length // (2 * shards)
    for i in range(shards):  # shard i: chunks i and 2C-1-i
      got = order[i * 2 * chunk : (i + 1) * 2 * chunk]
      want = list(range(i * chunk, (i + 1) * chunk)) + list(
        range((2 * shards - 1 - i) * chunk, (2 * shards - i) * chunk)
      )
      np.testing.assert_array_equal(got, want)
    # Load balance: every shard's queries see the same number of causal keys.
    work = [int(np.sum(order[i * 2 * chunk : (i + 1) * 2 * chunk] + 1)) for i in range(shards)]
    assert len(set(work)) == 1, work
    x = np.random.default_rng(0).normal(size=(2, length, 3))
    for arr in (x, jnp.asarray(x, jnp.float32)):
      there = context.to_zigzag(arr, shards)
      assert isinstance(there, type(arr))
      np.testing.assert_array_equal(np.asarray(there)[0, :, 0], np.asarray(arr)[0, order, 0])
      np.testing.assert_array_equal(np.asarray(context.from_zigzag(there, shards)), np.asarray(arr))
  np.testing.assert_array_equal(
    context.from_zigzag(np.arange(8)[None], 2)[0], context.zigzag_order(8, 2).argsort()
  )
  with pytest.raises(ValueError, match=r"T \(12\) must be divisible by 2 x shards = 16"):
    context.zigzag_order(12, 8)
  with pytest.raises(ValueError, match="shards"):
    context.zigzag_order(8, 0)


B, T, N, K, H, EXTRA = 2, 16, 4, 2, 8, 2
SHARDS = 4


def _inputs():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, N, H + EXTRA)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, T, K, H + EXTRA)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
  valid = np.ones((B, T), bool)
  valid[0, :3] = False  # left padding: those queries see no key
  segments = np.zeros((B, T), np.int32)
  segments[1, 6:], segments[1, 11:] = 1, 2  # three packed documents
  positions = np.where(segments == 0, np.arange(T), np.arange(T) - np.where(segments == 1, 6, 11))
  return q, k, v, jnp.asarray(valid), jnp.asarray(segments), jnp.asarray(positions.astype(np.int32))


SLOPES = np.asarray(alibi.alibi_slopes_f64(N))


def _dense(q, k, v, valid, segments, positions):
  """One device: the dense reference with the dense mask and the native ALiBi bias, slot order."""
  slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = dense_attention_mask(slots, slots, k_valid=valid, q_segment_ids=segments, k_segment_ids=segments)
  bias = alibi.alibi_bias(jnp.asarray(SLOPES, jnp.float32), positions, positions)
  return reference.dot_product_attention(q, k, v, scale=0.3, bias=bias, mask=mask, precise_dims=EXTRA)


@functools.cache
def _reference():
  """The one-device output and gradients of ``sum(out * weights)`` (computed once)."""
  q, k, v, valid, segments, positions = _inputs()
  weights = _weights()

  def loss(q, k, v):
    return jnp.sum(_dense(q, k, v, valid, segments, positions) * weights)

  return jax.jit(
    lambda q, k, v: (_dense(q, k, v, valid, segments, positions), jax.grad(loss, (0, 1, 2))(q, k, v))
  )(q, k, v)


def _weights():
  return jnp.asarray(np.random.default_rng(1).normal(size=(B, T, N, H)), jnp.float32)


@pytest.mark.parametrize("strategy", context.STRATEGIES)
def test_context_attention_equals_one_device(strategy):
  """Zig-zag ordered q, k, v, slots, validity, segments and positions on (data 2, context 4)
  give the one-device result (values and gradients of q, k, v) within 1e-5."""
  q, k, v, valid, segments, positions = _inputs()
  mesh = sharding.make_mesh((2, 1, 1, SHARDS))
  weights = _weights()

  def split(q, k, v):
    z = lambda x: context.to_zigzag(x, SHARDS)  # noqa: E731
    slots = z(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    out = context.context_attention(
      z(q),
      z(k),
      z(v),
      scale=0.3,
      mesh=mesh,
      strategy=strategy,
      mask=IndexMask(slots, slots, True, z(valid), z(segments), z(segments)),
      alibi=AlibiSpec(SLOPES, z(positions), z(positions), max_position=65536),
      precise_dims=EXTRA,
    )
    return context.from_zigzag(out, SHARDS)

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

  ref, ref_grads = _reference()
  out, grads = jax.jit(lambda q, k, v: (split(q, k, v), jax.grad(loss(split), (0, 1, 2))(q, k, v)))(q, k, v)
  print(f"{strategy}: max |out diff| {float(jnp.max(jnp.abs(out - ref))):.2e}")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=1e-5)
  assert float(jnp.max(jnp.abs(ref[0, :3]))) == 0.0  # rows with no visible key are zeros
  for got, want in zip(grads, ref_grads):
    print(f"  max |grad diff| {float(jnp.max(jnp.abs(got - want))):.2e}")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_context_attention_refuses_bad_arguments():
  q, k, v, *_ = _inputs()
  mesh = sharding.make_mesh((1, 1, 1, 8))
  with pytest.raises(ValueError, match="strategy must be one of"):
    context.context_attention(q, k, v, scale=0.3, mesh=mesh, strategy="tree")
  with pytest.raises(ValueError, match="axes must name mesh axes"):
    context.context_attention(q, k, v, scale=0.3, mesh=mesh, axes="sequence")
  with pytest.raises(ValueError, match=r"T \(12\) and S \(12\) must be divisible by the 8 shards"):
    context.context_attention(q[:, :12], k[:, :12], v[:, :12], scale=0.3, mesh=mesh)
  with pytest.raises(TypeError, match="mask must be an IndexMask"):
    context.context_attention(q, k, v, scale=0.3, mesh=mesh, mask=jnp.ones((B, 1, T, T), bool))
  slots = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (B, 8))  # distinct slots, the wrong length
  with pytest.raises(ValueError, match=r"q_index must have shape \[B, T\]"):
    context.context_attention(q, k, v, scale=0.3, mesh=mesh, mask=IndexMask(slots, slots))
