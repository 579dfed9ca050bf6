"""Losses over rows of unequal weight (issue 48, kind 1: a mean of means where a weighted mean is due).

A task batch's rows hold different numbers of answers, so the batch's loss is the sum of its answer
losses over their count, and so is its gradient. Every place that splits a batch or joins several
must add sums and weights and divide once: gradient accumulation (``accumulated_value_and_grad``,
``make_train_step``), the held-out evaluation over several batches (``evaluation.evaluate``). The
references are numpy float64 over the whole batch (a bigram model whose gradient has a closed form)
and the same step without accumulation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpe.model import Decoder
from jaxpe.model.config import ModelConfig
from jaxpe.train import evaluation, sharding, steps, tasks
from jaxpe.train.data_config import TaskConfig

COPY = TaskConfig(name="copy", num_symbols=30)
FLIP = TaskConfig(name="flipflop", ignore=0.3)
V = 32


class Bigram(nnx.Module):
  """Logits of the next token from the current one only: ``W[token]`` (a gradient in closed form)."""

  def __init__(self, rng: np.random.Generator):
    self.w = nnx.Param(jnp.asarray(rng.normal(size=(V, V)), jnp.float32))

  def __call__(self, tokens):
    return self.w[...][tokens]


def _reference(w: np.ndarray, batch: np.ndarray) -> tuple[float, np.ndarray]:
  """The batch's mean answer loss and its gradient w.r.t. ``w``, numpy float64."""
  w = w.astype(np.float64)
  tokens, mask = batch[:, 0], batch[:, 1, 1:].astype(np.float64)
  x, y = tokens[:, :-1], tokens[:, 1:]
  logits = w[x]  # [B, T, V]
  lse = np.log(np.exp(logits).sum(-1))
  nll = lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]
  n = mask.sum()
  d = np.exp(logits - lse[..., None])
  np.put_along_axis(d, y[..., None], np.take_along_axis(d, y[..., None], -1) - 1.0, -1)
  grad = np.zeros_like(w)
  np.add.at(grad, x.ravel(), (d * mask[..., None] / n).reshape(-1, V))
  return float((nll * mask).sum() / n), grad


def _task_batch(task: TaskConfig, b: int, t: int) -> np.ndarray:
  return tasks.task_batch(task, step=0, seed=3, batch_size=b, seq_len=t)


@pytest.mark.parametrize("task", [COPY, FLIP], ids=["copy", "flipflop"])
@pytest.mark.parametrize("micro", [1, 4])
def test_accumulated_loss_and_gradient_are_the_batch_weighted_mean(task, micro):
  model = Bigram(np.random.default_rng(0))
  batch = _task_batch(task, 8, 24)
  counts = batch[:, 1, 1:].sum(1)
  assert len(set(counts.reshape(-1, 4).sum(0) if micro == 4 else counts)) > 1  # unequal weights
  ref_loss, ref_grad = _reference(np.asarray(model.w[...]), batch)
  loss, grads = nnx.jit(
    lambda m, b: steps.accumulated_value_and_grad(steps.next_token_loss_sum, m, b, micro)
  )(model, jnp.asarray(batch))
  np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-6)
  scale = np.abs(ref_grad).max()
  np.testing.assert_allclose(np.asarray(grads["w"][...]), ref_grad, rtol=0, atol=1e-5 * scale)
  # The scalar loss (a mean) gives the same batch mean without accumulation.
  assert float(steps.next_token_loss(model, jnp.asarray(batch))) == pytest.approx(ref_loss, rel=2e-6)


def test_train_step_with_accumulation_equals_the_step_without_on_a_task_batch():
  cfg = ModelConfig(
    vocab_size=COPY.num_symbols + 2, d_model=32, num_layers=1, num_heads=2, mlp_dim=64, max_len=32
  )
  batch = jnp.asarray(_task_batch(COPY, 8, 24))
  out = {}
  for micro in (1, 4):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)))
    state, metrics = steps.make_train_step(graphdef, grad_accum_steps=micro)(state, batch)
    out[micro] = float(metrics["loss"]), float(metrics["grad_norm"]), nnx.state(nnx.merge(graphdef, state)[0])
  assert out[4][0] == pytest.approx(out[1][0], rel=1e-5)
  assert out[4][1] == pytest.approx(out[1][1], rel=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), out[4][2], out[1][2])


def test_held_out_evaluation_weights_batches_by_their_answers():
  model = Bigram(np.random.default_rng(1))
  batches = [_task_batch(FLIP, 4, 16), _task_batch(COPY, 4, 16)]  # 4 rows each, different answer counts
  assert batches[0][:, 1].sum() != batches[1][:, 1].sum()
  graphdef, state = nnx.split(model)
  eval_step = jax.jit(lambda s, b: steps.next_token_loss_sum(nnx.merge(graphdef, s), b))
  mesh = sharding.make_mesh([1, 1, 1, 1], devices=jax.devices()[:1])
  placed = sharding.batch_sharding(mesh, sharding.DEFAULT_RULES)
  got = evaluation.evaluate(eval_step, state, batches, placed)
  ref, _ = _reference(np.asarray(model.w[...]), np.concatenate(batches))
  assert got == pytest.approx(ref / np.log(2), rel=2e-6)
