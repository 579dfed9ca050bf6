"""A tiny train-short-test-long study: outputs, a learned table marked n/a beyond its size, a rerun that
retrains nothing, an interrupted model stopping the study, one table entry recomputed
independently (numpy float64 log-softmax over the model's logits, windows cut by hand), and several
seeds (the combined entries and paired differences against numpy; a two-seed study whose seed-0 model
keeps the first edition's directory and whose rerun trains nothing)."""

import json
import math
import re
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe import study
from jaxpe.model.config import ModelConfig
from jaxpe.train import checkpoint, data, trainer
from jaxpe.train.config import DataConfig, TrainConfig


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
  root = Path(sysconfig.get_paths()["stdlib"])
  text = b"".join((root / name).read_bytes() for name in ("argparse.py", "textwrap.py", "shlex.py"))
  path = tmp_path_factory.mktemp("data") / "corpus.txt"
  path.write_bytes(text[:150_000])
  return str(path)


def tiny_study(workdir: Path, text_file: str) -> study.StudyConfig:
  return study.StudyConfig(
    workdir=str(workdir),
    encodings=("learned", "rope", "rope_linear"),
    eval_multiples=(1, 2),
    eval_windows=4,
    eval_batch_size=8,
    train=TrainConfig(
      model=ModelConfig(d_model=32, num_layers=1, num_heads=2),
      data=DataConfig(path=text_file, max_bytes=150_000, eval_fraction=0.1),
      seq_len=16,
      batch_size=8,  # the suite has 8 CPU devices on the data axis
      num_steps=3,
      warmup_steps=1,
      eval_every=1000,
      eval_batches=1,
      checkpoint_every=1000,
      sample_len=0,
    ),
  )


def test_study_outputs_resume_and_recomputation(tmp_path, text_file, monkeypatch, capsys):
  # optax's Adam mixes Python floats with int32 step counts, which strict promotion (conftest) rejects:
  # training runs under standard promotion (as in trainer_test.py), the study's evaluation under strict.
  train = trainer.train

  def train_standard(*args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
      return train(*args, **kwargs)

  monkeypatch.setattr(trainer, "train", train_standard)
  cfg = tiny_study(tmp_path, text_file)
  report = study.run_study(cfg, progress=False)
  assert set(report["models"]) == {"learned", "rope"}  # rope_linear evaluates the rope weights
  for name in ("study.md", "study.json", "bits_per_byte.png", "loss_vs_position.png"):
    assert (tmp_path / name).stat().st_size > 0
  md = (tmp_path / "study.md").read_text()
  assert report["results"]["learned"]["2"] is None
  assert "| learned | " in md and "| n/a (table 16) |" in md
  assert json.loads((tmp_path / "study.json").read_text())["results"] == report["results"]

  # Rerun: nothing is trained (trainer.train would fail) and the numbers are the same.
  def no_training(*args, **kwargs):
    raise AssertionError("a finished model was trained again")

  monkeypatch.setattr(trainer, "train", no_training)
  outputs = sorted(p for p in tmp_path.rglob("*") if p.is_file() and "xla_cache" not in p.parts)
  before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in outputs}
  capsys.readouterr()
  again = study.run_study(cfg, progress=False)
  assert again["results"] == report["results"]
  assert not any(m["trained_now"] for m in again["models"].values())
  # Issue 48: a rerun that trains and evaluates nothing writes nothing (main rewrote study.json, study.md
  # and the plots with a new date): every file but XLA's compilation cache is as it was.
  assert "[study] nothing changed: study.json, study.md, bits_per_byte.png, loss_vs_position.png in" in (
    capsys.readouterr().out
  )
  after = sorted(p for p in tmp_path.rglob("*") if p.is_file() and "xla_cache" not in p.parts)
  assert after == outputs and {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in after} == before

  # A damaged evaluation cache is named, recomputed and rewritten (was a JSONDecodeError naming no file).
  cache = tmp_path / "models" / "rope" / "eval_rope_linear.json"
  cache.write_text('{"key": ')
  again = study.run_study(cfg, progress=False)
  err = capsys.readouterr().err
  assert f"[study] warning: cannot read {cache} (JSONDecodeError: " in err and "evaluated again" in err, err
  assert again["results"] == report["results"] and json.loads(cache.read_text())["results"]

  # Independent recomputation of rope + linear interpolation at 2x: windows cut by hand, the rope
  # weights under a hand-written linear-scaling config, float64 log-softmax in numpy.
  t, w = 16, 4
  corpus = data.load_corpus(text_file, max_bytes=150_000, eval_fraction=0.1)
  n = (corpus.eval.size - 1) // (2 * t)
  starts = np.linspace(0, n - 1, w).astype(np.int64) * (2 * t)
  rope_cfg = study.model_train_config(cfg, "rope")
  model_cfg = ModelConfig.model_validate(
    {**rope_cfg.model.model_dump(), "max_len": 2 * t, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
  )
  # Reading a checkpoint writes nothing and probes nothing: a read-only checkpoint directory loads
  # (was "cannot write checkpoints": the write probe ran for reads too).
  ckpt = Path(rope_cfg.workdir) / "checkpoints"
  before = sorted((str(p), p.stat().st_mtime_ns) for p in ckpt.rglob("*"))

  def no_write(directory):
    raise AssertionError(f"load_trained probed {directory} for writing")

  monkeypatch.setattr(checkpoint, "check_writable", no_write)
  model = study.load_trained(rope_cfg, model_cfg)
  assert sorted((str(p), p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == before
  windows = np.stack([corpus.eval[s : s + 2 * t + 1] for s in starts]).astype(np.int32)
  # [W, 2T, V]; jitted: one compile instead of one per op
  logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(windows[:, :-1])), np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
  logp -= logits.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, windows[:, 1:, None].astype(np.int64), -1)[..., 0]
  per_window = nll.mean(-1) / math.log(2)
  want_mean = per_window.mean()
  want_ci = 1.96 * per_window.std(ddof=1) / math.sqrt(w)
  got = report["results"]["rope_linear"]["2"]
  np.testing.assert_allclose(got["per_window"], per_window, rtol=1e-5)
  np.testing.assert_allclose([got["bits_per_byte"], got["ci95"]], [want_mean, want_ci], rtol=1e-5)
  np.testing.assert_allclose(got["per_position"], nll.mean(0) / math.log(2), rtol=1e-5)
  assert f"| {want_mean:.3f} ± {want_ci:.3f} |" in md.split("| rope + linear interpolation (eval) |")[1]
  # The paired difference from rope (the reference) is the mean of the per-window differences.
  rope_windows = np.asarray(report["results"]["rope"]["2"]["per_window"])
  assert report["paired_reference"] == "rope"
  np.testing.assert_allclose(
    report["paired"]["rope_linear"]["2"]["bits_per_byte"],
    (np.asarray(got["per_window"]) - rope_windows).mean(),
    rtol=1e-9,
  )
  # The scaling changed the numbers (the check could fail): plain rope at 2x differs.
  assert report["results"]["rope"]["2"]["bits_per_byte"] != got["bits_per_byte"]


def test_interrupted_model_stops_the_study(tmp_path, text_file, monkeypatch):
  # The trainer returned before num_steps (stop_at, max_seconds, a signal): nothing is evaluated or
  # written, and the error says a rerun resumes (the trainer's resume is tested in trainer_test.py).
  def stopped(cfg, **kwargs):
    return trainer.TrainResult(2, 0.0, 0.0, 0.0, 0.0, 0.0, "")

  monkeypatch.setattr(trainer, "train", stopped)
  with pytest.raises(study.StudyInterrupted, match="'learned' stopped at step 2 of 3; rerun"):
    study.run_study(tiny_study(tmp_path, text_file), progress=False)
  assert not (tmp_path / "study.json").exists()


def test_config_checks():
  with pytest.raises(ValueError, match="encodings must be distinct names"):
    study.StudyConfig(encodings=("rope", "nope"))
  with pytest.raises(ValueError, match="eval_multiples must start at 1"):
    study.StudyConfig(eval_multiples=(1, 3, 4))
  cfg = study.StudyConfig()
  assert study.model_train_config(cfg, "rope_alibi_k2").model.rope_alibi_context == 8 * cfg.train.seq_len
  assert study.eval_model_config(cfg, "learned", 2) is None
  assert study.eval_model_config(cfg, "rope_dynamic", 1).rope_scaling is None


def test_study_command_line_reports_errors_and_signals_in_one_line(tmp_path, monkeypatch, capsys):
  """train/study.py reports like train/train.py: a config error is one line with status 2, a run
  stopped by SIGTERM says where its checkpoint is with status 143 (it printed a traceback)."""
  from jaxpe.study import cli  # what train/study.py and jaxpe-study run
  from jaxpe.train import run_guard

  assert cli.main(["train.num_steps=0", f"workdir={tmp_path}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("study.py: error: ") and err.count("\n") == 1 and "num_steps" in err, err

  def stopped(cfg):
    raise run_guard.TrainingInterrupted("stopped by SIGTERM at step 7; checkpoint saved", signum=15, step=7)

  monkeypatch.setattr(cli, "run_study", stopped)
  assert cli.main([f"workdir={tmp_path}", "--quick"]) == 143
  err = capsys.readouterr().err
  assert err == "study.py: stopped by SIGTERM at step 7; checkpoint saved\n", err


def _entries(b: np.ndarray) -> list[dict]:
  """Per-seed ``evaluate``-like dicts from ``b [S, W]`` (per_position: a fake 3-position curve)."""
  return [{"per_window": list(row), "per_position": [row.mean(), 2 * row.mean(), 0.0]} for row in b]


def test_combine_and_paired_seeds_match_numpy():
  rng = np.random.default_rng(0)
  b = rng.normal(2.0, 0.3, size=(3, 5))  # S = 3 seeds, W = 5 windows
  r = rng.normal(2.2, 0.3, size=(3, 5))  # the reference row
  got = study.combine_seeds(_entries(b))
  se = lambda x: 1.96 * np.std(x, ddof=1) / math.sqrt(x.size)  # noqa: E731
  np.testing.assert_allclose(got["bits_per_byte"], b.mean(), rtol=1e-12)
  np.testing.assert_allclose(got["ci95"], se(b.mean(axis=0)), rtol=1e-12)
  np.testing.assert_allclose(got["ci95_seeds"], se(b.mean(axis=1)), rtol=1e-12)
  np.testing.assert_allclose(got["per_position"], [b.mean(), 2 * b.mean(), 0.0], rtol=1e-12)
  # the two intervals differ (the check could fail by swapping them)
  assert abs(got["ci95"] - got["ci95_seeds"]) > 1e-3
  by_seed = {"x": [{"1": e, "2": None} for e in _entries(b)], "ref": [{"1": e, "2": e} for e in _entries(r)]}
  p = study.paired_seeds(by_seed, "ref")
  d = b - r
  np.testing.assert_allclose(p["x"]["1"]["bits_per_byte"], d.mean(), rtol=1e-12)
  np.testing.assert_allclose(p["x"]["1"]["ci95"], se(d.mean(axis=0)), rtol=1e-12)
  np.testing.assert_allclose(p["x"]["1"]["ci95_seeds"], se(d.mean(axis=1)), rtol=1e-12)
  assert p["x"]["2"] is None and p["ref"]["1"]["bits_per_byte"] == 0.0
  one = study.combine_seeds(_entries(b[:1]))
  assert one["ci95_seeds"] is None and study.cell(one).count("±") == 1
  assert study.cell(got) == f"{b.mean():.3f} ± {se(b.mean(axis=0)):.3f} / {se(b.mean(axis=1)):.3f}"
  assert study.combine_seeds([None, None]) is None
  with pytest.raises(ValueError, match="all be None or all hold"):
    study.combine_seeds([_entries(b)[0], None])
  with pytest.raises(ValueError, match="at least one seed"):
    study.combine_seeds([])


def test_two_seeds_train_apart_and_resume(tmp_path, text_file, monkeypatch, capsys):
  train = trainer.train

  def train_standard(*args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
      return train(*args, **kwargs)

  monkeypatch.setattr(trainer, "train", train_standard)
  cfg = tiny_study(tmp_path, text_file).model_copy(update={"encodings": ("rope", "rope_linear"), "seeds": 2})
  assert study.model_train_config(cfg, "rope").workdir == str(tmp_path / "models" / "rope")  # first edition's
  assert study.model_train_config(cfg, "rope_linear", 1).workdir == str(tmp_path / "models" / "rope.seed1")
  assert study.model_train_config(cfg, "rope", 1).seed == cfg.train.seed + 1
  with pytest.raises(ValueError, match="seed must be an int in 0..1"):
    study.model_train_config(cfg, "rope", 2)
  report = study.run_study(cfg, progress=False)
  assert set(report["models"]) == {"rope", "rope.seed1"}
  s0, s1 = (report["results_by_seed"]["rope"][s]["2"]["per_window"] for s in (0, 1))
  assert s0 != s1  # the seeds trained different models
  np.testing.assert_allclose(
    report["results"]["rope"]["2"]["per_seed"], [np.mean(s0), np.mean(s1)], rtol=1e-12
  )
  assert " / " in (tmp_path / "study.md").read_text()

  def no_training(*args, **kwargs):
    raise AssertionError("a finished (encoding, seed) model was trained again")

  monkeypatch.setattr(trainer, "train", no_training)
  outputs = sorted(p for p in tmp_path.rglob("*") if p.is_file() and "xla_cache" not in p.parts)
  before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in outputs}
  capsys.readouterr()
  again = study.run_study(cfg, progress=False)
  assert again["results"] == report["results"]
  assert not any(m["trained_now"] for m in again["models"].values())
  # Issue 48: a rerun that trains and evaluates nothing writes nothing (main rewrote study.json, study.md
  # and the plots with a new date): every file but XLA's compilation cache is as it was.
  assert "[study] nothing changed: study.json, study.md, bits_per_byte.png, loss_vs_position.png in" in (
    capsys.readouterr().out
  )
  after = sorted(p for p in tmp_path.rglob("*") if p.is_file() and "xla_cache" not in p.parts)
  assert after == outputs and {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in after} == before


def test_every_encoding_evaluates_with_its_trained_parameter_shapes():
  """Each row's eval configs (1x and 8x) hold the same parameters as its training config (a CoPE table
  or learned table that grew with max_len would not load the trained weights); the issue-20 rows set
  what their names say."""
  from jaxpe.model import Decoder

  cfg = study.StudyConfig(
    train=TrainConfig(model=ModelConfig(d_model=16, num_layers=3, num_heads=2), seq_len=16),
    eval_multiples=(1, 8),
  )
  shapes = lambda c: jax.tree.map(lambda x: x.shape, nnx.state(Decoder(c, rngs=nnx.Rngs(0)), nnx.Param))  # noqa: E731
  for name in study.ENCODINGS:
    want = shapes(study.model_train_config(cfg, name).model)
    for k in (1, 8):
      got = study.eval_model_config(cfg, name, k)
      assert got is None or shapes(got) == want, (name, k)
  m = lambda n: study.model_train_config(cfg, n).model  # noqa: E731
  assert m("rope_nope2").no_rope_layer_interval == 2 and m("p_rope").rope_proportion == 0.75
  assert m("rope_sinks").attention_sinks and m("rope_alibi_hybrid").rope_alibi_content_rope
  assert m("cope").cope_npos_max == 16 and m("fire").pos_encoding == "fire"


def test_compilation_cache_is_scoped_to_the_study(tmp_path):
  """run_study's persistent compilation cache lives in its own workdir while it runs and is switched
  back off after (a second study in the process gets its own; a cache the user set is kept)."""
  from jax.experimental.compilation_cache import compilation_cache

  from jaxpe.study import run

  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  suite = {k: getattr(jax.config, k) for k in names}  # conftest's cache
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    for d in ("a", "b"):
      with run._compilation_cache(tmp_path / d):
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / d)
      assert jax.config.jax_compilation_cache_dir is None
      assert jax.config.jax_persistent_cache_min_compile_time_secs == suite[names[1]]
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    with run._compilation_cache(tmp_path / "a"):
      assert jax.config.jax_compilation_cache_dir == str(tmp_path / "user")
  finally:
    for k, v in suite.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


def test_finished_model_of_another_seed_or_other_data_is_not_reused(tmp_path):
  """A finished model whose saved config differs in a run-defining key (here train.seed), or whose
  data fingerprint (summary.json's run.data.sha256) is not the data's now, is refused with what differs
  named, not evaluated and reported as the new config's (issue 39 kind 11: the corpus changed at the
  same path); data.allow_changed lets it be reused, as the trainer's resume."""
  from jaxpe.study import models

  cfg = study.StudyConfig(workdir=str(tmp_path), encodings=("rope",))
  old = study.model_train_config(cfg, "rope")
  Path(old.workdir).mkdir(parents=True)
  (Path(old.workdir) / "config.json").write_text(old.model_copy(update={"num_steps": 3}).model_dump_json())
  summary = {"step": 3, "num_steps": 3, "run": {"data": {"sha256": "a" * 64}}}
  (Path(old.workdir) / "summary.json").write_text(json.dumps(summary))
  assert models.finished(old.model_copy(update={"num_steps": 3}), "a" * 64)["step"] == 3
  new = study.model_train_config(
    cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": 7})}), "rope"
  )
  with pytest.raises(ValueError, match=r"seed: 0 -> 7"):
    models.finished(new.model_copy(update={"num_steps": 3}), "a" * 64)
  with pytest.raises(
    ValueError, match=r"trained on other data \(fingerprint aaaaaaaaaaaa, the data now gives bbbbbbbbbbbb\)"
  ):
    models.finished(old.model_copy(update={"num_steps": 3}), "b" * 64)
  allowed = old.model_copy(
    update={"num_steps": 3, "data": old.data.model_copy(update={"allow_changed": True})}
  )
  assert models.finished(allowed, "b" * 64)["step"] == 3


def test_finished_model_trained_under_other_training_keys_is_not_reused(tmp_path):
  """Issue 48 kind 5: a finished model is reused only on the same config: one trained with another
  learning rate (a key a resume may change) was reported under the new config without training. Keys
  that do not change the weights (where and how it ran, what it logged) still reuse it."""
  from jaxpe.study import models

  cfg = study.StudyConfig(workdir=str(tmp_path), encodings=("rope",))
  old = study.model_train_config(cfg, "rope").model_copy(update={"num_steps": 3})
  Path(old.workdir).mkdir(parents=True)
  (Path(old.workdir) / "config.json").write_text(old.model_dump_json())
  summary = {"step": 3, "num_steps": 3, "run": {"data": {"sha256": "a" * 64}}}
  (Path(old.workdir) / "summary.json").write_text(json.dumps(summary))
  for key, value, shown in [
    ("learning_rate", 0.5, "learning_rate: 0.003 -> 0.5"),
    ("warmup_steps", 2, "warmup_steps: 100 -> 2"),
    ("weight_decay", 0.5, "weight_decay: 0.1 -> 0.5"),
    ("grad_accum_steps", 2, "grad_accum_steps: 1 -> 2"),
  ]:
    with pytest.raises(
      ValueError, match=re.escape(f"was trained with other settings than the study now gives ({shown};")
    ):
      models.finished(old.model_copy(update={key: value}), "a" * 64)
  for key, value in [("eval_every", 7), ("checkpoint_every", 1), ("sample_len", 9), ("keep_checkpoints", 5)]:
    assert models.finished(old.model_copy(update={key: value}), "a" * 64)["step"] == 3
  scanned = old.model_copy(update={"model": old.model.model_copy(update={"scan_layers": True})})
  assert models.finished(scanned, "a" * 64)["step"] == 3


def test_every_float_key_of_the_study_config_is_finite_and_in_range():
  """Issue 39 kind 9 (passkey_learning_rate=inf was accepted): every float key of StudyConfig refuses
  inf, NaN and values outside its range when configured, naming the key."""
  for key, bad in (
    ("finetune_learning_rate", float("inf")),
    ("finetune_learning_rate", float("nan")),
    ("finetune_learning_rate", 2.0),
    ("finetune_learning_rate", 0.0),
  ):
    with pytest.raises(ValueError, match=key):
      study.StudyConfig.model_validate({key: bad})
  floats = [k for k, f in study.StudyConfig.model_fields.items() if f.annotation in (float, "float")]
  assert floats == ["finetune_learning_rate"], floats  # a new float key gets its case above
  with pytest.raises(ValueError, match="ignore"):
    study.StudyConfig.model_validate({"tasks": [{"name": "flipflop", "ignore": float("inf")}]})
  with pytest.raises(ValueError, match="learning_rate"):
    study.StudyConfig.model_validate(
      {"task_train": {"learning_rate": float("nan")}, "tasks": [{"name": "copy"}]}
    )
