"""The loss and one training or evaluation step as plain functions (no ``TrainConfig`` needed).

``jaxpe.train.trainer`` builds its run from these and ``jaxpe.train.optimizer``; other projects can
use them directly::

    tx = make_optimizer(3e-3, num_steps=1000, warmup_steps=100)  # jaxpe.train.optimizer
    model = Decoder(ModelConfig(), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
    train_step = make_train_step(graphdef)
    state, metrics = train_step(state, batch)  # batch [B, T + 1] int32

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


def next_token_loss(model: Callable[..., jax.Array], batch: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy in nats per token (scalar float32) of ``batch [B, T + 1]`` int32:
  inputs ``[:, :-1]``, targets ``[:, 1:]`` (token ids in ``[0, V)``); ``model`` maps ``[B, T]``
  tokens to ``[B, T, V]`` logits. A ``[B, 2, T + 1]`` batch (a synthetic task, ``jaxpe.train.tasks``)
  is tokens ``[:, 0]`` and a 0/1 answer mask ``[:, 1]``: the mean over the answer targets only
  (``mask[:, 1:]``; 0 for a batch without answers). Context parallelism takes only the 2-d form.

  Under a mesh that splits the sequence over C > 1 devices (``sharding.sequence_shards()``, inside
  ``activation_sharding``: context parallelism), inputs and targets go in the zig-zag order
  (``sharding.zigzag_inputs``; the model, a ``Decoder``, also gets each token's position and
  original slot), so every device holds the same causal work; the mean over tokens is the same.
  """
  weights = None
  if batch.ndim == 3:  # [B, 2, T + 1]: tokens and the answer mask of a synthetic task (jaxpe.train.tasks)
    batch, weights = batch[:, 0], batch[:, 1, 1:].astype(jnp.float32)
  inputs, targets = batch[:, :-1], batch[:, 1:]
  shards = sharding.sequence_shards()
  if shards == 1:
    logits = model(inputs)
  else:
    logits = model(**sharding.zigzag_inputs(inputs, shards))
    targets = context.to_zigzag(targets, shards)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  if weights is None:
    return losses.mean()
  return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def accumulated_value_and_grad(
  loss_fn: Callable[[Any, jax.Array], jax.Array], model: nnx.Module, batch: jax.Array, num_microbatches: int
) -> tuple[jax.Array, nnx.State]:
  """``(loss, grads)`` of ``loss_fn(model, batch)`` w.r.t. the model's ``nnx.Param``s, computed
  over ``num_microbatches`` equal micro-batches of ``batch [B, ...]`` in a ``jax.lax.scan``.

  ``loss_fn`` must be a mean over rows; the result is the mean of the micro-batch losses and
  gradients, which equals the whole batch's to float32 rounding while holding only one
  micro-batch's activations. Micro-batch j takes rows j, j + m, j + 2m, ... (m =
  ``num_microbatches``), so every device keeps its own rows.

  Raises:
    ValueError: B not divisible by ``num_microbatches`` (or ``num_microbatches`` < 1).
  """
  if num_microbatches < 1 or batch.shape[0] % num_microbatches:
    raise ValueError(
      f"grad_accum_steps ({num_microbatches}) must be >= 1 and divide the batch size ({batch.shape[0]})"
    )
  if num_microbatches == 1:
    return nnx.value_and_grad(loss_fn)(model, batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rows = batch.shape[0] // num_microbatches
  micro = batch.reshape(rows, num_microbatches, *batch.shape[1:]).swapaxes(0, 1)  # [m, B/m, ...]

  def loss_of(p, mb):
    return loss_fn(nnx.merge(graphdef, p, rest), mb)

  def body(carry, mb):
    loss_sum, grad_sum = carry
    mb = sharding.constrain(mb, ("batch",) + (None,) * (mb.ndim - 1))
    loss, grads = jax.value_and_grad(loss_of)(params, mb)
    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), _ = jax.lax.scan(body, zeros, micro)
  return loss / num_microbatches, jax.tree.map(lambda g: g / num_microbatches, grads)


def _tracing_context(mesh, rules):
  return contextlib.nullcontext() if mesh is None else sharding.activation_sharding(mesh, rules)


def make_train_step(
  graphdef: nnx.GraphDef,
  *,
  grad_accum_steps: int = 1,
  loss_fn: Callable[[Any, jax.Array], jax.Array] = next_token_loss,
  mesh: jax.sharding.Mesh | None = None,
  rules=sharding.DEFAULT_RULES,
  state_shardings: Any = None,
  batch_sharding: Any = None,
  skip_nonfinite: bool = True,
):
  """A jitted ``step(state, batch) -> (state, metrics)`` for the state of
  ``nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))`` (``graphdef`` is that split's).

  One optimizer step on ``batch [B, T + 1]`` int32 (``grad_accum_steps`` micro-batches, see
  ``accumulated_value_and_grad``). ``metrics``: ``loss``, the mean loss (nats/token, float32)
  before the update; ``grad_norm``, the global L2 norm of the (accumulated, unclipped) gradient;
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
  loss_fn: Callable[[Any, jax.Array], jax.Array] = next_token_loss,
  mesh: jax.sharding.Mesh | None = None,
  rules=sharding.DEFAULT_RULES,
  state_shardings: Any = None,
  batch_sharding: Any = None,
):
  """A jitted ``eval_step(state, batch) -> loss`` (scalar float32, nats/token) for the same state
  as ``make_train_step``; nothing is updated."""

  def eval_step(state, batch):
    with _tracing_context(mesh, rules):
      model, _ = nnx.merge(graphdef, state)
      return loss_fn(model, batch)

  if state_shardings is None:
    return jax.jit(eval_step)
  return jax.jit(eval_step, in_shardings=(state_shardings, batch_sharding))
