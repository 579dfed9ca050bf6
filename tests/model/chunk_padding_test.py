"""Issue 47: a decoder's chunked layers (Llama 4's ``attention_chunk_size``) count chunks from each
row's first real token, as transformers: a left-padded row, a packed document and a cached
continuation (the chunked layer's ring cache) give the logits of the same tokens alone, unpadded
(a separate computation: no padding, no packing, one row)."""

import jax
import numpy as np
from flax import nnx

from jaxpe.model import Decoder, init_cache
from jaxpe.model.config import ModelConfig

CFG = dict(
  vocab_size=32,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  max_len=64,
  init_std=0.3,
  num_layers=2,
  layer_types=("chunked_attention", "full_attention"),
  attention_chunk_size=4,
)
PAD, T = 3, 14


def _model():
  """The model and its jitted forward ``fwd(tokens, attention_mask, segment_ids)`` (eager calls
  dispatch op by op: slow)."""
  model = Decoder(ModelConfig(**CFG), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  call = jax.jit(lambda st, t, m, s: nnx.merge(graphdef, st)(t, attention_mask=m, segment_ids=s))
  return model, lambda t, m=None, s=None: np.asarray(call(state, t, m, s))


def _alone(fwd, rows):
  """Logits of each token list alone, from slot 0 (right padding to T: causal, unseen), one call."""
  tokens, mask = np.zeros((len(rows), T), np.int64), np.zeros((len(rows), T), bool)
  for i, r in enumerate(rows):
    tokens[i, : len(r)], mask[i, : len(r)] = r, True
  out = fwd(tokens, mask)
  return [out[i, : len(r)] for i, r in enumerate(rows)]


def test_left_padded_and_packed_rows_equal_the_tokens_alone():
  _, fwd = _model()
  tokens = np.random.default_rng(0).integers(0, 32, (2, T))
  mask = np.ones((2, T), bool)
  mask[1, :PAD] = False
  padded = fwd(tokens, mask)
  seg = np.repeat([[1, 2]], [6, 8], axis=1)  # packed: documents of 6 and 8 tokens
  packed = fwd(np.concatenate([tokens[:1]] * 3), None, np.concatenate([seg] * 3))
  row, doc1, doc2 = _alone(fwd, [tokens[1, PAD:], tokens[0, :6], tokens[0, 6:]])
  assert np.abs(padded[1, PAD:] - row).max() < 1e-5
  assert np.abs(packed[0, :6] - doc1).max() < 1e-5
  assert np.abs(packed[0, 6:] - doc2).max() < 1e-5


def test_cached_continuation_of_a_left_padded_row_past_chunks():
  model, fwd = _model()
  tokens = np.random.default_rng(1).integers(0, 32, (2, T))
  mask = np.ones((2, T), bool)
  mask[1, :PAD] = False
  cache = init_cache(model.cfg, 2, T)
  assert cache.k[0].shape[2] == 3  # the chunked layer's ring: C - 1 slots
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda st, t, m, c: nnx.merge(graphdef, st)(t, attention_mask=m, cache=c))
  logits, cache = step(state, tokens[:, :5], mask[:, :5], cache)  # the prefill (a traced end)
  outs = [np.asarray(logits)]
  for i in range(5, T):  # one token at a time, across two chunk boundaries of row 1
    logits, cache = step(state, tokens[:, i : i + 1], mask[:, i : i + 1], cache)
    outs.append(np.asarray(logits))
  got = np.concatenate(outs, axis=1)
  row0, row1, _ = _alone(fwd, [tokens[0], tokens[1, PAD:], tokens[0, :1]])
  assert np.abs(got[0] - row0).max() < 1e-5
  assert np.abs(got[1, PAD:] - row1).max() < 1e-5
