"""Emulated ALiBi inside the full decoder: same weights, ``alibi`` vs ``rope_alibi`` (issue 4).

The attention inputs of every layer are recorded by wrapping ``jaxpe.attention.blockwise_attention``
(the one function both encodings go through on ``xla``; native ALiBi arrives as an ``AlibiSpec``, its
bias rebuilt here with ``alibi_bias``). Scores are formed from them as the attention forms its logits
(float32 einsum times scale, plus the bias), and compared with the solver's bound
(``jaxpe.emulation.EmulationPlan.bound_at``) plus the float32 rounding of the content logits.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe import emulation
from jaxpe.attention import blockwise
from jaxpe.model.cache import init_cache
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.ops import alibi
from jaxpe.ops import alibi as alibi_lib

N, H, CONTEXT = 4, 8, 8192
TINY = dict(vocab_size=64, d_model=N * H, num_layers=2, num_heads=N, max_len=64, rope_alibi_context=CONTEXT)


def _record(monkeypatch):
  calls = []
  inner = blockwise.blockwise_attention

  def wrapper(q, k, v, *, scale, mask=None, alibi=None, **kwargs):
    bias = None
    if alibi is not None:
      slopes = jnp.asarray(alibi.slopes, jnp.float32)
      bias = alibi_lib.alibi_bias(slopes, alibi.q_positions, alibi.k_positions)
    calls.append(dict(q=q, k=k, scale=scale, bias=bias, mask=mask))
    return inner(q, k, v, scale=scale, mask=mask, alibi=alibi, **kwargs)

  monkeypatch.setattr(blockwise, "blockwise_attention", wrapper)
  return calls


def _scores(call):
  """``[B, N, T, S]`` float64 copy of the float32 logits the attention function computes."""
  q, k = call["q"], call["k"]
  logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) * jnp.float32(
    call["scale"]
  )
  if call["bias"] is not None:
    logits = logits + call["bias"].astype(jnp.float32)
  return np.asarray(logits, np.float64)


def _content_rounding(q, k, scale):
  """Bound on float32 rounding of ``q.k * scale``: (H + 2) u sum_h |q_h k_h| * scale (+ 1 ulp)."""
  q64, k64 = np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(k, np.float64))
  magnitude = np.einsum("BTNH,BSNH->BNTS", q64, k64) * scale
  return (q.shape[-1] + 4) * 2.0**-24 * magnitude


@pytest.mark.parametrize("dtype, order", [("float32", 1), ("bfloat16", 1), ("float32", 2)])
def test_decoder_scores_alibi_vs_rope_alibi_within_the_bound(monkeypatch, dtype, order):
  cfg_native = ModelConfig(**TINY, pos_encoding="alibi", dtype=dtype)
  cfg_emul = ModelConfig(**TINY, pos_encoding="rope_alibi", dtype=dtype, rope_alibi_order=order)
  native = Decoder(cfg_native, rngs=nnx.Rngs(0))
  emul = Decoder(cfg_emul, rngs=nnx.Rngs(1))
  nnx.update(emul, nnx.state(native))  # same weights (no position parameters in either)
  for a, b in zip(jax.tree.leaves(nnx.state(native)), jax.tree.leaves(nnx.state(emul))):
    np.testing.assert_array_equal(a, b)

  batch, t_len = 2, 24
  tokens = jax.random.randint(jax.random.key(2), (batch, t_len), 0, 64)
  # Far into the tuned context, where N sin(i theta) is large: positions 8000.. and 100..
  start = jnp.asarray([[CONTEXT - t_len], [100]], jnp.int32)
  positions = start + jnp.arange(t_len, dtype=jnp.int32)[None]

  calls = _record(monkeypatch)
  logits_native = native(tokens, positions=positions)
  native_calls, calls[:] = list(calls), []
  logits_emul = emul(tokens, positions=positions)
  emul_calls = list(calls)
  assert len(native_calls) == len(emul_calls) == cfg_native.num_layers

  slopes = alibi.alibi_slopes_f64(N)
  plan = emulation.solve_emulation(
    slopes, head_dim=H, max_len=CONTEXT, order=order, max_phase=cfg_emul.rope_alibi_max_phase
  )
  i = np.asarray(positions, np.float64)
  d = i[:, :, None] - i[:, None, :]  # [B, T, S]
  causal = d >= 0
  bound = plan.bound_at(np.maximum(d, 0)[:, None], i[:, None, :, None])  # [N, B, 1, T, S]
  bound = np.moveaxis(bound[:, :, 0], 0, 1)  # [B, N, T, S]

  for layer, (nat, emu) in enumerate(zip(native_calls, emul_calls)):
    # the precision policy: with bf16 activations the augmented q, k (and so their product) are float32
    assert emu["q"].dtype == emu["k"].dtype == jnp.float32
    assert emu["q"].shape[-1] == H + 2 * order and emu["bias"] is None
    assert nat["q"].dtype == jnp.dtype(dtype)
    assert nat["scale"] == emu["scale"] == 1 / math.sqrt(H)  # 1/sqrt of the original head dim
    content_q, content_k = emu["q"][..., :H], emu["k"][..., :H]
    if layer == 0:  # identical inputs: the content dims are the native q, k exactly
      np.testing.assert_array_equal(content_q, nat["q"].astype(jnp.float32))
      np.testing.assert_array_equal(content_k, nat["k"].astype(jnp.float32))
      reference = _scores(nat)
    else:  # later layers see slightly different inputs: native ALiBi on the emulated run's content
      bias = alibi.alibi_bias(alibi.alibi_slopes(N), positions, positions)
      reference = _scores(dict(q=content_q, k=content_k, scale=emu["scale"], bias=bias))
    tol = bound + 2 * _content_rounding(content_q, content_k, emu["scale"]) + 2.0**-24 * np.abs(reference)
    dev = np.abs(_scores(emu) - reference)
    excess = np.where(causal[:, None], dev - tol, -np.inf)
    assert np.all(excess <= 0), (layer, float(excess.max()))
    # the bound is not vacuous: the deviation far into the context is visible but small
    assert dev[0][:, causal[0]].max() > 1e-5
    assert bound[:, :, causal[0]].max() < 0.01

  # and the model outputs agree to the same order (bf16 activations round on the way)
  atol = 2e-3 if dtype == "float32" else 0.1
  np.testing.assert_allclose(logits_emul, logits_native, atol=atol)


@pytest.mark.parametrize("order", [1, 3])
def test_decoder_with_bf16_keeps_float32_keys_in_the_cache(order):
  cfg = ModelConfig(**TINY, pos_encoding="rope_alibi", dtype="bfloat16", rope_alibi_order=order)
  cache = init_cache(cfg, batch_size=1, max_len=16)
  assert all(k.dtype == jnp.float32 and k.shape[-1] == H + 2 * order for k in cache.k)
  assert all(v.dtype == jnp.bfloat16 for v in cache.v)


def test_cached_decoding_matches_full_forward_for_order_two():
  cfg = ModelConfig(**TINY, pos_encoding="rope_alibi", rope_alibi_order=2)
  model = Decoder(cfg, rngs=nnx.Rngs(3))
  tokens = jax.random.randint(jax.random.key(4), (1, 10), 0, 64)
  run = nnx.jit(lambda model, tokens, cache: model(tokens, cache=cache))
  full = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
  cache = init_cache(cfg, batch_size=1, max_len=10)
  out, cache = run(model, tokens[:, :8], cache)  # prefill
  steps = [out]
  for t in range(8, 10):  # then one token at a time
    out, cache = run(model, tokens[:, t : t + 1], cache)
    steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-4)
