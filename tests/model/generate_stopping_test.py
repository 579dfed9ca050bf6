"""``generate``'s top-p sampling and stop tokens (issue 48): the warped distribution against
transformers' ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper`` (the order
its ``generate`` applies them), stopping against an unstopped run of the same model cut by hand, and
BLOOM's greedy generation with ``eos_token_id`` / ``pad_token_id`` against transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.model.generate import generate, warp_logits

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _hf_warped(logits, temperature, top_k, top_p):
  """transformers' processed scores ``[B, V]`` float64 (``-inf`` = removed)."""
  from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
  )

  warpers = LogitsProcessorList()
  if temperature != 1.0:
    warpers.append(TemperatureLogitsWarper(temperature))
  if top_k is not None:
    warpers.append(TopKLogitsWarper(top_k))
  if top_p is not None and top_p < 1.0:
    warpers.append(TopPLogitsWarper(top_p))
  scores = torch.from_numpy(np.asarray(logits, np.float32))
  return warpers(torch.zeros((logits.shape[0], 1), dtype=torch.long), scores).double().numpy()


def _probs(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize(
  "temperature, top_k, top_p",
  [(1.0, None, 0.9), (0.7, None, 0.5), (1.3, 20, 0.8), (1.0, 5, 0.99), (2.0, None, 0.05), (0.5, None, 1.0)],
)
def test_top_p_keeps_the_ids_and_distribution_of_transformers_warpers(temperature, top_k, top_p):
  rng = np.random.default_rng(7)
  logits = rng.normal(scale=3.0, size=(6, 64)).astype(np.float32)  # no ties
  ours = np.asarray(warp_logits(jnp.asarray(logits), temperature, top_k, top_p), np.float64)
  ref = _hf_warped(logits, temperature, top_k, top_p)
  np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))  # the same ids kept
  np.testing.assert_allclose(_probs(ours), _probs(ref), atol=1e-6)
  kept = np.isfinite(ours).sum(axis=-1)
  if top_p < 0.99:
    assert (kept < (top_k or 64)).all() and (kept > 1).any() or top_p < 0.1  # not vacuous


def test_top_p_keeps_the_most_probable_id_even_below_its_mass():
  logits = jnp.asarray([[5.0, 1.0, 0.0, -1.0]])
  kept = np.isfinite(np.asarray(warp_logits(logits, 1.0, None, 1e-9)))
  np.testing.assert_array_equal(kept, [[True, False, False, False]])


def test_sampled_tokens_stay_in_the_nucleus():
  cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=4, init_std=0.5)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  prompt = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  a = generate(model, prompt, max_new_tokens=6, temperature=1.0, top_p=1e-6, rng=jax.random.key(3))
  np.testing.assert_array_equal(a, generate(model, prompt, max_new_tokens=6))  # one id: greedy
  b = generate(model, prompt, max_new_tokens=6, temperature=1.0, top_p=0.6, rng=jax.random.key(3))
  np.testing.assert_array_equal(
    b, generate(model, prompt, max_new_tokens=6, temperature=1.0, top_p=0.6, rng=jax.random.key(3))
  )


def _cut(row, stops, pad):
  """A row of an unstopped run as stopping leaves it: the tokens up to and including the first
  stop token, ``pad`` after."""
  out, done = [], False
  for t in row:
    out.append(pad if done else t)
    done = done or t in stops
  return out


@pytest.mark.parametrize("sample", [False, True])
def test_stop_tokens_end_each_row_and_pad_after(sample):
  """Each row ends at its own first stop token (kept) and holds pad_token_id after; rows that never
  stop run to max_new_tokens; the tokens before a stop are the unstopped run's (greedy, and sampled
  with the same key: stopping draws nothing extra)."""
  cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4, init_std=0.5, pos_encoding="rope")
  model = Decoder(cfg, rngs=nnx.Rngs(2))
  prompt = jnp.asarray([[3, 1, 4, 1], [0, 9, 2, 6], [5, 3, 5, 8]], jnp.int32)
  mask = jnp.asarray([[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], bool)
  kw = dict(attention_mask=mask, max_new_tokens=10)
  if sample:
    kw.update(temperature=1.0, rng=jax.random.key(4))
  free = np.asarray(generate(model, prompt, **kw)).tolist()
  stops = (free[0][2], free[1][5])  # row 0 stops at step 2, row 1 at its first of either
  assert not set(free[2][:3]) & set(stops) or True
  for pad_token_id, pad in ((None, stops[0]), (31, 31)):
    got = np.asarray(generate(model, prompt, stop_tokens=list(stops), pad_token_id=pad_token_id, **kw))
    assert got.shape == (3, 10) and got.dtype == np.int32
    assert got.tolist() == [_cut(r, stops, pad) for r in free]
  assert _cut(free[0], stops, 31) != free[0]  # the check is not vacuous
  # one id, as an int or a numpy int
  one = np.asarray(generate(model, prompt, stop_tokens=np.int64(stops[0]), **kw))
  assert one.tolist() == [_cut(r, (stops[0],), stops[0]) for r in free]


def test_generation_ends_when_every_row_has_stopped():
  """No decode step runs once every row has stopped: a stop token that greedy decoding emits first
  ends a 4000-token request at the cost of a few steps (the loop runs while a row is live)."""
  import time

  cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=4, init_std=0.5, max_len=8192)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  prompt = jnp.asarray([[1, 2, 3]], jnp.int32)
  first = int(generate(model, prompt, max_new_tokens=1)[0, 0])
  generate(model, prompt, max_new_tokens=4000, stop_tokens=first)  # compile
  start = time.perf_counter()
  out = np.asarray(generate(model, prompt, max_new_tokens=4000, stop_tokens=first))
  stopped = time.perf_counter() - start
  assert out[0, 0] == first and (out[0, 1:] == first).all()  # padded with the stop token
  generate(model, prompt, max_new_tokens=4000, stop_tokens=31 if first != 31 else 30)  # compile
  start = time.perf_counter()
  generate(model, prompt, max_new_tokens=4000, stop_tokens=31 if first != 31 else 30)
  assert stopped < (time.perf_counter() - start) / 3  # not a speed goal: the steps did not run


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_p": float("nan")}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_p": "0.9"}, TypeError, "top_p must be None or a Python number"),
    ({"top_p": True}, TypeError, "top_p must be None or a Python number"),
    ({"stop_tokens": 16}, ValueError, r"stop_tokens must be token ids in \[0, vocab_size=16\)"),
    ({"stop_tokens": [-1]}, ValueError, "stop_tokens must be token ids"),
    ({"stop_tokens": []}, ValueError, "stop_tokens must name at least one token id"),
    ({"stop_tokens": [1.0]}, TypeError, "stop_tokens must be token ids"),
    ({"stop_tokens": "2"}, TypeError, "stop_tokens must be token ids"),
    ({"pad_token_id": 0}, ValueError, "pass stop_tokens too"),
    ({"stop_tokens": 1, "pad_token_id": 16}, ValueError, "pad_token_id must be token ids in"),
  ],
)
def test_bad_sampling_and_stopping_arguments_are_named(kwargs, error, match):
  model = Decoder(ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
  with pytest.raises(error, match=match):
    generate(model, jnp.zeros((1, 2), jnp.int32), max_new_tokens=2, **kwargs)


def test_bloom_greedy_generation_with_eos_matches_transformers():
  """A BLOOM model built from its config (nothing downloaded), imported into jaxpe: greedy decoding
  with an eos token and a pad token gives transformers' generate, left-padded rows included
  (transformers stops when every row has finished, so its output may be shorter: the columns it
  has are compared, the rest must be padding)."""
  from jaxpe import bloom

  config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
  torch.manual_seed(0)
  hf = transformers.BloomForCausalLM(config).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.mul_(8.0)  # a random model whose argmax changes from step to step
  ours_model = bloom.from_hf(hf)
  rng = np.random.default_rng(3)
  prompt = rng.integers(1, 64, (3, 6))
  mask = np.ones((3, 6), np.int64)
  mask[1, :2] = 0
  prompt[1, :2] = 0
  free = np.asarray(
    generate(ours_model, jnp.asarray(prompt), attention_mask=jnp.asarray(mask), max_new_tokens=12)
  )
  eos = int(free[0, 3])
  ours = np.asarray(
    generate(
      ours_model,
      jnp.asarray(prompt),
      attention_mask=jnp.asarray(mask),
      max_new_tokens=12,
      stop_tokens=eos,
      pad_token_id=0,
    )
  )
  with torch.no_grad():
    ref = hf.generate(
      torch.as_tensor(prompt),
      attention_mask=torch.as_tensor(mask),
      max_new_tokens=12,
      do_sample=False,
      eos_token_id=eos,
      pad_token_id=0,
    )[:, 6:].numpy()
  np.testing.assert_array_equal(ours[:, : ref.shape[1]], ref)
  assert (ours[:, ref.shape[1] :] == 0).all()
  at = int(np.flatnonzero(free[0] == eos)[0])  # row 0 stopped: the check is not vacuous
  assert at <= 3 and ours[0, at] == eos and (ours[0, at + 1 :] == 0).all()
