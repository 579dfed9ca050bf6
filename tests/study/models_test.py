"""Fine-tuning (``jaxpe.study.finetune``) checks every update, the last one too (issue 48, kind 4: a check
that runs before the last update). The trainer's step checks the parameters after each update
(``make_train_step``'s ``param_norm``) and the study's task models train through it."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpe.model import Decoder
from jaxpe.model.build import model_params
from jaxpe.model.config import ModelConfig
from jaxpe.study import finetune
from jaxpe.train import run_guard, tasks
from jaxpe.train.data_config import TaskConfig

COPY = TaskConfig(name="copy", num_symbols=16)
CFG = ModelConfig(vocab_size=18, d_model=16, num_layers=1, num_heads=2, mlp_dim=32, max_len=32)


def _batch(i):
  return tasks.task_batch(COPY, step=i, seed=0, batch_size=4, seq_len=16)


@pytest.fixture(autouse=True)
def standard_promotion():
  with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int32 counts and floats
    yield


@pytest.mark.parametrize("steps", [1, 3])
def test_an_update_to_non_finite_parameters_is_refused_even_the_last(steps):
  params = model_params(Decoder(CFG, rngs=nnx.Rngs(0)))
  with pytest.raises(
    run_guard.NonFiniteError, match=rf"fine-tuning step 1 of {steps} is not finite: loss [0-9.]+,"
  ):
    finetune(
      CFG, params, _batch, steps=steps, learning_rate=1e39
    )  # step 1's loss is finite, its update is not
  tuned = finetune(CFG, params, _batch, steps=2, learning_rate=1e-2)
  assert all(np.isfinite(v).all() for v in tuned.values())
  assert any(not np.array_equal(tuned[k], params[k]) for k in params)


def test_a_model_trained_now_reports_what_its_summary_json_reports_when_reused(tmp_path, monkeypatch):
  """``train_model`` gives ``study.json``'s ``models`` entry: for a task model (bits per answer) the
  entry of the run trained in this process and of the same run reused on a rerun are the same dict
  (before: ``TrainResult.__dict__``, whose ``eval_bits_per_byte`` held bits per answer, then on the
  rerun ``summary.json``'s ``eval_bits_per_answer``, so a rerun that trained nothing rewrote study.json)."""
  import json
  import math

  from jaxpe.study import models
  from jaxpe.train import run_log
  from jaxpe.train.config import TrainConfig
  from jaxpe.train.run_files import json_text

  cfg = TrainConfig(
    workdir=str(tmp_path), num_steps=3, seq_len=16, sample_len=0, data=dict(task=COPY), model=CFG
  )

  def fake_train(cfg, progress):  # what the trainer writes and returns at its end
    result = run_log.TrainResult(3, 1.0, 0.5, 4.0, 10.0, 1.0, "", num_steps=3, completed=True, unit="answer")
    result.bytes_per_token = math.nan
    run_log.write_summary(tmp_path, run_log.summary_dict(result))
    return result

  monkeypatch.setattr(models.trainer, "train", fake_train)
  now = models.train_model(cfg, "rope", "fp", progress=False)
  again = models.train_model(cfg, "rope", "fp", progress=False)
  assert now.pop("trained_now") and not again.pop("trained_now")
  assert "eval_bits_per_answer" in now and "eval_bits_per_byte" not in now
  assert json.loads(json_text(now)) == json.loads(json_text(again))
