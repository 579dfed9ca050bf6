"""ALiBi attention through its bias-free emulation (jaxpe.attention.emulated_alibi_attention) against
the native ALiBi bias on the dense reference attention."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe import emulation
from jaxpe.attention import backends, emulated, kernels, masks
from jaxpe.attention import reference as attention


def paper_slopes(n):
  """ALiBi slopes for a power-of-two head count, 2^(-8h/n), written out."""
  return np.asarray([2.0 ** (-8.0 * h / n) for h in range(1, n + 1)])


@pytest.mark.parametrize("order", [1, 2, None])
def test_bias_free_kernel_with_padding_matches_native_alibi(order):
  # jax.nn.dot_product_attention (no bias; q, k, v padded to 16 dims) against the jaxpe attention
  # path with the native ALiBi bias, GQA (4 query heads, 2 kv heads), causal.
  n, kv, h, t = 4, 2, 6, 12
  slopes = paper_slopes(4)
  q = jax.random.normal(jax.random.key(2), (2, t, n, h))
  k = jax.random.normal(jax.random.key(3), (2, t, kv, h))
  v = jax.random.normal(jax.random.key(4), (2, t, kv, h))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 100, (2, t))
  theta = emulation.emulation_theta(max_phase=0.1, max_len=256)
  mask = masks.dense_attention_mask(pos, pos)
  bias = -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * (
    pos[:, None, :, None] - pos[:, None, None, :]
  ).astype(jnp.float32)
  native = attention.dot_product_attention(q, k, v, scale=1 / math.sqrt(h), bias=bias, mask=mask)
  out = jax.jit(
    lambda q, k, v: emulated.emulated_alibi_attention(
      q, k, v, pos, pos, slopes=slopes, theta=theta, order=order, is_causal=True
    )
  )(q, k, v)
  chex.assert_shape(out, (2, t, n, h))
  # logit deviation <= bound (< 1e-5 here, distances <= 11): outputs agree to rounding
  np.testing.assert_allclose(out, native, atol=1e-4)


@pytest.mark.parametrize("order", [None, 2])
def test_emulated_alibi_attention_on_cudnn_feeds_it_bf16(order, monkeypatch):
  # cuDNN flash attention reads bf16/fp16 only: emulated_alibi_attention(implementation="cudnn") used
  # to hand it the float32 emulation dims. A GPU is modelled here: cudnn is reported available and
  # jax.nn.dot_product_attention checks the dtypes it gets, then computes on xla from those inputs.
  real = jax.nn.dot_product_attention
  seen = []

  def fake_cudnn(q, k, v, *args, implementation=None, **kw):
    assert implementation == "cudnn"
    seen.append((q.dtype, k.dtype, v.dtype))
    assert q.dtype == k.dtype == v.dtype and q.dtype in (jnp.bfloat16, jnp.float16), seen[-1]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  exact products of bf16 inputs
    return real(f32(q), f32(k), f32(v), *args, implementation="xla", **kw).astype(q.dtype)

  monkeypatch.setattr(backends, "platform_backends", lambda platform=None: ("xla", "cudnn", "pallas_gpu"))
  monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
  n, kv, h, t = 4, 2, 8, 16
  slopes = paper_slopes(4)
  q = jax.random.normal(jax.random.key(2), (2, t, n, h))
  k = jax.random.normal(jax.random.key(3), (2, t, kv, h))
  v = jax.random.normal(jax.random.key(4), (2, t, kv, h))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 1000, (2, t))
  theta = emulation.emulation_theta(max_phase=0.1, max_len=2048)
  out = jax.jit(
    lambda q, k, v: emulated.emulated_alibi_attention(
      q, k, v, pos, pos, slopes=slopes, theta=theta, order=order, is_causal=True, implementation="cudnn"
    )
  )(q, k, v)
  assert seen
  bias = -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * (
    pos[:, None, :, None] - pos[:, None, None, :]
  ).astype(jnp.float32)
  mask = masks.dense_attention_mask(pos, pos)
  native = attention.dot_product_attention(q, k, v, scale=1 / math.sqrt(h), bias=bias, mask=mask)
  chex.assert_shape(out, (2, t, n, h))
  np.testing.assert_allclose(out, native, atol=3e-2)  # bf16 content dims


@pytest.mark.parametrize("path", ["dense", "blockwise"])
def test_exact_form_keeps_float32_accuracy_at_long_positions(path):
  # The augmented form has no truncation error; its emulation products m sqrt(H) i (~3e5 here)
  # cancel to -m sqrt(H) (i - j). Summed in one product with the content, they would round the
  # content to their ulp first (output error ~5e-4 at 65536); contracted apart it stays ~1e-6.
  n, kv, h, t = 4, 2, 64, 64
  slopes = paper_slopes(n)
  q, k, v = (jax.random.normal(jax.random.key(i), (1, t, m, h)) for i, m in ((5, n), (6, kv), (7, kv)))
  pos = jnp.arange(t, dtype=jnp.int32)[None] + 65536 - t
  if path == "dense":
    out = emulated.emulated_alibi_attention(q, k, v, pos, pos, slopes=slopes, order=None, is_causal=True)
  else:
    q_aug, k_aug = emulation.apply_augmented_alibi(q, k, pos, pos, slopes=slopes)
    mask = masks.AttentionMask(causal=True)
    out = kernels.attention(q_aug, k_aug, v, scale=1 / math.sqrt(h), mask=mask, precise_dims=2)
  q64, k64, v64 = (np.repeat(np.asarray(x, np.float64), n // x.shape[2], 2) for x in (q, k, v))
  logits = np.einsum("btnh,bsnh->bnts", q64, k64) / math.sqrt(h)
  logits -= slopes[:, None, None] * (np.arange(t)[:, None] - np.arange(t)[None, :])
  logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v64)
  assert np.abs(np.asarray(out, np.float64) - want).max() < 2e-5
