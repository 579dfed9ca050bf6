"""Retrieval on the synthetic tasks: the scores against a numpy argmax and float64 log-softmax of the
same logits, the seeds and samples combination and the paired differences against numpy, a tiny study
with a task (every row scored, the emulation check within tolerance, rope_pi_ft fine-tuned on the task,
a rerun reusing every cache; MQAR's models started from the copy models by task_init), a study killed while
training a task model whose resumed tables equal an uninterrupted one's, the curriculum keys' config checks,
and the quick config's task models (copy, then MQAR from copy) reaching their accuracy goal at 1x."""

import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from study_test import text_file, tiny_study  # noqa: F401  (text_file is a fixture)

from jaxpe import study
from jaxpe.model import Decoder
from jaxpe.model.build import model_params
from jaxpe.model.config import ModelConfig
from jaxpe.study import models, retrieval_run
from jaxpe.train import checkpoint, sharding, state, tasks, trainer
from jaxpe.train.cli import resolve_config
from jaxpe.train.config import TrainConfig

COPY = study.TaskConfig(name="copy", num_symbols=64)
MQAR = study.TaskConfig(name="mqar", num_keys=16, num_values=16)  # vocabulary 34 <= copy's 66
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def standard_training(monkeypatch):
  train = trainer.train

  def train_standard(*args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
      return train(*args, **kwargs)

  monkeypatch.setattr(trainer, "train", train_standard)


def test_scores_match_numpy_argmax_of_the_same_logits():
  cfg = ModelConfig(vocab_size=66, d_model=16, num_layers=1, num_heads=2, max_len=32)
  model = Decoder(cfg, rngs=nnx.Rngs(3))
  samples = tasks.held_out(COPY, seed=0, count=5, length=32)
  # sample 0's answers made the model's greedy continuation one at a time (a later answer's prefix holds
  # the earlier ones), so its exact match is 1 and the accuracies are not all ~0
  fwd = nnx.jit(lambda m, x: m(x))
  for p in np.flatnonzero(samples[0, 1]):
    samples[0, 0, p] = int(np.asarray(fwd(model, jnp.asarray(samples[:1, 0, :-1])))[0, p - 1].argmax())
  logits = np.asarray(fwd(model, jnp.asarray(samples[:, 0, :-1])), np.float64)
  got = study.score_task(model, samples, batch_size=2)
  mask = samples[:, 1, 1:].astype(bool)
  hit = logits.argmax(-1) == samples[:, 0, 1:]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  ans = np.take_along_axis(logp, samples[:, 0, 1:, None].astype(np.int64), -1)[..., 0]
  for i in range(5):
    np.testing.assert_allclose(got["token_accuracy"][i], hit[i][mask[i]].mean(), rtol=1e-12)
    assert got["exact"][i] == float(hit[i][mask[i]].all())
    np.testing.assert_allclose(
      got["answer_bits"][i], ans[i][mask[i]].mean() / math.log(2), rtol=1e-4, atol=1e-5
    )
  assert got["exact"][0] == 1.0  # the sample whose answers were made the argmax
  with pytest.raises(ValueError, match=r"samples must be \[N, 2, L \+ 1\]"):
    study.score_task(model, samples[:, 0], batch_size=2)
  empty = samples.copy()
  empty[2, 1] = 0
  with pytest.raises(ValueError, match=r"samples \[2\] have no answer tokens"):
    study.score_task(model, empty, batch_size=2)


def test_combine_and_paired_task_match_numpy():
  rng = np.random.default_rng(0)
  a = rng.uniform(size=(3, 6))  # S = 3 seeds, N = 6 samples
  r = rng.uniform(size=(3, 6))
  entries = lambda b: [{m: (b[s] * (k + 1)).tolist() for k, m in enumerate(study.METRICS)} for s in range(3)]  # noqa: E731
  se = lambda x: 1.96 * np.std(x, ddof=1) / math.sqrt(x.size)  # noqa: E731
  got = study.combine_task(entries(a))
  for k, m in enumerate(study.METRICS):
    b = a * (k + 1)
    np.testing.assert_allclose(got[m]["mean"], b.mean(), rtol=1e-12)
    np.testing.assert_allclose(got[m]["ci95"], se(b.mean(axis=0)), rtol=1e-12)
    np.testing.assert_allclose(got[m]["ci95_seeds"], se(b.mean(axis=1)), rtol=1e-12)
  p = study.paired_task(
    {"x": [{"1": e, "2": None} for e in entries(a)], "rope": [{"1": e, "2": e} for e in entries(r)]}, "rope"
  )
  d = a - r
  np.testing.assert_allclose(p["x"]["1"]["token_accuracy"]["mean"], d.mean(), rtol=1e-12)
  np.testing.assert_allclose(p["x"]["1"]["token_accuracy"]["ci95_seeds"], se(d.mean(axis=1)), rtol=1e-12)
  assert p["x"]["2"] is None and study.combine_task([None, None]) is None
  with pytest.raises(ValueError, match="all be None or all hold"):
    study.combine_task([entries(a)[0], None])


def _pooled(model, samples):
  """numpy float64: per-answer hits and log2-probabilities of ``samples``' answers (all samples pooled)."""
  logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(samples[:, 0, :-1])), np.float64)
  mask = samples[:, 1, 1:].astype(bool)
  hit = logits.argmax(-1) == samples[:, 0, 1:]
  logp = logits - np.logaddexp.reduce(logits, axis=-1)[..., None]
  ans = np.take_along_axis(logp, samples[:, 0, 1:, None].astype(np.int64), -1)[..., 0] / math.log(2)
  return hit[mask], ans[mask]


def test_answer_metrics_pool_the_answers_of_samples_of_unequal_length():
  # Issue 48, kind 1: flip-flop and copy samples hold different numbers of answers, so the share of
  # answers right is the pooled share, not the mean of per-sample shares.
  flip = study.TaskConfig(name="flipflop", ignore=0.5)
  cfg = ModelConfig(vocab_size=tasks.vocab_size(flip), d_model=16, num_layers=1, num_heads=2, max_len=32)
  samples = tasks.held_out(flip, seed=0, count=7, length=24)
  assert len(set(samples[:, 1].sum(1).tolist())) > 2
  seeds = [Decoder(cfg, rngs=nnx.Rngs(s)) for s in (0, 1)]
  fwd = nnx.jit(lambda m, x: m(x))
  for i in (0, 3, 5):  # these samples' answers made seed 0's greedy continuation: their accuracy is 1
    for p in np.flatnonzero(samples[i, 1]):
      samples[i, 0, p] = int(
        np.asarray(fwd(seeds[0], jnp.asarray(samples[i : i + 1, 0, :-1])))[0, p - 1].argmax()
      )
  scores = [study.score_task(m, samples, batch_size=4) for m in seeds]
  pooled = [_pooled(m, samples) for m in seeds]
  got = study.combine_task(scores)
  assert 0 < pooled[0][0].mean() < 1
  for k, m in enumerate(("token_accuracy", "answer_bits")):
    ref_seed = [p[k].mean() for p in pooled]
    np.testing.assert_allclose(got[m]["per_seed"], ref_seed, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[m]["mean"], np.mean(ref_seed), rtol=1e-5, atol=1e-6)
  ref = study.paired_task({"x": [{"1": scores[0]}], "rope": [{"1": scores[1]}]}, "rope")
  np.testing.assert_allclose(
    ref["x"]["1"]["token_accuracy"]["mean"], pooled[0][0].mean() - pooled[1][0].mean(), rtol=1e-12, atol=1e-12
  )
  # Equal weights: the ratio estimator's interval is the plain one.
  equal = [{**e, "answers": [3.0] * len(e["exact"])} for e in scores]
  plain = [{k: v for k, v in e.items() if k != "answers"} for e in scores]
  for m in study.METRICS:
    assert study.combine_task(equal)[m]["ci95"] == pytest.approx(
      study.combine_task(plain)[m]["ci95"], rel=1e-12
    )
  # The emulation check on retrieval: the native accuracy is the share of all answers.
  alibi = cfg.model_copy(update={"pos_encoding": "alibi"})
  native = Decoder(alibi, rngs=nnx.Rngs(2))
  rows = study.task_emulation(alibi, model_params(native), {24: samples}, 4, 24)
  hits, _ = _pooled(native, samples)
  assert rows[0]["token_accuracy_native"] == pytest.approx(hits.mean(), rel=1e-12)


def task_study(workdir: Path, text_file: str, **update) -> study.StudyConfig:  # noqa: F811
  base = tiny_study(workdir, text_file)
  return base.model_copy(
    update={
      "encodings": ("rope", "rope_pi_ft", "alibi"),
      "eval_multiples": (1, 2),
      "tasks": (COPY, MQAR),
      "task_init": {"mqar": "copy"},  # the curriculum: mqar's models start from copy's
      "task_train": {"seq_len": 16, "num_steps": 4, "checkpoint_every": 2},
      "task_train_by_task": {"mqar": {"num_steps": 3, "warmup_steps": 1}},
      "task_samples": 8,
      "finetune_steps": 2,
      **update,
    }
  )


def test_study_with_a_task_and_its_resume(tmp_path, text_file, monkeypatch):  # noqa: F811
  cfg = task_study(tmp_path / "straight", text_file)
  assert study.model_train_config(cfg, "rope", 0, COPY).workdir == str(
    tmp_path / "straight" / "models" / "copy" / "rope"
  )
  assert study.model_train_config(cfg, "alibi", 0, COPY).model.vocab_size == 66
  mqar_rope = study.model_train_config(cfg, "rope_pi_ft", 0, MQAR)  # the rope weights, from copy's
  assert mqar_rope.init_from == str(tmp_path / "straight" / "models" / "copy" / "rope")
  assert (mqar_rope.model.vocab_size, mqar_rope.num_steps, mqar_rope.checkpoint_every) == (66, 3, 2)
  assert study.model_train_config(cfg, "rope", 0, COPY).init_from is None
  with jax.numpy_dtype_promotion("standard"):
    report = study.run_study(cfg, progress=False)
  assert report["models"]["mqar/rope"]["run"]["init_from"] == {"path": mqar_rope.init_from, "step": 4}
  # mqar's step-0 parameters are copy's final ones (read back from copy's checkpoint by the loader)
  copy_params = study.trained_params(study.model_train_config(cfg, "rope", 0, COPY))
  fresh = mqar_rope.model_copy(update={"workdir": str(tmp_path / "mqar_step0")})
  with checkpoint.manager(tmp_path / "mqar_step0" / "checkpoints") as mngr:
    run, _, _ = state.restore_or_create(
      fresh, mngr, sharding.make_mesh((-1, 1, 1, 1)), saved_config=None, fingerprint={"sha256": "x"}
    )
  start = {
    ".".join(map(str, k)): np.asarray(v[...])
    for k, v in nnx.to_flat_state(nnx.state(run.state[0], nnx.Param))
  }
  assert start.keys() == copy_params.keys()
  for k in start:
    np.testing.assert_array_equal(start[k], copy_params[k], err_msg=k)
  assert report["retrieval"]["mqar"]["rope"]["1"] != report["retrieval"]["copy"]["rope"]["1"]
  assert set(report["retrieval"]) == {"copy", "mqar"}
  r = report["retrieval"]["copy"]
  assert set(r) == {"rope", "rope_pi_ft", "alibi"} and set(r["rope"]) == {"1", "2"}
  assert {"copy/rope", "copy/alibi", "mqar/rope", "mqar/alibi"} <= set(report["models"])
  for e in report["retrieval_emulation_check"]["copy"]:
    assert e["answers_changed"] == 0 and e["max_abs_delta_answer_bits"] < 0.01, e
    assert abs(e["token_accuracy_delta"]) == 0.0
  assert r["rope_pi_ft"]["1"] != r["rope"]["1"]  # fine-tuned weights, factor 2 at 1x
  assert set(report["retrieval_vs_alibi"]["copy"]) == set()  # no rope_alibi row here
  md = (tmp_path / "straight" / "study.md").read_text()
  assert "### copy" in md and "Exact match per answer token" in md and "| rope + position interpolation" in md
  assert "### mqar" in md and "started from the copy models of the same encoding and seed" in md
  assert (tmp_path / "straight" / "retrieval.png").stat().st_size > 0
  assert (Path(study.model_train_config(cfg, "rope", 0, COPY).workdir) / "finetuned_rope_pi_ft.npz").is_file()

  def no_work(*args, **kwargs):
    raise AssertionError("a finished model was trained or fine-tuned again")

  train = trainer.train
  monkeypatch.setattr(trainer, "train", no_work)
  monkeypatch.setattr(models, "finetune", no_work)
  again = study.run_study(cfg, progress=False)
  assert again["retrieval"] == report["retrieval"] and again["results"] == report["results"]
  monkeypatch.undo()

  # The same study killed while training a task model started from another (stop_at: as a signal stops
  # it, with a checkpoint) resumes from that checkpoint to the same tables as the uninterrupted one.
  killed = task_study(tmp_path / "killed", text_file)
  for done in ("rope", "alibi", "copy"):  # its finished text and copy models are reused (time): mqar trains
    shutil.copytree(tmp_path / "straight" / "models" / done, tmp_path / "killed" / "models" / done)

  def stop_task_model(c: TrainConfig, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
      killed_here = c.data.task is not None and c.data.task.name == "mqar"
      return train(c.model_copy(update={"stop_at": 2}) if killed_here else c, **kwargs)

  monkeypatch.setattr(trainer, "train", stop_task_model)
  with pytest.raises(study.StudyInterrupted, match=r"'mqar/rope' stopped at step 2 of 3"):
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam in the text rope_pi_ft fine-tuning
      study.run_study(killed, progress=False)
  monkeypatch.setattr(trainer, "train", train)
  with jax.numpy_dtype_promotion("standard"):
    resumed = study.run_study(killed, progress=False)
  assert resumed["retrieval"] == report["retrieval"] and resumed["results"] == report["results"]


@pytest.mark.parametrize("name", ["rope", "alibi"])  # apart, so the two workers train them side by side
def test_quick_config_reaches_its_accuracy_goal(tmp_path, standard_training, name):
  """The quick config's task models learn their task: per-token exact match >= 0.95 at 1x for rope and
  alibi (trained here by the ordinary trainer exactly as the quick study trains them)."""
  quick = study.load_study_config(ROOT / "jaxpe" / "configs" / "study_quick.yaml", [f"workdir={tmp_path}"])
  assert quick.tasks
  for task in quick.tasks:
    cfg = study.model_train_config(quick, name, 0, task)
    models.train_model(cfg, f"{task.name}/{name}", tasks.fingerprint(task)["sha256"], progress=False)
    t = cfg.seq_len
    samples = tasks.held_out(task, seed=retrieval_run.EVAL_SEED, count=quick.task_samples, length=t)
    got = study.score_task(study.load_trained(cfg), samples, quick.eval_batch_size)
    assert np.mean(got["token_accuracy"]) >= 0.95, (task.name, name, np.mean(got["token_accuracy"]))


def test_task_init_and_task_train_by_task_are_checked_at_config_time(tmp_path, text_file):  # noqa: F811
  flip = study.TaskConfig(name="flipflop")
  ok = task_study(
    tmp_path, text_file, tasks=(COPY, flip, MQAR), task_init={}, task_train_by_task={"mqar": {"num_steps": 3}}
  )
  # without task_init, a task's vocabulary is its own and no init_from; task_train_by_task touches only its task
  assert study.model_train_config(ok, "rope", 0, MQAR).model.vocab_size == 2 + 16 + 16
  assert study.model_train_config(ok, "rope", 0, MQAR).init_from is None
  assert study.model_train_config(ok, "rope", 0, COPY).num_steps == 4
  assert study.model_train_config(ok, "rope", 0, MQAR).num_steps == 3
  bad = {
    "names unknown tasks: \\['passkey'\\]": {"task_train_by_task": {"passkey": {"num_steps": 3}}},
    "task_init mqar: nope: both must be task names": {"task_init": {"mqar": "nope"}},
    "task_init copy: mqar: the source must be listed before": {"task_init": {"copy": "mqar"}},
    "task_init mqar: mqar: a task cannot start from its own models": {"task_init": {"mqar": "mqar"}},
    "task_init mqar: flipflop: flipflop is itself started from copy \\(no chains\\)": {
      "task_init": {"flipflop": "copy", "mqar": "flipflop"}
    },
    f"task_init mqar: flipflop: the target's vocabulary \\(34 tokens\\) exceeds the source's \\({tasks.vocab_size(flip)}\\)": {
      "task_init": {"mqar": "flipflop"}
    },
    "same architecture and seq_len .* got model keys \\['d_model'\\]": {
      "task_init": {"mqar": "copy"},
      "task_train_by_task": {"mqar": {"model": {"d_model": 48}}},
    },
    "seq_len 16 -> 32": {"task_init": {"mqar": "copy"}, "task_train_by_task": {"mqar": {"seq_len": 32}}},
    "task_train_by_task.mqar must not set data": {"task_train_by_task": {"mqar": {"data": {}}}},
    "task_train_by_task.mqar must not set init_from": {"task_train_by_task": {"mqar": {"init_from": "x"}}},
    "task_train must not set init_from": {"task_train": {"init_from": "x"}},
    "train.init_from must be null in a study": {"train": {**ok.train.model_dump(), "init_from": "x"}},
    "(?s)task_train / task_train_by_task.mqar / tasks \\(task mqar\\): .*num_stepz": {
      "task_train_by_task": {"mqar": {"num_stepz": 3}}
    },
  }
  # Issue 48 kind 6: keys the study sets per model, given in task_train or task_train_by_task, were
  # accepted and then replaced without a word (model.vocab_size 1000 -> the task's 258): refused.
  set_by_study = {
    "model.vocab_size": 1000,
    "model.pos_encoding": "alibi",
    "model.max_len": 64,
    "model.rope_alibi_context": 256,
    "model.rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "model.cope_npos_max": 8,
    "workdir": "elsewhere",
    "sample_len": 50,
  }
  for dotted, value in set_by_study.items():
    section, _, key = dotted.rpartition(".")
    keys = {section: {key: value}} if section else {key: value}
    for where, update in [
      ("task_train_by_task.mqar", {"task_train_by_task": {"mqar": keys}}),
      ("task_train", {"task_train": {**ok.task_train, **keys}}),
    ]:
      bad[f"{where} must not set {dotted} \\(the study sets it: .*\\), got {re.escape(repr(value))}"] = update
  raw = ok.model_dump(mode="python")
  study.StudyConfig.model_validate({**raw, "task_init": {"mqar": "copy"}})  # the valid curriculum
  for message, update in bad.items():
    with pytest.raises(ValueError, match=message):
      study.StudyConfig.model_validate({**raw, **update})


@pytest.mark.parametrize("config", ["study_quick", "study"])
def test_the_shipped_configs_run_any_subset_of_their_tasks(config):
  # Issue 48, kind 5: study.yaml documents tasks: [] = no retrieval, but the per-task keys (task_init,
  # task_train_by_task) named mqar and refused it. Entries of tasks not run are ignored, as task_train is
  # without tasks; a run task whose task_init source is not run is refused, saying so.
  path = resolve_config(config)
  for override, run in (("tasks=[]", []), ("tasks=[{name: copy, num_symbols: 256}]", ["copy"])):
    got = study.load_study_config(path, [override], unique_overrides=True)
    assert [t.name for t in got.tasks] == run and set(got.task_init) == {"mqar"}
    assert [study.model_train_config(got, "rope", 0, t).data.task.name for t in got.tasks] == run
  with pytest.raises(
    ValueError, match=r"task_init mqar: copy: mqar is run but copy is not in tasks \(\['mqar'\]\)"
  ):
    study.load_study_config(path, ["tasks=[{name: mqar}]"], unique_overrides=True)
  flip = study.load_study_config(path, ["tasks=[{name: copy, num_symbols: 256}, {name: flipflop}]"])
  assert [t.name for t in flip.tasks] == [
    "copy",
    "flipflop",
  ]  # mqar's entries ignored, flipflop on task_train
