"""Issue 47: StreamingLLM's sink tokens + recent window (``generate(streaming=(start_size,
recent_size))``, ``jaxpe.model.streaming``; Xiao et al., arXiv 2309.17453) against an independent
reference: at every step a full forward without a cache (the decoder's plain call) over [the first
``start_size`` tokens, the last ``recent_size`` tokens] at positions ``0 .. s + r - 1``, greedy; past
several wraps of the window, with GQA and a prompt longer than the cache (one layer: exact; deeper
models in streaming_layers_test.py). Its memory is constant; the configurations it does not run are
refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model import Decoder
from jaxpe.model.config import ModelConfig
from jaxpe.model.generate import generate
from jaxpe.model.streaming import StreamingCache, init_streaming_cache

BASE = dict(vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2, max_len=64, init_std=0.3)


@nnx.jit
def _forward(model, tokens, last):
  return model(tokens)[:, last]


@nnx.jit
def _step(model, tokens, cache):
  logits, cache = model(tokens, cache=cache)
  return logits[:, -1], cache


def _reference(model, prompt, steps, start, recent):
  """Greedy tokens and each step's logits ``[B, V]`` from a fresh forward over the sinks + window."""
  seq, tokens, logits = np.asarray(prompt), [], []
  for _ in range(steps):
    window = seq if seq.shape[1] <= start + recent else np.concatenate([seq[:, :start], seq[:, -recent:]], 1)
    # right-padded to one length: one compiled forward (the model is causal)
    padded = np.pad(window, ((0, 0), (0, start + recent - window.shape[1])))
    out = np.asarray(_forward(model, jnp.asarray(padded), window.shape[1] - 1))
    logits.append(out)
    tokens.append(out.argmax(-1))
    seq = np.concatenate([seq, tokens[-1][:, None]], 1)
  return np.stack(tokens, 1), np.stack(logits, 1)


OPTIONS = dict(  # learned sinks, both soft-caps, YaRN scaling, rotate-half layout, partial rotation
  attention_sinks=True,
  attn_logit_softcapping=5.0,
  final_logit_softcapping=3.0,
  rope_layout="half",
  rotary_dim=4,
  rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
)


@pytest.mark.parametrize("start,recent,t_len,extra", [(2, 5, 4, {}), (0, 7, 11, {}), (2, 5, 11, OPTIONS)])
def test_one_layer_streaming_equals_a_fresh_forward_over_sinks_and_window(start, recent, t_len, extra):
  model = Decoder(ModelConfig(**BASE, num_layers=1, **extra), rngs=nnx.Rngs(0))
  prompt = np.random.default_rng(t_len).integers(0, 32, (2, t_len)).astype(np.int32)
  steps = 3 * recent + 2  # several wraps of the window
  want_tokens, want_logits = _reference(model, prompt, steps, start, recent)

  got = np.asarray(generate(model, prompt, max_new_tokens=steps, streaming=(start, recent)))
  np.testing.assert_array_equal(got, want_tokens)

  # the same, step by step through the decoder on a StreamingCache: logits within float32 rounding
  cache = init_streaming_cache(model.cfg, 2, start, recent)
  first = min(t_len, start + recent)
  logits, cache = model(jnp.asarray(prompt[:, :first]), cache=cache)
  logits = logits[:, -1]
  for i in range(first, t_len):
    logits, cache = _step(model, jnp.asarray(prompt[:, i : i + 1]), cache)
  worst = 0.0
  for i in range(steps):
    worst = max(worst, float(np.max(np.abs(np.asarray(logits) - want_logits[:, i]))))
    logits, cache = _step(model, jnp.asarray(want_tokens[:, i : i + 1]), cache)
  print(f"s={start} r={recent} T={t_len}: max |dlogit| {worst:.2e}")
  assert worst < 1e-5


def test_streaming_memory_is_constant_past_several_wraps():
  model = Decoder(ModelConfig(**BASE, num_layers=2), rngs=nnx.Rngs(0))
  cache = init_streaming_cache(model.cfg, 1, 2, 3)
  shapes = jax.tree.map(jnp.shape, cache)
  assert [x.shape for x in cache.k + cache.v] == [(1, 2, 5, 8)] * 4  # [B, K, s + r, H]
  for i in range(4 * 3):
    _, cache = _step(model, jnp.asarray([[i % 32]]), cache)
    assert jax.tree.map(jnp.shape, cache) == shapes
  assert int(cache.end) == 12


@pytest.mark.parametrize(
  "extra,match",
  [
    (dict(pos_encoding="alibi"), "pos_encoding='rope' only, got pos_encoding='alibi'"),
    (dict(pos_encoding="learned"), "pos_encoding='rope' only, got pos_encoding='learned'"),
    (dict(pos_encoding="xpos"), "pos_encoding='rope' only, got pos_encoding='xpos'"),
    (dict(pos_encoding="rope_alibi"), "pos_encoding='rope' only, got pos_encoding='rope_alibi'"),
    (dict(sliding_window=3), "layer 0 is 'sliding_attention'"),
    (dict(attention_chunk_size=3), "layer 0 is 'chunked_attention'"),
  ],
)
def test_streaming_refuses_models_it_does_not_run_by_name(extra, match):
  model = Decoder(ModelConfig(**{**BASE, "num_layers": 1, **extra}), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
    generate(model, np.zeros((1, 3), np.int32), max_new_tokens=2, streaming=(1, 2))


def test_streaming_refuses_bad_sizes_padding_and_chunks_past_an_eviction():
  model = Decoder(ModelConfig(**BASE, num_layers=1), rngs=nnx.Rngs(0))
  prompt = np.zeros((2, 3), np.int32)
  for bad, err, match in [
    ((-1, 3), ValueError, "start_size .* >= 0, got -1"),
    ((2, 0), ValueError, "recent_size .* >= 1, got 0"),
    ((2.0, 3), TypeError, "streaming must be \\(start_size, recent_size\\)"),
    (4, TypeError, "streaming must be"),
  ]:
    with pytest.raises(err, match=match):
      generate(model, prompt, max_new_tokens=2, streaming=bad)
  mask = np.ones((2, 3), bool)
  mask[0, 0] = False
  with pytest.raises(ValueError, match="streaming runs rows without padding"):
    generate(model, prompt, max_new_tokens=2, attention_mask=mask, streaming=(1, 2))
  cache = init_streaming_cache(model.cfg, 2, 1, 2)
  with pytest.raises(ValueError, match="chunk of T = 4 > 1 tokens only before any eviction"):
    model(np.zeros((2, 4), np.int32), cache=cache)
  with pytest.raises(ValueError, match="attention_mask cannot be combined with a StreamingCache"):
    model(prompt, attention_mask=np.ones((2, 3), bool), cache=cache)
  with pytest.raises(ValueError, match=r"cache.k\[0\] must be"):
    model(prompt[:1], cache=cache)
  assert isinstance(cache, StreamingCache)
