"""Attention sinks (jaxpe.attention.sinks) through jaxpe.attention.attention: every xla path (blockwise
under an AttentionMask / IndexMask, the dense reference under a dense bias) and splash in interpret mode
against HF gpt-oss's eager_attention_forward run in torch float64 (values and gradients of q, k, v and
sinks) and a float64 numpy transcription of its formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import blockwise, kernels, masks

B, T, N, K, H = 2, 12, 4, 2, 8
SCALE = H**-0.5


def _numpy_sink_attention(q, k, v, sinks, allowed, bias=None):
  """float64 numpy: softmax over [scores, sink] (HF gpt-oss), the sink's column dropped, then . v."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) * SCALE
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  s = np.where(allowed, s, -np.inf)
  sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (*s.shape[:3], 1))
  full = np.concatenate([s, sink], axis=-1)
  full = np.exp(full - full.max(-1, keepdims=True))
  p = (full / full.sum(-1, keepdims=True))[..., :-1]
  return np.einsum("bnts,bsnh->btnh", p, v)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
  """HF transformers 5.x ``models/gpt_oss/modeling_gpt_oss.py`` ``eager_attention_forward``, copied
  (dropout left out; ``repeat_kv`` inlined as ``repeat_interleave``, as HF's ``repeat_kv`` does):
  importing transformers costs ~20 s of this test's CPU; torch is imported here, not at collection)."""
  import torch

  key_states = key.repeat_interleave(module.num_key_value_groups, dim=1)
  value_states = value.repeat_interleave(module.num_key_value_groups, dim=1)
  attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
  if attention_mask is not None:
    attn_weights = attn_weights + attention_mask
  sinks = module.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
  combined_logits = torch.cat([attn_weights, sinks], dim=-1)
  combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
  probs = torch.nn.functional.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
  scores = probs[..., :-1]  # we drop the sink here
  attn_output = torch.matmul(scores.to(value_states.dtype), value_states)
  return attn_output.transpose(1, 2).contiguous(), scores


def _hf_gpt_oss(q, k, v, sinks, allowed, bias=None):
  """HF gpt-oss ``eager_attention_forward`` in torch float64 with autograd: (out [B, T, N, H],
  grads of q, k, v, sinks of sum(out * w)) for the fixed weights w below."""
  import torch

  tq, tk, tv, ts = (torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v, sinks))
  module = torch.nn.Module()
  module.sinks, module.num_key_value_groups, module.training = ts, q.shape[2] // k.shape[2], False
  add = torch.tensor(np.where(np.asarray(allowed), 0.0, np.finfo(np.float64).min))  # HF's additive mask
  if bias is not None:
    add = add + torch.tensor(np.asarray(bias, np.float64))
  out, _ = eager_attention_forward(
    module, tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2), add, scaling=SCALE
  )
  (out * torch.tensor(_weights(out.shape))).sum().backward()
  return out.detach().numpy(), [x.grad.numpy() for x in (tq, tk, tv, ts)]


def _weights(shape):
  return np.random.default_rng(9).normal(size=shape)


def _qkvs(s_len=T):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, s_len, K, H)).astype(np.float32)
  v = rng.normal(size=(B, s_len, K, H)).astype(np.float32)
  sinks = rng.normal(size=(N,)).astype(np.float32) * 2.0
  return q, k, v, sinks


def _grads(fn, q, k, v, sinks):
  w = jnp.asarray(_weights((B, T, N, H)), jnp.float32)
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2, 3)))(q, k, v, sinks)


def _check(fn, q, k, v, sinks, allowed, bias=None, rows=None):
  got = np.asarray(jax.jit(fn)(q, k, v, sinks))
  want_np = _numpy_sink_attention(q, k, v, sinks, allowed, bias)
  want, want_grads = _hf_gpt_oss(q, k, v, sinks, allowed, bias)
  rows = np.ones((B, T), bool) if rows is None else rows
  np.testing.assert_allclose(want, want_np, atol=1e-12)  # the two references agree
  np.testing.assert_allclose(got[rows], want[rows], atol=2e-6, rtol=0)
  _, grads = _grads(fn, q, k, v, sinks)
  for name, g, w in zip("qkvs", grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, rtol=0, err_msg=name)
  return got


def _causal_padded_packed():
  valid = np.arange(T)[None, :] >= np.array([[0], [3]])  # row 1 left-padded by 3
  seg = np.stack([np.repeat([1, 2], [5, 7]), np.ones(T, int)]).astype(np.int32)
  mask = masks.AttentionMask(valid=jnp.asarray(valid), segment_ids=jnp.asarray(seg), causal=True)
  allowed = np.asarray(mask.dense(B, T))
  return mask, allowed, valid


def test_blockwise_sinks_match_gpt_oss_values_and_gradients():
  q, k, v, sinks = _qkvs()
  mask, allowed, valid = _causal_padded_packed()

  def fn(q, k, v, s):
    return kernels.attention(q, k, v, scale=SCALE, mask=mask, sinks=s)

  got = _check(fn, q, k, v, sinks, allowed, rows=valid)
  # the sinks change the output (a test that could pass without them would be no test)
  plain = jax.jit(lambda q, k, v: kernels.attention(q, k, v, scale=SCALE, mask=mask))(q, k, v)
  assert np.abs(got - np.asarray(plain))[valid].max() > 1e-2
  # blocks of 4 (several blocks, the online softmax across them) give the same
  small = jax.jit(
    lambda q, k, v, s: blockwise.blockwise_attention(
      q, k, v, scale=SCALE, mask=mask, sinks=s, block_q=4, block_k=4
    )
  )(q, k, v, sinks)
  np.testing.assert_allclose(np.asarray(small)[valid], got[valid], atol=2e-6)


def test_dense_path_sinks_with_a_bias_match_gpt_oss():
  q, k, v, sinks = _qkvs()
  _, allowed, valid = _causal_padded_packed()
  bias = np.random.default_rng(3).normal(size=(B, N, T, T)).astype(np.float32)

  def fn(q, k, v, s):
    return kernels.attention(q, k, v, scale=SCALE, mask=jnp.asarray(allowed), bias=jnp.asarray(bias), sinks=s)

  _check(fn, q, k, v, sinks, allowed, bias=bias, rows=valid)


def test_index_mask_sinks_match_gpt_oss():
  # KV-cache shape: T = 12 queries at slots 4..15 of S = 16 key slots, slots 0 and 1 empty.
  s_len = 16
  q, k, v, sinks = _qkvs(s_len)
  q_index = jnp.broadcast_to(jnp.arange(4, 16, dtype=jnp.int32), (B, T))
  k_index = jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32), (B, s_len))
  k_valid = jnp.asarray(np.arange(s_len)[None] >= np.array([[0], [2]]))
  mask = masks.IndexMask(q_index, k_index, True, k_valid)

  def fn(q, k, v, s):
    return kernels.attention(q, k, v, scale=SCALE, mask=mask, sinks=s)

  _check(fn, q, k, v, sinks, np.asarray(mask.dense()))


def test_lse_includes_the_sink_and_empty_rows_stay_zero():
  q, k, v, sinks = _qkvs()
  valid = np.ones((B, T), bool)
  valid[1] = False  # row 1: no visible key at all
  mask = masks.AttentionMask(valid=jnp.asarray(valid), causal=True)
  run = jax.jit(
    lambda q, k, v, s: blockwise.blockwise_attention(
      q, k, v, scale=SCALE, mask=mask, sinks=s, return_lse=True
    )
  )
  out, lse = run(q, k, v, sinks)
  _, lse0 = run(q, k, v, jnp.full((N,), -jnp.inf))  # a sink of -inf is no sink
  np.testing.assert_allclose(lse[0], np.logaddexp(np.asarray(lse0[0], np.float64), sinks), rtol=1e-6)
  assert np.all(np.asarray(out[1]) == 0) and np.all(np.isfinite(np.asarray(out)))
  _, grads = _grads(lambda q, k, v, s: run(q, k, v, s)[0], q, k, v, sinks)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_splash_sinks_match_xla():
  # splash in interpret mode: T 128 (its block), H padded to 128 inside; causal with left padding
  t_len = 128
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(1, t_len, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, t_len, 2, 16)), jnp.float32) for _ in range(2))
  sinks = jnp.asarray(rng.normal(size=(4,)) * 2.0, jnp.float32)
  mask = masks.AttentionMask(valid=jnp.asarray(np.arange(t_len)[None] >= 5), causal=True)

  def grads(impl):
    def loss(q, k, v, s):
      out = kernels.attention(q, k, v, scale=0.25, mask=mask, sinks=s, implementation=impl, interpret=True)
      return jnp.sum(out[:, 5:] ** 2), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)

  (g_splash, out_splash), (g_xla, out_xla) = grads("splash"), grads("xla")
  np.testing.assert_allclose(np.asarray(out_splash)[:, 5:], np.asarray(out_xla)[:, 5:], atol=2e-5, rtol=0)
  for name, got, want in zip("qkvs", g_splash, g_xla):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5, rtol=0, err_msg=name)


def test_sink_errors():
  q, k, v, sinks = _qkvs()
  with pytest.raises(ValueError, match=r"sinks must be a float array \[N\] = \[4\]"):
    kernels.attention(q, k, v, scale=SCALE, sinks=sinks[:2])
  with pytest.raises(TypeError, match="sinks must be a float array"):
    kernels.attention(q, k, v, scale=SCALE, sinks=np.zeros(N, np.int32))
  x = jnp.zeros((1, 128, 2, 16), jnp.float32)
  with pytest.raises(
    ValueError, match=r"'pallas_gpu' takes no attention sinks.*'xla', 'splash' \(native sinks\) and 'flash'"
  ):
    kernels.attention(x, x, x, scale=1.0, sinks=jnp.zeros(2), implementation="pallas_gpu", interpret=True)
