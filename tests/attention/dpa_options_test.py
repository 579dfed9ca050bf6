"""``dot_product_attention``'s ``is_causal``, default ``scale`` and forward-mode derivatives, against
``jax.nn.dot_product_attention`` and a numpy float64 transcription of softmax attention and its
tangent; forward mode through ``blockwise_attention`` names the alternative."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.attention import AttentionMask, IndexMask, blockwise_attention


def _np_attention(q, k, v, bias, mask, scale):
  """float64 ``softmax(q.k * scale + bias, masked) v`` and the probabilities; q ``[B,T,N,H]``,
  k/v ``[B,S,N,H]`` (one kv head per query head)."""
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale + bias
  s = np.where(mask, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, v), p


def _np_tangent(q, k, v, bias, mask, scale, dq, dk, dv, dbias):
  """The float64 forward-mode derivative: ``d out = P (ds - rowsum(P ds)) v + P dv``."""
  _, p = _np_attention(q, k, v, bias, mask, scale)
  ds = (np.einsum("btnh,bsnh->bnts", dq, k) + np.einsum("btnh,bsnh->bnts", q, dk)) * scale + dbias
  dp = p * (ds - np.sum(p * ds, -1, keepdims=True))
  return np.einsum("bnts,bsnh->btnh", dp, v) + np.einsum("bnts,bsnh->btnh", p, dv)


@pytest.fixture(scope="module")
def qkv():
  keys = jax.random.split(jax.random.key(0), 8)
  q = jax.random.normal(keys[0], (2, 6, 4, 8))
  k = jax.random.normal(keys[1], (2, 9, 4, 8))
  v = jax.random.normal(keys[2], (2, 9, 4, 8))
  bias = jax.random.normal(keys[3], (1, 4, 6, 9))
  tangents = tuple(jax.random.normal(kk, x.shape) for kk, x in zip(keys[4:], (q, k, v, bias)))
  return q, k, v, bias, tangents


@pytest.mark.parametrize("t_len, s_len", [(6, 6), (6, 9), (9, 6)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_is_causal_and_default_scale_as_jax_nn(t_len, s_len, is_causal):
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (2, t_len, 4, 8))
  k = jax.random.normal(keys[1], (2, s_len, 2, 8))
  v = jax.random.normal(keys[2], (2, s_len, 2, 8))
  got = jaxpe.dot_product_attention(q, k, v, is_causal=is_causal)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)
  np.testing.assert_allclose(got, want, atol=2e-6)
  # and against numpy float64: the top-left [T, S] triangle, scale 1/sqrt(H)
  mask = np.tril(np.ones((t_len, s_len), bool)) if is_causal else np.ones((t_len, s_len), bool)
  rep = lambda x: np.repeat(np.asarray(x, np.float64), 2, axis=2)  # noqa: E731
  ref, _ = _np_attention(np.asarray(q, np.float64), rep(k), rep(v), 0.0, mask, 1 / np.sqrt(8))
  np.testing.assert_allclose(got, ref, atol=2e-6)


def test_is_causal_with_a_mask_and_long_sequences_in_query_blocks():
  keys = jax.random.split(jax.random.key(2), 3)
  q, k, v = (jax.random.normal(kk, (1, 300, 2, 8)) for kk in keys)
  valid = jnp.arange(300)[None] >= 7
  mask = AttentionMask(valid=valid, causal=False).dense(1, 300)
  got = jaxpe.dot_product_attention(q, k, v, scale=0.3, mask=mask, is_causal=True)
  want = jax.nn.dot_product_attention(q, k, v, scale=0.3, mask=mask, is_causal=True)
  np.testing.assert_allclose(got[:, 7:], want[:, 7:], atol=2e-6)


def test_default_scale_with_emulation_dims_is_the_original_head():
  """q and k carry two emulation dims per head beyond v's width: the default scale stays 1/sqrt(H)."""
  keys = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(kk, (1, 5, 2, 8)) for kk in keys)
  pos = jnp.arange(5)[None]
  slopes = jaxpe.alibi_slopes(2)
  theta = jaxpe.emulation_theta(max_phase=0.1, max_len=64)
  q_aug, k_aug = jaxpe.apply_rope_alibi(q, k, pos, pos, slopes=slopes, theta=theta)
  got = jaxpe.dot_product_attention(q_aug, k_aug, v, is_causal=True)
  want = jaxpe.dot_product_attention(q_aug, k_aug, v, scale=1 / np.sqrt(8), is_causal=True)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("is_causal", [False, True])
def test_jvp_against_numpy_float64(qkv, is_causal):
  q, k, v, bias, tangents = qkv
  f = lambda q, k, v, b: jaxpe.dot_product_attention(q, k, v, bias=b, is_causal=is_causal)  # noqa: E731
  out, tangent = jax.jvp(f, (q, k, v, bias), tangents)
  as64 = [np.asarray(x, np.float64) for x in (q, k, v, bias, *tangents)]
  mask = np.tril(np.ones((6, 9), bool)) if is_causal else np.ones((6, 9), bool)
  ref_out, _ = _np_attention(*as64[:4], mask, 1 / np.sqrt(8))
  ref_tangent = _np_tangent(*as64[:4], mask, 1 / np.sqrt(8), *as64[4:])
  np.testing.assert_allclose(out, ref_out, atol=2e-6)
  np.testing.assert_allclose(tangent, ref_tangent, atol=1e-5)
  # under jit too, and jax.nn's jvp agrees
  _, jit_tangent = jax.jit(lambda *a: jax.jvp(f, a[:4], a[4:]))(q, k, v, bias, *tangents)
  np.testing.assert_allclose(jit_tangent, ref_tangent, atol=1e-5)
  g = lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b, is_causal=is_causal)  # noqa: E731
  np.testing.assert_allclose(tangent, jax.jvp(g, (q, k, v, bias), tangents)[1], atol=2e-6)


def test_jacfwd_equals_jacrev_and_grad_of_grouped_queries_with_emulation_dims():
  keys = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(keys[0], (1, 4, 4, 6))
  k = jax.random.normal(keys[1], (1, 4, 2, 6))
  v = jax.random.normal(keys[2], (1, 4, 2, 4))  # two precise dims (Hq - H)
  f = lambda q, k, v: jaxpe.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
  fwd = jax.jit(jax.jacfwd(f, argnums=(0, 1, 2)))(q, k, v)
  rev = jax.jit(jax.jacrev(f, argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(fwd, rev):
    np.testing.assert_allclose(a, b, atol=1e-6)
  loss = lambda q: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
  hess_fwd_rev = jax.jit(jax.hessian(loss))(q)
  hess_fwd_fwd = jax.jit(jax.jacfwd(jax.jacfwd(loss)))(q)
  np.testing.assert_allclose(hess_fwd_rev, hess_fwd_fwd, atol=1e-5)


def test_forward_mode_through_blockwise_names_the_alternative():
  """(Reverse mode through it: tests/attention/blockwise_test.py.)"""
  q = k = v = jnp.ones((1, 4, 2, 8))
  index = jnp.arange(4)[None]
  for mask in (AttentionMask(causal=True), IndexMask(index, index)):
    f = lambda q, mask=mask: blockwise_attention(q, k, v, scale=0.3, mask=mask)  # noqa: E731
    with pytest.raises(TypeError, match=r"no forward-mode derivative.*jaxpe\.dot_product_attention"):
      jax.jvp(f, (q,), (q,))
