"""Issue 47's rows of the study: StreamingLLM's evaluation (``rope_streaming``), the Gemma 3 local/global
mix (``local_global``) and Llama 4's chunked attention (``chunked``).

The rows' layer patterns against transformers' own ``Gemma3TextConfig`` / ``Llama4TextConfig`` (layer
types, RoPE bases, NoPE layers, temperature); the streaming evaluation against independent references:
with sinks, a one-layer model's score of every token equals a plain forward over the window a numpy
reference picks from the paper's cache (the first ``start_size`` tokens and the last ``recent_size``,
at positions 0, 1, ...); without sinks, on a deeper model, it equals the same weights run as a
sliding-window model (every distance is then the true one); the two trained rows take a few Adam steps
on tiny shapes; and a tiny study scores the streaming row on the rope weights (at 1x it is the rope row:
nothing is evicted within the training length)."""

import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from study_test import text_file, tiny_study  # noqa: F401  (text_file is a fixture)
from transformers import Gemma3TextConfig, Llama4TextConfig

from jaxpe import study
from jaxpe.model import Decoder
from jaxpe.model.build import model_params
from jaxpe.model.config import ModelConfig
from jaxpe.model.pattern_options import rope_config
from jaxpe.study import retrieval_run, run
from jaxpe.train.config import TrainConfig


def _study(layers: int, seq_len: int = 64) -> study.StudyConfig:
  return study.StudyConfig(
    train=TrainConfig(model=ModelConfig(d_model=16, num_layers=layers, num_heads=2), seq_len=seq_len)
  )


@pytest.mark.parametrize("layers", [2, 12])
def test_pattern_rows_are_gemma3_and_llama4_layouts(layers):
  cfg = _study(layers)
  local = study.model_train_config(cfg, "local_global").model
  # Gemma 3: 5 local : 1 global (its default pattern 6) where L allows; 1 : 1 in the study's 2 layers
  gemma = Gemma3TextConfig(num_hidden_layers=layers, **({"sliding_window_pattern": 2} if layers < 6 else {}))
  assert [local.layer_pattern(i).layer_type for i in range(layers)] == list(gemma.layer_types)
  bases = {k: v["rope_theta"] for k, v in gemma.rope_parameters.items()}  # sliding 10k, full 1M
  assert [rope_config(local, i).rope_theta for i in range(layers)] == [bases[t] for t in gemma.layer_types]
  windows = {local.layer_pattern(i).local_window_size for i in range(layers)}
  assert windows == {(15, 0), None}  # window T / 4 = 16 tokens, counting the query

  chunked = study.model_train_config(cfg, "chunked").model
  # Llama 4: every 4th layer NoPE and global, the RoPE layers chunked; 1 : 1 in 2 layers
  llama = Llama4TextConfig(num_hidden_layers=layers, no_rope_layer_interval=min(4, layers))
  assert [chunked.layer_pattern(i).layer_type for i in range(layers)] == list(llama.layer_types)
  assert list(chunked.rope_layers()) == [bool(x) for x in llama.no_rope_layers]  # 1 = rotates
  assert {chunked.layer_pattern(i).chunk_size for i in range(layers)} == {16, None}
  assert chunked.attn_temperature_tuning and chunked.attn_scale == llama.attn_scale
  assert chunked.floor_scale == 16.0  # Llama 4's floor_scale is its chunk (8192); here T / 4
  assert study.streaming_sizes(cfg, "rope_streaming") == (4, 60)  # 4 sinks, the cache = T
  assert study.streaming_sizes(cfg, "rope") is None


def _nll(logits: np.ndarray, target: np.ndarray) -> np.ndarray:
  logits = np.asarray(logits, np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return lse - np.take_along_axis(logits, target[..., None], -1)[..., 0]


def _kept(n: int, start: int, recent: int) -> list[int]:
  """The tokens StreamingLLM's cache holds after n tokens (the paper's section 3.2): all while they fit,
  else the first ``start`` and the last ``recent``, in order (their positions are 0, 1, ...)."""
  if n <= start + recent:
    return list(range(n))
  return list(range(start)) + list(range(n - recent, n))


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


BASE = dict(vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2, max_len=64, init_std=0.3)


def test_streaming_scores_equal_a_forward_over_the_window_the_paper_keeps():
  start, recent, t_len = 2, 5, 13
  model = Decoder(ModelConfig(**BASE, num_layers=1), rngs=nnx.Rngs(1))
  rows = np.random.default_rng(0).integers(0, 32, (3, t_len + 1)).astype(np.int32)
  nll, hits = study.token_scores(model, rows, 2, streaming=(start, recent))  # 2 batches, one padded

  windows = [rows[r, _kept(g + 1, start, recent)] for r in range(3) for g in range(t_len)]
  padded = np.stack([np.pad(w, (0, start + recent - len(w))) for w in windows])  # causal: padding after
  logits = np.asarray(_forward(model, jnp.asarray(padded)), np.float64)
  last = logits[np.arange(len(windows)), [len(w) - 1 for w in windows]].reshape(3, t_len, -1)
  np.testing.assert_allclose(nll, _nll(last, rows[:, 1:]), rtol=0, atol=2e-5)
  assert (hits == (last.argmax(-1) == rows[:, 1:])).all()


def test_streaming_without_sinks_is_a_sliding_window_on_every_layer():
  recent, t_len = 6, 17
  cfg = ModelConfig(**BASE, num_layers=2)
  model = Decoder(cfg, rngs=nnx.Rngs(2))
  rows = np.random.default_rng(1).integers(0, 32, (4, t_len + 1)).astype(np.int32)
  nll, hits = study.token_scores(model, rows, 4, streaming=(0, recent))
  sliding = Decoder(cfg.model_copy(update={"sliding_window": recent}), rngs=nnx.Rngs(0))
  nnx.update(sliding, nnx.state(model))  # the same weights
  assert model_params(sliding).keys() == model_params(model).keys()
  logits = np.asarray(_forward(sliding, jnp.asarray(rows[:, :-1])), np.float64)
  np.testing.assert_allclose(nll, _nll(logits, rows[:, 1:]), rtol=0, atol=2e-5)
  assert (hits == (logits.argmax(-1) == rows[:, 1:])).all()


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("name", ["local_global", "chunked"])
def test_the_pattern_rows_train_a_few_steps_on_tiny_shapes(name):
  cfg = study.model_train_config(_study(2, seq_len=16), name).model
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  before = model_params(model)
  text = np.random.default_rng(0).integers(0, 256, (2, 2, 17)).astype(np.int32)  # 2 steps of [2, T + 1]
  after = study.finetune(cfg, before, lambda i: text[i], steps=2, learning_rate=1e-2)  # study's Adam
  assert after.keys() == before.keys() and all(np.isfinite(v).all() for v in after.values())
  assert any(not np.array_equal(after[k], before[k]) for k in before)


def test_the_study_scores_the_streaming_row_on_the_rope_weights(tmp_path, text_file, monkeypatch):  # noqa: F811
  # No training (its cost is the trainer's, tested elsewhere): every model "trained" is its config's
  # random init, so what runs is the study's plumbing of the row through perplexity and retrieval.
  def untrained(cfg, tag, fingerprint, progress):
    Path(cfg.workdir).mkdir(parents=True)
    return {"step": 0}

  monkeypatch.setattr(run, "train_model", untrained)
  monkeypatch.setattr(retrieval_run, "train_model", untrained)
  init = lambda cfg: model_params(Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed)))  # noqa: E731
  monkeypatch.setattr(run, "trained_params", init)
  monkeypatch.setattr(retrieval_run, "trained_params", init)
  cfg = tiny_study(tmp_path, text_file).model_copy(update={"encodings": ("rope", "rope_streaming")})
  report = study.run_study(cfg, progress=False)  # (retrieval passes the same argument to score_task)
  assert sorted(report["models"]) == ["rope"]  # the streaming row has no model of its own
  res = report["results"]
  # within the training length nothing is evicted: the streaming row is the rope row
  np.testing.assert_allclose(
    res["rope_streaming"]["1"]["per_window"], res["rope"]["1"]["per_window"], atol=1e-5
  )
  # beyond it the cache evicts: other scores (here from random weights), finite
  assert all(math.isfinite(x) for x in res["rope_streaming"]["2"]["per_window"])
  assert res["rope_streaming"]["2"]["per_window"] != res["rope"]["2"]["per_window"]
  assert "rope_streaming: the rope weights fed one token at a time" in (tmp_path / "study.md").read_text()


@pytest.mark.parametrize(
  "encoding, layers, seq_len, match",
  [
    ("rope_streaming", 2, 4, "4 sink tokens must be fewer than the training length 4"),
    ("local_global", 1, 16, "row local_global needs train.model.num_layers >= 2"),
    ("chunked", 1, 16, "row chunked needs train.model.num_layers >= 2"),
  ],
)
def test_a_row_that_cannot_run_is_refused_by_the_study_config(encoding, layers, seq_len, match):
  """At construction, before any model trains (before: rope_streaming failed after training the
  rope model, chunked at 1 layer when its model was built, local_global at 1 layer silently ran
  one global layer)."""
  train = TrainConfig(model=ModelConfig(d_model=16, num_layers=layers, num_heads=2), seq_len=seq_len)
  with pytest.raises(ValueError, match=match):
    study.StudyConfig(encodings=(encoding,), train=train)
