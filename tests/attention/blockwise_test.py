"""Blockwise attention (``jaxpe.attention.blockwise``) against float64 numpy and the dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import backends, blockwise, kernels, masks, reference
from jaxpe.ops import alibi

RNG = np.random.default_rng(7)


def _rand(shape, scale=1.0):
  return jnp.asarray(RNG.normal(size=shape) * scale, jnp.float32)


def _numpy(q, k, v, scale, bias, visible, precise_dims):
  """float64 softmax attention with the dense reference's rules (no visible key: zeros), and lse."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, _ = q.shape
  group = n // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  vis = np.broadcast_to(np.asarray(visible), s.shape)
  s = np.where(vis, s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  seen = np.isfinite(top)
  e = np.where(vis, np.exp(s - np.where(seen, top, 0.0)), 0.0)
  total = e.sum(-1, keepdims=True)
  p = np.where(seen, e / np.where(seen, total, 1.0), 0.0)
  lse = np.where(seen, top + np.log(np.where(seen, total, 1.0)), -np.inf)[..., 0]
  return np.einsum("bnts,bsnh->btnh", p, v), np.moveaxis(lse, 1, 2)


def _case(kind, b, t, s, n, kv, h, precise_dims=0, use_alibi=False):
  q, k, v = _rand((b, t, n, h + precise_dims)), _rand((b, s, kv, h + precise_dims)), _rand((b, s, kv, h))
  if precise_dims:  # emulation-like dims: large values whose products cancel
    q = q.at[..., h:].multiply(4.0)
    k = k.at[..., h:].multiply(4.0)
  spec = bias = None
  if use_alibi:
    slopes = np.abs(RNG.normal(size=n)).astype(np.float32) * 0.2
    q_pos = jnp.asarray(RNG.integers(0, 60, (b, t)), jnp.int32)
    k_pos = jnp.asarray(RNG.integers(0, 60, (b, s)), jnp.int32)
    spec = backends.AlibiSpec(slopes, q_pos, k_pos, max_position=65536)
    bias = alibi.alibi_bias(slopes, q_pos, k_pos)
  if kind == "none":
    return q, k, v, None, np.ones((b, 1, t, s), bool), spec, bias
  if kind in ("causal", "padded", "packed"):  # self-attention: an AttentionMask (static causal skip)
    valid = jnp.asarray(RNG.random((b, t)) > 0.3) if kind == "padded" else None
    ids = jnp.asarray(np.sort(RNG.integers(0, 3, (b, t)), axis=1), jnp.int32) if kind == "packed" else None
    mask = masks.AttentionMask(valid=valid, segment_ids=ids, causal=True)
    return q, k, v, mask, np.asarray(mask.dense(b, t)), spec, bias
  # "cache": T queries at slots end..end+T-1 of S cache slots, some slots empty; "noncausal" packed keys
  end = s - t - 3
  q_index = jnp.broadcast_to(end + jnp.arange(t, dtype=jnp.int32), (b, t))
  k_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  k_valid = jnp.asarray((RNG.random((b, s)) > 0.2) & (np.arange(s) < end + t))
  if kind == "cache":
    mask = masks.IndexMask(q_index, k_index, causal=True, k_valid=k_valid)
  else:
    ids_q = jnp.asarray(RNG.integers(0, 2, (b, t)), jnp.int32)
    ids_k = jnp.asarray(RNG.integers(0, 2, (b, s)), jnp.int32)
    mask = masks.IndexMask(q_index, k_index, False, k_valid, ids_q, ids_k)
  return q, k, v, mask, np.asarray(mask.dense()), spec, bias


CASES = [
  # kind, B, T, S, N, K, H, precise_dims, alibi, block_q, block_k
  ("none", 1, 20, 20, 2, 2, 8, 0, False, 8, 8),  # loop path (3x3 block pairs)
  ("causal", 2, 37, 37, 4, 2, 8, 0, False, 8, 16),  # GQA, T not a multiple of the blocks
  # square blocks under an AttentionMask: the triangular loops (j < i unmasked, then the diagonal)
  ("causal", 1, 70, 70, 2, 1, 8, 2, True, 8, 8),  # 9x9 pairs, ALiBi, emulation dims, MQA
  ("padded", 2, 37, 37, 4, 2, 8, 0, False, 8, 8),  # T not a multiple of the block, GQA
  ("padded", 2, 37, 37, 4, 4, 8, 0, True, 16, 8),
  ("packed", 2, 40, 40, 6, 3, 8, 2, False, 8, 8),  # 5x5 pairs
  ("cache", 2, 5, 70, 4, 1, 8, 0, True, 4, 16),  # KV cache: dynamic skip of empty and future blocks
  ("cache", 1, 1, 40, 2, 2, 8, 2, False, None, 8),  # one decoding step
  ("noncausal", 2, 33, 50, 6, 3, 8, 0, True, 8, 8),  # IndexMask with segment ids, not causal
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[2]}-S{c[3]}-b{c[9]}x{c[10]}" for c in CASES])
def test_blockwise_matches_float64_and_the_dense_reference_with_gradients(case):
  kind, b, t, s, n, kv, h, pd, use_alibi, bq, bk = case
  q, k, v, mask, visible, spec, bias = _case(kind, b, t, s, n, kv, h, pd, use_alibi)
  scale = 1.0 / np.sqrt(h)
  cot = _rand((b, t, n, h))
  cot_lse = _rand((b, t, n))
  dense = (
    None if mask is None else (mask.dense(b, t) if isinstance(mask, masks.AttentionMask) else mask.dense())
  )

  def fast(q, k, v):
    out, lse = blockwise.blockwise_attention(
      q, k, v, scale=scale, mask=mask, alibi=spec, precise_dims=pd, block_q=bq, block_k=bk, return_lse=True
    )
    return out, lse

  def slow(q, k, v):
    return reference.dot_product_attention(q, k, v, scale=scale, mask=dense, bias=bias, precise_dims=pd)

  out, lse = jax.jit(fast)(q, k, v)
  want_out, want_lse = _numpy(q, k, v, scale, bias, visible, pd)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-5)
  seen = np.isfinite(want_lse)
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
  np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(out, jax.jit(slow)(q, k, v), atol=1e-5)

  # gradients (through the output and the lse) against autodiff of the dense reference plus a
  # logsumexp written with jax ops
  def loss_fast(q, k, v):
    out, lse = fast(q, k, v)
    return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)

  def loss_slow(q, k, v):
    logits = jnp.einsum(
      "btnh,bsnh->bnts",
      q,
      jnp.repeat(k, n // kv, axis=2),
      precision=jax.lax.Precision.HIGHEST,
    )
    logits = logits * scale + (0.0 if bias is None else bias)
    logits = jnp.where(jnp.asarray(visible), logits, -jnp.inf)
    lse = jnp.moveaxis(jax.nn.logsumexp(logits, axis=-1), 1, 2)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)
    return jnp.sum(slow(q, k, v) * cot) + lse_term

  got = jax.jit(jax.grad(loss_fast, argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss_slow, argnums=(0, 1, 2)))(q, k, v)
  for g, w, name in zip(got, want, "qkv"):
    assert np.all(np.isfinite(np.asarray(g))), name
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)


def test_combining_two_key_halves_gives_attention_over_all_keys():
  # what a ring step of context parallelism does: attend to each key shard, merge by lse
  b, t, s, n, h = 2, 12, 24, 2, 8
  q, k, v, mask, visible, _, _ = _case("cache", b, t, s, n, n, h)
  scale = 0.4
  cot = _rand((b, t, n, h))

  def halves(q, k, v):
    parts = []
    for cols in (slice(0, 10), slice(10, s)):
      part = masks.IndexMask(mask.q_index, mask.k_index[:, cols], True, mask.k_valid[:, cols])
      parts.append(
        blockwise.blockwise_attention(
          q, k[:, cols], v[:, cols], scale=scale, mask=part, block_q=4, block_k=4, return_lse=True
        )
      )
    return blockwise.combine_partials(*parts[0], *parts[1])

  def whole(q, k, v):
    return blockwise.blockwise_attention(
      q, k, v, scale=scale, mask=mask, block_q=4, block_k=4, return_lse=True
    )

  (out, lse), (out_w, _) = jax.jit(halves)(q, k, v), jax.jit(whole)(q, k, v)
  want, want_lse = _numpy(q, k, v, scale, None, visible, 0)
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(out, out_w, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(lse) == -np.inf, want_lse == -np.inf)
  g1 = jax.jit(jax.grad(lambda *a: jnp.sum(halves(*a)[0] * cot), argnums=(0, 1, 2)))(q, k, v)
  g2 = jax.jit(jax.grad(lambda *a: jnp.sum(whole(*a)[0] * cot), argnums=(0, 1, 2)))(q, k, v)
  for a, w in zip(g1, g2):
    assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(a, w, atol=1e-5)


def test_rows_without_visible_keys_give_zeros_and_finite_gradients_and_combine_to_zeros():
  b, t, n, h = 1, 6, 2, 4
  q, k, v = _rand((b, t, n, h)), _rand((b, t, n, h)), _rand((b, t, n, h))
  mask = masks.AttentionMask(valid=jnp.zeros((b, t), bool), causal=True)  # every key is padding

  def f(q, k, v):
    return blockwise.blockwise_attention(q, k, v, scale=0.5, mask=mask, block_q=2, block_k=2, return_lse=True)

  out, lse = jax.jit(f)(q, k, v)
  assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf)
  merged, merged_lse = blockwise.combine_partials(out, lse, out, lse)
  assert np.all(np.asarray(merged) == 0) and np.all(np.asarray(merged_lse) == -np.inf)
  grads = jax.grad(lambda *a: jnp.sum(blockwise.combine_partials(*f(*a), *f(*a))[0]), argnums=(0, 1, 2))(
    q, k, v
  )
  for g in grads:
    assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("mask_kind", ["causal", "padded"])
def test_second_derivatives_match_the_dense_reference(mask_kind):
  """grad of grad (reverse over reverse: it differentiates the backward pass's loops) and
  ``jax.hessian`` (forward over reverse) equal the dense reference's, with square blocks under an
  ``AttentionMask`` (the triangular loops) and three blocks per side."""
  b, t, n, h = 1, 12, 2, 4
  q, k, v = _rand((b, t, n, h)), _rand((b, t, n, h)), _rand((b, t, n, h))
  valid = None if mask_kind == "causal" else jnp.asarray(np.arange(t) >= 3)[None]
  mask = masks.AttentionMask(valid=valid, causal=True)

  def blockwise_loss(q):
    return jnp.sum(
      jnp.sin(blockwise.blockwise_attention(q, k, v, scale=0.5, mask=mask, block_q=4, block_k=4))
    )

  def dense_loss(q):
    return jnp.sum(jnp.sin(reference.dot_product_attention(q, k, v, scale=0.5, mask=mask.dense(b, t))))

  for second in (lambda f: jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2)), jax.hessian):
    got, want = jax.jit(second(blockwise_loss))(q), jax.jit(second(dense_loss))(q)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attention_memory_grows_linearly_with_length():
  # XLA's compiled memory analysis of forward + backward: blockwise temporaries grow like T (x2 per
  # doubling, plus a constant), the dense reference's like T^2 (x4)
  def temp(t_len, dense):
    shape = jax.ShapeDtypeStruct((1, t_len, 2, 16), jnp.float32)
    mask = masks.AttentionMask(causal=True)

    def fn(q, k, v):
      if dense:
        return reference.dot_product_attention(q, k, v, scale=0.25, mask=mask.dense(1, t_len))
      return blockwise.blockwise_attention(q, k, v, scale=0.25, mask=mask, block_q=128, block_k=128)

    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2)))
    return grad.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes

  fast = [temp(t, False) for t in (1024, 2048, 4096)]
  dense = [temp(t, True) for t in (1024, 2048, 4096)]
  assert fast[2] / fast[1] < 2.2 and fast[1] / fast[0] < 2.2, fast
  assert dense[2] / dense[1] > 3.5, dense  # the test can fail: the quadratic path does
  assert fast[2] < dense[2] / 20, (fast, dense)


def test_the_xla_backend_and_the_decoder_cache_path_run_blockwise(monkeypatch):
  """A cache chunk of more queries than ``decode.DECODE_MAX_QUERIES`` runs blockwise; fewer (a decode
  step) run ``decode.decode_attention``, one pass over the cache; a dense bias the dense reference."""
  from jaxpe.attention import decode

  calls, steps = [], []
  real, real_step = blockwise.blockwise_attention, decode.decode_attention
  monkeypatch.setattr(blockwise, "blockwise_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
  monkeypatch.setattr(decode, "decode_attention", lambda *a, **kw: steps.append(kw) or real_step(*a, **kw))
  b, t, s, n, h = 1, decode.DECODE_MAX_QUERIES + 1, 40, 2, 4
  q, k, v, mask, visible, spec, bias = _case("cache", b, t, s, n, n, h, use_alibi=True)
  out = kernels.attention(q, k, v, scale=0.5, mask=mask, alibi_spec=spec, implementation="xla")
  assert len(calls) == 1 and isinstance(calls[0]["mask"], masks.IndexMask) and not steps
  np.testing.assert_allclose(out, _numpy(q, k, v, 0.5, bias, visible, 0)[0], atol=2e-5)
  q3, k3, v3, mask3, visible3, spec3, bias3 = _case("cache", b, 3, 9, n, n, h, use_alibi=True)
  out = kernels.attention(q3, k3, v3, scale=0.5, mask=mask3, alibi_spec=spec3, implementation="xla")
  assert len(calls) == 1 and len(steps) == 1
  np.testing.assert_allclose(out, _numpy(q3, k3, v3, 0.5, bias3, visible3, 0)[0], atol=2e-5)
  # a dense bias the caller built still runs on the dense reference
  out = kernels.attention(q, k, v, scale=0.5, mask=mask, bias=bias, implementation="xla")
  assert len(calls) == 1
  np.testing.assert_allclose(out, _numpy(q, k, v, 0.5, bias, visible, 0)[0], atol=2e-5)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(block_q=0), ValueError, r"block_q must be an int > 0"),
    (dict(block_k=2.5), ValueError, r"block_k must be an int > 0"),
    (dict(mask="causal"), TypeError, r"mask must be an IndexMask, an AttentionMask or None"),
    (dict(alibi=np.ones(2)), TypeError, r"alibi must be an AlibiSpec or None"),
    (dict(precise_dims=9), ValueError, r"precise_dims must be an int in 0..Hq = 4"),
    (dict(scale=0.0), ValueError, r"scale"),
    (
      dict(mask=masks.IndexMask(jnp.arange(2)[None], jnp.arange(3)[None])),
      ValueError,
      r"mask.q_index / mask.k_index must have shapes \[B, T\] = \[1, 3\]",
    ),
  ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
  q = jnp.zeros((1, 3, 2, 4))
  args = dict(scale=0.5) | kwargs
  with pytest.raises(error, match=match):
    blockwise.blockwise_attention(q, q, q[..., :4], **args)
