"""The loss and one training or evaluation step as plain functions (no ``TrainConfig`` needed).

``jaxpe.train.trainer`` builds its run from these and ``jaxpe.train.optimizer``; other projects can
use them directly::

    tx = make_optimizer(3e-3, num_steps=1000, warmup_steps=100)  # jaxpe.train.optimizer
    model = Decoder(ModelConfig(), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
    train_step = make_train_step(graphdef)
    state, metrics = train_step(state, batch)  # batch [B, T + 1] int32

Losses combine as sums and weights (``next_token_loss_sum``), divided once: micro-batches, batches
and processes of unequal weight (task batches, whose rows hold different numbers of answers) then give
the weighted mean, not a mean of means.

Shape alphabet: B batch, T query positions, V vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpe.attention import context
from jaxpe.train import sharding


def next_token_loss_sum(model: Callable[..., jax.Array], batch: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(loss_sum, weight)``: the sum of the next-token cross-entropies (nats, float32) of ``batch``'s
  scored targets and their number (float32), so that losses over micro-batches, batches or processes
  of unequal weight combine as one weighted mean: ``sum(loss_sums) / max(sum(weights), 1)``.

  ``batch [B, T + 1]`` int32: inputs ``[:, :-1]``, targets ``[:, 1:]`` (token ids in ``[0, V)``), every
  target scored (weight ``B T``); ``model`` maps ``[B, T]`` tokens to ``[B, T, V]`` logits. A
  ``[B, 2, T + 1]`` batch (a synthetic task, ``jaxpe.train.tasks``) is tokens ``[:, 0]`` and a 0/1
  answer mask ``[:, 1]``: only the answer targets (``mask[:, 1:]``) are scored, and rows hold different
  numbers of them. A ``[B, 3, T + 1]`` batch (packed documents, ``jaxpe.train.packing``) is tokens,
  loss weights and segment ids: the model gets ``segment_ids = batch[:, 2, :-1]`` (positions restart
  per document, attention stays within it) and targets are scored by ``batch[:, 1, 1:]``. Context
  parallelism takes only the 2-d form.

  Under a mesh that splits the sequence over C > 1 devices (``sharding.sequence_shards()``, inside
  ``activation_sharding``: context parallelism), inputs and targets go in the zig-zag order
  (``sharding.zigzag_inputs``; the model, a ``Decoder``, also gets each token's position and
  original slot), so every device holds the same causal work; the sum over tokens is the same.
  """
  weights, extra = None, {}
  if batch.ndim == 3 and batch.shape[1] == 3:  # [B, 3, T + 1]: packed documents (jaxpe.train.packing)
    extra = {"segment_ids": batch[:, 2, :-1]}  # positions restart per document, attention within it
  if batch.ndim == 3:  # [B, 2, T + 1]: tokens and the answer mask of a synthetic task (jaxpe.train.tasks)
    batch, weights = batch[:, 0], batch[:, 1, 1:].astype(jnp.float32)
  inputs, targets = batch[:, :-1], batch[:, 1:]
  shards = sharding.sequence_shards()
  if shards == 1:
    logits = model(inputs, **extra)
  elif extra:
    raise ValueError("packed batches (data.packing) run without context parallelism")
  else:
    logits = model(**sharding.zigzag_inputs(inputs, shards))
    targets = context.to_zigzag(targets, shards)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  if weights is None:
    return losses.sum(), jnp.float32(losses.size)
  return (losses * weights).sum(), weights.sum()


def next_token_loss(model: Callable[..., jax.Array], batch: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy in nats per scored target (scalar float32) of ``batch``
  (``[B, T + 1]`` text or a ``[B, 2, T + 1]`` task batch: the mean over its answer targets, 0 for a
  batch without answers): ``next_token_loss_sum``'s sum divided by its weight. To combine several
  batches, combine ``next_token_loss_sum``'s pairs (a mean of these means is wrong when the batches hold
  different numbers of answers)."""
  return weighted_mean(next_token_loss_sum(model, batch))


def weighted_mean(loss: jax.Array | tuple[jax.Array, jax.Array]) -> jax.Array:
  """``loss_sum / max(weight, 1)`` of a ``(loss_sum, weight)`` pair (``next_token_loss_sum``); a
  scalar is returned as it is (a loss function that returns a mean)."""
  if isinstance(loss, tuple):
    total, weight = loss
    return total / jnp.maximum(weight, 1.0)
  return loss


def _sum_and_weight(loss: jax.Array | tuple[jax.Array, jax.Array], rows: int) -> tuple[jax.Array, jax.Array]:
  """A loss function's result as ``(loss_sum, weight)``: a pair as it is, a scalar mean over ``rows``
  rows of equal weight as ``(mean * rows, rows)``."""
  if isinstance(loss, tuple):
    return loss
  return loss * rows, jnp.float32(rows)


def accumulated_value_and_grad(
  loss_fn: Callable[[Any, jax.Array], Any], model: nnx.Module, batch: jax.Array, num_microbatches: int
) -> tuple[jax.Array, nnx.State]:
  """``(loss, grads)`` of the whole ``batch [B, ...]``'s mean loss w.r.t. the model's ``nnx.Param``s,
  computed over ``num_microbatches`` equal micro-batches in a ``jax.lax.scan``, holding only one
  micro-batch's activations.

  ``loss_fn(model, batch)`` returns either a ``(loss_sum, weight)`` pair (``next_token_loss_sum``: the
  micro-batches' sums and weights are added and divided once, so the result is the batch's weighted
  mean, equal to the result without accumulation to float32 rounding, whatever the weight of each
  micro-batch), or a scalar mean over rows of equal weight (then the mean of the micro-batch means).
  Micro-batch j takes rows j, j + m, j + 2m, ... (m = ``num_microbatches``), so every device keeps its
  own rows.

  Raises:
    ValueError: B not divisible by ``num_microbatches`` (or ``num_microbatches`` < 1).
  """
  if num_microbatches < 1 or batch.shape[0] % num_microbatches:
    raise ValueError(
      f"grad_accum_steps ({num_microbatches}) must be >= 1 and divide the batch size ({batch.shape[0]})"
    )
  if num_microbatches == 1:
    return nnx.value_and_grad(lambda m, b: weighted_mean(loss_fn(m, b)))(model, batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rows = batch.shape[0] // num_microbatches
  micro = batch.reshape(rows, num_microbatches, *batch.shape[1:]).swapaxes(0, 1)  # [m, B/m, ...]

  def sum_of(p, mb):
    return _sum_and_weight(loss_fn(nnx.merge(graphdef, p, rest), mb), rows)

  def body(carry, mb):
    loss_sum, weight_sum, grad_sum = carry
    mb = sharding.constrain(mb, ("batch",) + (None,) * (mb.ndim - 1))
    (total, weight), grads = jax.value_and_grad(sum_of, has_aux=True)(params, mb)
    return (loss_sum + total, weight_sum + weight, jax.tree.map(jnp.add, grad_sum, grads)), None

  zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (total, weight, grads), _ = jax.lax.scan(body, zeros, micro)
  weight = jnp.maximum(weight, 1.0)  # a batch without answers: loss and gradient 0
  return total / weight, jax.tree.map(lambda g: g / weight, grads)


def _tracing_context(mesh, rules):
  return contextlib.nullcontext() if mesh is None else sharding.activation_sharding(mesh, rules)


def make_train_step(
  graphdef: nnx.GraphDef,
  *,
  grad_accum_steps: int = 1,
  loss_fn: Callable[[Any, jax.Array], Any] = next_token_loss_sum,
  mesh: jax.sharding.Mesh | None = None,
  rules=sharding.DEFAULT_RULES,
  state_shardings: Any = None,
  batch_sharding: Any = None,
  skip_nonfinite: bool = True,
):
  """A jitted ``step(state, batch) -> (state, metrics)`` for the state of
  ``nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))`` (``graphdef`` is that split's).

  One optimizer step on ``batch [B, T + 1]`` int32 or a ``[B, 2, T + 1]`` task batch
  (``grad_accum_steps`` micro-batches, see ``accumulated_value_and_grad``; ``loss_fn`` returns a
  ``(loss_sum, weight)`` pair, default ``next_token_loss_sum``, or a mean over rows of equal weight).
  ``metrics``: ``loss``, the batch's mean loss (nats per scored token, float32) before the update; ``grad_norm``, the global L2 norm of the (accumulated, unclipped) gradient;
  ``param_norm``, the parameters' L2 norm after the update; ``finite``, whether all three are
  finite. With ``skip_nonfinite`` a non-finite step is not applied (the state returned is the
  input state), so a non-finite state is never produced. The input state is
  donated. With ``mesh``, activations are pinned at block boundaries by ``rules``
  (``jaxpe.sharding.constrain``) and the state / batch keep ``state_shardings`` /
  ``batch_sharding`` when given.
  """

  def step(state, batch):
    with _tracing_context(mesh, rules):
      model, optimizer = nnx.merge(graphdef, state)
      loss, grads = accumulated_value_and_grad(loss_fn, model, batch, grad_accum_steps)
      optimizer.update(model, grads)
      new_state = nnx.state((model, optimizer))
      metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "param_norm": optax.tree.norm(nnx.state(model, nnx.Param)),
      }
      finite = jnp.all(jnp.isfinite(jnp.stack(list(metrics.values()))))
      if skip_nonfinite:
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
      return new_state, {**metrics, "finite": finite}

  if state_shardings is None:
    return jax.jit(step, donate_argnums=0)
  return jax.jit(
    step,
    in_shardings=(state_shardings, batch_sharding),
    out_shardings=(state_shardings, None),
    donate_argnums=0,
  )


def make_eval_step(
  graphdef: nnx.GraphDef,
  *,
  loss_fn: Callable[[Any, jax.Array], Any] = next_token_loss_sum,
  mesh: jax.sharding.Mesh | None = None,
  rules=sharding.DEFAULT_RULES,
  state_shardings: Any = None,
  batch_sharding: Any = None,
):
  """A jitted ``eval_step(state, batch) -> loss_fn(model, batch)`` for the same state as
  ``make_train_step``; nothing is updated. With the default ``next_token_loss_sum`` that is the
  ``(loss_sum, weight)`` pair (nats, float32) that batches of unequal weight add before one division
  (``jaxpe.train.evaluation.evaluate``); ``weighted_mean`` gives one batch's mean."""

  def eval_step(state, batch):
    with _tracing_context(mesh, rules):
      model, _ = nnx.merge(graphdef, state)
      return loss_fn(model, batch)

  if state_shardings is None:
    return jax.jit(eval_step)
  return jax.jit(eval_step, in_shardings=(state_shardings, batch_sharding))
