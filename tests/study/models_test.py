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
