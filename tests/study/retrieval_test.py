"""The passkey task: construction (the plant where the depth says, lengths exact, the key last), the
scores against independent computations (key bits from token_nll and from a numpy float64 log-softmax
of the model's logits; exact match from logits constructed to be right or wrong), the format-training
batches, the seeds combination against numpy, and a tiny study with retrieval whose emulation check
holds and whose rerun reuses every cache."""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from study_test import text_file, tiny_study  # noqa: F401  (text_file is a fixture)

from jaxpe import study
from jaxpe.model import Decoder
from jaxpe.model.config import ModelConfig
from jaxpe.study import retrieval_run
from jaxpe.train import trainer

TEMPLATE = len(study.PLANT.format(key="00000")) + len(study.PROMPT) + study.KEY_DIGITS


def _filler(b: int, n: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(97, 123, size=(b, n)).astype(np.int32)  # lowercase letters


@pytest.mark.parametrize("length", [TEMPLATE - 1, 64, 200])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_construction(length, depth):
  keys = ["38201", "00017", "99999"]
  filler = _filler(3, length + 9)
  batch = study.passkey_batch(filler, length, depth, keys)
  assert batch.shape == (3, length + 1) and batch.dtype == np.int32
  n = length + 1 - TEMPLATE  # filler bytes in a sample
  start = study.plant_offset(length, depth)
  assert start == round(depth * n)
  for row, key, f in zip(batch, keys, filler):
    text = bytes(row.astype(np.uint8))
    plant = study.PLANT.format(key=key).encode()
    assert text.find(plant) == start  # the plant starts where the depth says (filler has no spaces)
    assert text.endswith((study.PROMPT + key).encode())
    rest = text[:start] + text[start + len(plant) : len(text) - len(study.PROMPT) - 5]
    assert rest == bytes(f[:n].astype(np.uint8))  # the filler, in order, around the plant
  with pytest.raises(ValueError, match="depth must be in"):
    study.passkey_batch(filler, length, 1.5, keys)
  with pytest.raises(ValueError, match="length must be >="):
    study.plant_offset(TEMPLATE - 2, 0.5)
  with pytest.raises(ValueError, match="keys must be 3 strings of 5 digits"):
    study.passkey_batch(filler, length, depth, ["1234", "12345", "12345"])
  with pytest.raises(ValueError, match="filler must be"):
    study.passkey_batch(filler[:, :length], length, depth, keys)


def test_scores_match_token_nll_and_numpy():
  cfg = ModelConfig(d_model=32, num_layers=1, num_heads=2, max_len=64, pos_encoding="rope")
  model = Decoder(cfg, rngs=nnx.Rngs(3))
  keys = study.random_keys(4, seed=1)
  assert all(len(k) == 5 and k.isdigit() for k in keys) and len(set(keys)) > 1
  batch = study.passkey_batch(_filler(4, 80), 64, 0.5, keys)
  got = study.evaluate_passkey(model, _filler(4, 80), 64, (0.5,), keys, batch_size=4)["by_depth"]["0.5"]
  nll = np.asarray(nnx.jit(study.token_nll)(model, jnp.asarray(batch)), np.float64)
  np.testing.assert_allclose(got["per_sample_bits"], -nll[:, -5:].sum(-1) / math.log(2), rtol=1e-5)
  logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(batch[:, :-1])), np.float64)[:, -5:]
  logp = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  want = np.take_along_axis(logp, batch[:, -5:, None].astype(np.int64), -1)[..., 0].sum(-1) / math.log(2)
  np.testing.assert_allclose(got["per_sample_bits"], want, rtol=1e-5)
  assert got["key_bits"] < -5  # an untrained model does not know the key


def test_exact_match_from_constructed_logits():
  keys = ["38201", "11111", "90909"]
  batch = study.passkey_batch(_filler(3, 70), 64, 0.1, keys)
  logits = np.full((3, 64, 256), -5.0, np.float32)
  np.put_along_axis(logits, batch[:, 1:, None].astype(np.int64), 5.0, axis=-1)  # right everywhere
  logits[1, -3, ord("2")] = 6.0  # sample 1: the third key digit's argmax is wrong
  logits[2, -5:, ord("9")] = 4.0  # sample 2: a runner-up only, still right
  bits, exact = jax.jit(study.passkey_scores)(jnp.asarray(logits), jnp.asarray(batch))
  assert np.asarray(exact).tolist() == [True, False, True]
  assert float(bits[1]) < float(bits[0]) < 0


def test_finetune_batch_and_combine_retrieval():
  tokens = np.frombuffer(b"abcdefghij" * 500, np.uint8)
  b = study.finetune_batch(tokens, step=3, seed=0, batch_size=8, seq_len=64, fraction=0.5)
  assert b.shape == (8, 65)
  tails = [bytes(r[-22:].astype(np.uint8)) for r in b]
  assert all(study.PROMPT.encode() in t for t in tails[:4]) and not any(
    study.PROMPT.encode() in t for t in tails[4:]
  )
  np.testing.assert_array_equal(
    b, study.finetune_batch(tokens, step=3, seed=0, batch_size=8, seq_len=64, fraction=0.5)
  )
  rng = np.random.default_rng(0)
  bits = rng.normal(-8, 2, size=(3, 2, 5))  # [S, depths, B]
  exact = rng.random((3, 2, 5)) < 0.4
  per_seed = [
    {
      "accuracy": exact[s].mean(),
      "key_bits": bits[s].mean(),
      "by_depth": {
        d: {
          "accuracy": exact[s, i].mean(),
          "key_bits": bits[s, i].mean(),
          "per_sample_bits": list(bits[s, i]),
        }
        for i, d in enumerate(("0.1", "0.9"))
      },
    }
    for s in range(3)
  ]
  got = retrieval_run.combine_retrieval(per_seed)
  se = lambda x: 1.96 * np.std(x, ddof=1) / math.sqrt(x.size)  # noqa: E731
  np.testing.assert_allclose(got["accuracy"], exact.mean(), rtol=1e-12)
  np.testing.assert_allclose(got["accuracy_ci95_seeds"], se(exact.mean(axis=(1, 2))), rtol=1e-12)
  np.testing.assert_allclose(got["key_bits_ci95_seeds"], se(bits.mean(axis=(1, 2))), rtol=1e-12)
  np.testing.assert_allclose(got["key_bits_ci95"], se(bits.mean(axis=0).reshape(-1)), rtol=1e-12)
  np.testing.assert_allclose(got["by_depth"]["0.9"]["key_bits"], bits[:, 1].mean(), rtol=1e-12)
  assert retrieval_run.combine_retrieval([None, None]) is None


def test_study_with_retrieval(tmp_path, text_file, monkeypatch):  # noqa: F811
  train = trainer.train

  def train_standard(*args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
      return train(*args, **kwargs)

  monkeypatch.setattr(trainer, "train", train_standard)
  base = tiny_study(tmp_path, text_file)
  cfg = base.model_copy(
    update={
      "encodings": ("alibi",),  # one model: the emulation check on retrieval needs it
      "passkey_depths": (0.1, 0.9),
      "passkey_steps": 2,
      "train": base.train.model_copy(update={"seq_len": 64}),
    }
  )
  finetune = retrieval_run.finetune_passkey
  with jax.numpy_dtype_promotion("standard"):
    report = study.run_study(cfg, progress=False)
  r = report["retrieval"]
  assert (
    set(r) == {"alibi"} and set(r["alibi"]) == {"1", "2"} and len(report["retrieval_emulation_check"]) == 4
  )
  assert r["alibi"]["1"]["key_bits"] != r["alibi"]["2"]["key_bits"]
  for e in report["retrieval_emulation_check"]:
    assert e["max_abs_delta_key_bits"] < 0.01 and e["exact_match_disagreements"] == 0, e
  md = (tmp_path / "study.md").read_text()
  assert "## Retrieval (passkey)" in md and "| alibi | " in md.split("## Retrieval")[1]

  def no_finetune(*args, **kwargs):
    raise AssertionError("format training ran again")

  monkeypatch.setattr(retrieval_run, "finetune_passkey", no_finetune)
  again = study.run_study(cfg, progress=False)
  assert again["retrieval"] == r
  monkeypatch.setattr(retrieval_run, "finetune_passkey", finetune)


def test_position_interpolation_arm(tmp_path, text_file, monkeypatch):  # noqa: F811
  """rope_pi_ft: evaluated with linear factor M = max(eval_multiples) at every length, on the rope
  weights fine-tuned with that factor at length M T and batch B // M (PI's recipe), cached apart from
  rope's own format training."""
  cfg = tiny_study(tmp_path, text_file).model_copy(
    update={"encodings": ("rope", "rope_pi_ft"), "eval_multiples": (1, 2, 4), "passkey_steps": 3}
  )
  for m in cfg.eval_multiples:
    mc = study.eval_model_config(cfg, "rope_pi_ft", m)
    assert mc.rope_scaling.rope_type == "linear" and mc.rope_scaling.factor == 4.0, mc.rope_scaling
    assert mc.max_len == 4 * cfg.train.seq_len
  assert study.eval_model_config(cfg, "rope", 4).rope_scaling is None
  assert (
    retrieval_run.tuned_name("rope_pi_ft") == "rope_pi_ft" and retrieval_run.tuned_name("rope_yarn") == "rope"
  )

  calls = []

  def fake_finetune(model_cfg, params, tokens, **kw):
    calls.append((model_cfg, kw))
    return {"w": np.full(2, len(calls), np.float32)}

  monkeypatch.setattr(retrieval_run, "finetune_passkey", fake_finetune)
  monkeypatch.setattr(retrieval_run, "trained_params", lambda c: {"w": np.zeros(2, np.float32)})
  tokens = np.arange(1000, dtype=np.uint8)
  Path(study.model_train_config(cfg, "rope").workdir).mkdir(parents=True)  # the trained rope run's
  pi = retrieval_run.finetuned_params(cfg, "rope_pi_ft", 0, tokens, progress=False)
  own = retrieval_run.finetuned_params(cfg, "rope", 0, tokens, progress=False)
  (pi_cfg, pi_kw), (rope_cfg, rope_kw) = calls
  t = cfg.train
  assert (pi_kw["seq_len"], pi_kw["batch_size"]) == (4 * t.seq_len, t.batch_size // 4)
  assert (rope_kw["seq_len"], rope_kw["batch_size"]) == (t.seq_len, t.batch_size)
  assert pi_cfg.rope_scaling.factor == 4.0 and rope_cfg.rope_scaling is None
  assert pi_kw["steps"] == rope_kw["steps"] == 3 and pi_kw["learning_rate"] == rope_kw["learning_rate"]
  assert pi["w"][0] == 1 and own["w"][0] == 2  # two caches, neither overwrote the other
  again = retrieval_run.finetuned_params(cfg, "rope_pi_ft", 0, tokens, progress=False)
  assert len(calls) == 2 and again["w"][0] == 1  # read back from its cache


def test_passkey_lengths_checked_at_config():
  """Passkey samples need 31 bytes: a study whose retrieval or rope_pi_ft fine-tuning length is shorter
  fails when configured, naming the key, not after training every model."""
  with pytest.raises(
    ValueError, match=r"train.seq_len is too short for passkey samples: length must be >= 31"
  ):
    study.StudyConfig(
      passkey_depths=(0.5,), train=study.StudyConfig().train.model_copy(update={"seq_len": 16})
    )
  short = study.StudyConfig().train.model_copy(update={"seq_len": 8})
  with pytest.raises(ValueError, match=r"rope_pi_ft's fine-tuning length\) is too short"):
    study.StudyConfig(encodings=("rope", "rope_pi_ft"), eval_multiples=(1, 2), train=short)
  study.StudyConfig(encodings=("rope", "rope_pi_ft"), eval_multiples=(1, 4), train=short)  # 32 bytes
  study.StudyConfig(encodings=("rope", "rope_pi_ft"), eval_multiples=(1, 2), passkey_steps=0, train=short)
