"""dot_product_attention's blocked causal path and hand-written backward pass against independent
references: a float64 numpy forward and the autodiff gradient of a textbook einsum + softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import blockwise, kernels, masks
from jaxpe.attention import reference as attention
from jaxpe.ops import alibi


def _rand(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _numpy_attention(q, k, v, scale, bias, mask):
  """float64 textbook attention; rows with no visible key give zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  visible = np.broadcast_to(np.asarray(mask), logits.shape) & np.isfinite(logits)
  logits = np.where(visible, logits, -np.inf)
  top = np.where(visible.any(-1, keepdims=True), logits.max(-1, keepdims=True), 0.0)
  w = np.where(visible, np.exp(logits - top), 0.0)
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bnts,bsnh->btnh", w, v)


def _textbook(q, k, v, scale, bias, mask):
  """float32 einsum + softmax whose gradient jax derives (the reference for the custom backward)."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  hp = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hp) * scale
  if bias is not None:
    logits = logits + bias
  visible = jnp.broadcast_to(mask, logits.shape)
  w = jax.nn.softmax(jnp.where(visible, logits, -1e30), axis=-1)
  w = jnp.where(visible.any(-1, keepdims=True), w, 0.0)
  return jnp.einsum("bnts,bsnh->btnh", w, v, precision=hp)


def _mask(kind, batch, t_len):
  if kind == "causal":
    return masks.AttentionMask(causal=True)
  if kind == "left_padding":  # the first query rows see no key at all
    valid = jnp.arange(t_len)[None, :] >= jnp.asarray([[0], [3]])[:batch]
    return masks.AttentionMask(valid=valid, causal=True)
  segments = jnp.asarray(np.repeat([[0, 1, 2]], batch, axis=0).repeat(-(-t_len // 3), axis=1)[:, :t_len])
  return masks.AttentionMask(segment_ids=segments, causal=True)


@pytest.mark.parametrize(
  "t_len, block, kind", [(1, 4, "causal"), (11, 4, "left_padding"), (11, 4, "packed"), (7, 3, "causal")]
)
def test_causal_blocks_match_the_dense_path_and_float64(t_len, block, kind):
  b, n, kv, h = 2, 4, 2, 8
  q, k, v = _rand(1, (b, t_len, n, h)), _rand(2, (b, t_len, kv, h)), _rand(3, (b, t_len, kv, h))
  mask = _mask(kind, b, t_len).dense(b, t_len)
  idx = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (b, t_len))
  bias = alibi.alibi_bias(alibi.alibi_slopes(n), idx, idx)
  scale = h**-0.5

  def run(q, k, v, bias, block):
    return attention.dot_product_attention(q, k, v, scale=scale, bias=bias, mask=mask, causal_block=block)

  for with_bias in (None, bias):
    expected = _numpy_attention(q, k, v, scale, with_bias, mask)
    dense = jax.jit(run, static_argnums=4)(q, k, v, with_bias, None)
    blocked = jax.jit(run, static_argnums=4)(q, k, v, with_bias, block)
    np.testing.assert_allclose(dense, expected, atol=2e-6)
    np.testing.assert_allclose(blocked, expected, atol=2e-6)

  # gradients (q, k, v and the bias) against autodiff of the textbook formula
  cot = _rand(4, (b, t_len, n, h))

  def grads(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3)))(q, k, v, bias)

  want = grads(lambda q, k, v, bias: _textbook(q, k, v, scale, bias, mask))
  for got in (grads(lambda *a: run(*a, None)), grads(lambda *a: run(*a, block))):
    for g, w in zip(got, want):
      assert np.all(np.isfinite(g))
      np.testing.assert_allclose(g, w, atol=2e-5)


def test_xla_backend_runs_structured_masks_blockwise_like_float64(monkeypatch):
  # T = 131 with blocks of 64: two whole blocks and a block of 3 (T not a multiple of the block)
  monkeypatch.setattr(blockwise, "SMALL_BLOCK", 64)
  seen = []
  real = blockwise.blockwise_attention
  monkeypatch.setattr(blockwise, "blockwise_attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
  b, t_len, n, h = 1, 131, 2, 4
  q, k, v = (_rand(i, (b, t_len, n, h)) for i in range(3))
  mask = _mask("packed", b, t_len)
  out = kernels.attention(q, k, v, scale=0.5, mask=mask, implementation="xla")
  assert len(seen) == 1 and isinstance(seen[-1]["mask"], masks.AttentionMask)
  np.testing.assert_allclose(out, _numpy_attention(q, k, v, 0.5, None, mask.dense(b, t_len)), atol=2e-6)


def test_precise_dims_gradients_match_autodiff_of_the_textbook_formula():
  b, t_len, n, h = 1, 6, 2, 6
  q, k = _rand(5, (b, t_len, n, h + 2)) * 3.0, _rand(6, (b, t_len, n, h + 2)) * 3.0
  v, cot = _rand(7, (b, t_len, n, h)), _rand(8, (b, t_len, n, h))
  mask = masks.AttentionMask(causal=True).dense(b, t_len)

  def loss(fn):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2))(q, k, v)

  got = loss(lambda q, k, v: attention.dot_product_attention(q, k, v, scale=0.4, mask=mask, precise_dims=2))

  def textbook(q, k, v):  # the q.k of all H + 2 dims, v padded with 2 zero dims and sliced back
    v2 = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 2)))
    return _textbook(q, k, v2, 0.4, None, mask)[..., :h]

  for g, w in zip(got, loss(textbook)):
    np.testing.assert_allclose(g, w, atol=2e-5)


def test_second_order_gradients_match_the_textbook_formula():
  # The custom backward is itself differentiated: jax.hessian (forward over reverse), with GQA, a
  # bias and a row that sees no key (left padding).
  b, t_len, n, kv, h = 1, 3, 2, 1, 2
  q, k, v = _rand(9, (b, t_len, n, h)), _rand(10, (b, t_len, kv, h)), _rand(11, (b, t_len, kv, h))
  bias = _rand(12, (1, n, t_len, t_len))
  mask = jnp.asarray([[[[False, False, False], [False, True, False], [False, True, True]]]])

  def hessian(fn):
    loss = lambda q, bias: jnp.sum(jnp.sin(fn(q, k, v, 0.7, bias, mask)))  # noqa: E731
    return jax.jit(jax.hessian(loss, argnums=(0, 1)))(q, bias)

  def ours(q, k, v, scale, bias, mask):
    return attention.dot_product_attention(q, k, v, scale=scale, bias=bias, mask=mask)

  for got, want in zip(jax.tree.leaves(hessian(ours)), jax.tree.leaves(hessian(_textbook))):
    np.testing.assert_allclose(got, want, atol=2e-5)
