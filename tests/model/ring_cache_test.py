"""Issue 47: the ring-buffer KV cache of windowed layers (``jaxpe.model.ring_cache``) against full
recomputation without a cache (the decoder's windowed self-attention over the whole sequence, a
separate code path), across several wraps of the ring, chunk sizes 1..5, left padding, GQA, and
sliding + full + chunked layers with attention soft-capping; its memory is O(window)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpe.model import Decoder, init_cache
from jaxpe.model.cache import layer_slots
from jaxpe.model.config import ModelConfig
from jaxpe.model.generate import generate
from jaxpe.model.ring_cache import ring_slot_index

BASE = dict(vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2, max_len=64, init_std=0.3)
MIXED = dict(
  BASE,
  num_layers=3,
  layer_types=("sliding_attention", "full_attention", "chunked_attention"),
  sliding_window=4,
  attention_chunk_size=5,
  attn_logit_softcapping=5.0,
)


def _data(batch=2, t_len=23):
  tokens = np.random.default_rng(0).integers(0, 32, (batch, t_len))
  mask = np.ones((batch, t_len), bool)
  mask[1, :3] = False
  return tokens, mask


def test_ring_slot_index_is_the_last_slot_written_to_each_ring_slot():
  for ring in (1, 3, 4):
    for end in range(0, 13):
      held = {}  # ring slot -> sequence slot, simulated write by write
      for g in range(end):
        held[g % ring] = g
      got = np.asarray(ring_slot_index(np.int32(end), 2, ring))
      want = [held.get(j, end + 2 + j) for j in range(ring)]
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunks", [(5, 1, 3, 1, 1, 3, 1, 3, 1, 1, 3)])  # two compiled chunk shapes
def test_cached_chunks_equal_the_full_forward_across_wraps(chunks):
  cfg = ModelConfig(**MIXED)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  tokens, mask = _data()
  full = np.asarray(model(tokens, attention_mask=mask))
  cache = init_cache(cfg, 2, tokens.shape[1])
  assert [c.shape[2] for c in cache.k] == [3, 23, 4]  # rings of w - 1 and C - 1 slots
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda st, t, m, c: nnx.merge(graphdef, st)(t, attention_mask=m, cache=c))
  outs, at = [], 0
  for n in chunks:
    call = step if at else (lambda st, t, m, c: model(t, attention_mask=m, cache=c))  # prefill eager
    logits, cache = call(state, tokens[:, at : at + n], mask[:, at : at + n], cache)
    outs.append(np.asarray(logits))
    at += n
  got = np.concatenate(outs, axis=1)
  assert np.abs(got - full)[mask].max() < 1e-5
  # the windows act: without them the logits differ (the test can fail)
  plain = Decoder(ModelConfig(**{**BASE, "num_layers": 3, "attn_logit_softcapping": 5.0}), rngs=nnx.Rngs(0))
  assert np.abs(np.asarray(plain(tokens, attention_mask=mask)) - full)[mask].max() > 1e-3


def test_generate_on_a_ring_cache_equals_greedy_full_recomputation():
  cfg = ModelConfig(**{**BASE, "num_layers": 2, "sliding_window": 3})
  model = Decoder(cfg, rngs=nnx.Rngs(1))
  tokens, mask = _data(t_len=5)
  got = np.asarray(generate(model, tokens, attention_mask=mask, max_new_tokens=9))
  # no cache: the whole sequence again for every token (right padding to one length: causal, so the
  # real tokens' logits do not see it; one compiled forward)
  seq, m = np.zeros((2, 14), np.int32), np.zeros((2, 14), bool)
  seq[:, :5], m[:, :5] = tokens, mask
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda st, t, k: nnx.merge(graphdef, st)(t, attention_mask=k))
  for i in range(5, 14):
    seq[:, i] = np.argmax(np.asarray(forward(state, seq, m))[:, i - 1], axis=-1)
    m[:, i] = True
  np.testing.assert_array_equal(got, seq[:, 5:])


def test_ring_memory_does_not_grow_with_the_cache():
  cfg = ModelConfig(**MIXED)
  assert layer_slots(cfg, 10_000) == (3, 10_000, 4)
  assert layer_slots(cfg, 2) == (2, 2, 2)  # a cache shorter than the ring: plain slots
  small, big = (
    jax.eval_shape(lambda: init_cache(cfg, 1, 100)),
    jax.eval_shape(lambda: init_cache(cfg, 1, 5000)),
  )
  assert small.k[0].shape == big.k[0].shape == (1, 2, 3, 8)
  assert small.v[2].shape == big.v[2].shape == (1, 2, 4, 8)
