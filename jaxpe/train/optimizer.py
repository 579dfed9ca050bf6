"""The optimizer factory: AdamW with linear warmup, cosine decay, global-norm clipping and weight
decay on kernels and embeddings only.

One factory serves a run and code without a config::

    tx = make_optimizer(cfg)                                  # a TrainConfig's settings
    tx = make_optimizer(cfg, num_steps=341)                   # the same, schedule of 341 steps
    tx = make_optimizer(3e-3, num_steps=1000, warmup_steps=100)  # plain arguments

``learning_rate_schedule`` is the schedule it uses (the trainer logs its value at each step).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpe.train.config import TrainConfig

__all__ = ["OPTIMIZER_DEFAULTS", "decay_mask", "learning_rate_schedule", "make_optimizer", "master_weights"]

OPTIMIZER_DEFAULTS = {
  "warmup_steps": 0,
  "min_lr_ratio": 0.1,
  "weight_decay": 0.1,
  "b1": 0.9,
  "b2": 0.95,
  "grad_clip": 1.0,
}
"""``make_optimizer``'s settings when neither a keyword nor a ``TrainConfig`` gives them."""


def decay_mask(params):
  """Weight-decay mask for a parameter pytree (an ``nnx.State`` or nested dicts of arrays).

  True for kernels and embeddings (rank >= 2 per layer, not named ``bias``, ``*_bias`` or
  ``scale``); False for biases of any rank (per-head q/k/v biases ``[N, H]``, the moe experts'
  ``gate_bias`` / ``up_bias`` ``[E, F]`` and ``down_bias`` ``[E, D]``), LayerNorm scales/biases
  and the other rank-1 parameters of a layer (attention ``sinks`` ``[N]``, KERPLE's ``r1`` /
  ``r2``, FIRE's MLP vectors). The same leaves are decayed in the ``scan_layers`` layout: the
  rank is counted per layer, without the stacked ``[L, ...]`` axis of a ``blocks`` tree whose
  next key is not a layer index.
  """

  def decay(path, x) -> bool:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    names = [k for k in keys if isinstance(k, str)]
    rank = jnp.ndim(x)
    at = keys.index("blocks") if "blocks" in keys else -1
    if at >= 0 and at + 1 < len(keys) and not isinstance(keys[at + 1], int):  # scan layout: [L, ...]
      rank -= 1
    last = names[-1] if names else ""
    return rank >= 2 and last not in ("bias", "scale") and not last.endswith("_bias")

  return jax.tree_util.tree_map_with_path(decay, params)


class MasterState(NamedTuple):
  """``master_weights``' state: ``master`` the float32 copy of the parameters, ``inner`` the wrapped
  optimizer's state (built on ``master``: float32 moments)."""

  master: optax.Params
  inner: optax.OptState


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` run on a float32 copy of narrower (bfloat16) parameters: mixed-precision training as
  maxtext's ``weight_dtype`` / levanter's ``mp`` policy (parameters stored in ``param_dtype``, the
  optimizer's state and the master weights float32).

  Each update casts the gradients to float32, applies ``inner``'s update to the master weights, and
  returns ``round(master) - params`` in the parameters' dtype, so that ``params + update`` (what
  ``optax.apply_updates`` and ``nnx.Optimizer`` do) is the new master weights rounded to that dtype
  (exactly whenever the subtraction is exact: the two are close, Sterbenz; else within one unit in the
  last place, and the next update starts again from the master weights, so no error accumulates).
  Float32 parameters are their own master (the update is ``inner``'s).
  """

  def init(params):
    master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return MasterState(master, inner.init(master))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("master_weights needs the parameters in update()")
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    step, inner_state = inner.update(grads, state.inner, state.master)
    master = optax.apply_updates(state.master, step)
    out = jax.tree.map(lambda m, p: m.astype(p.dtype) - p, master, params)
    return out, MasterState(master, inner_state)

  return optax.GradientTransformation(init, update)


def learning_rate_schedule(
  learning_rate: float, *, num_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.1
) -> optax.Schedule:
  """The learning rate per optimizer step (a function of the optimizer's update count, from 0):
  0 at count 0, rising linearly to the peak ``learning_rate`` at ``warmup_steps``, then a cosine
  decay to ``min_lr_ratio * learning_rate`` at ``num_steps`` (the decay length includes the
  warmup). The update of training step s (1-based, no skipped steps) uses the value at count s - 1.
  Source: ``optax.warmup_cosine_decay_schedule``. Arguments are not checked (``make_optimizer``
  checks them)."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=learning_rate,
    warmup_steps=warmup_steps,
    decay_steps=max(num_steps, warmup_steps + 1),  # includes the warmup
    end_value=learning_rate * min_lr_ratio,
  )


def make_optimizer(
  learning_rate: float | TrainConfig,
  *,
  num_steps: int | None = None,
  warmup_steps: int | None = None,
  min_lr_ratio: float | None = None,
  weight_decay: float | None = None,
  b1: float | None = None,
  b2: float | None = None,
  grad_clip: float | None = None,
  param_dtype: str | None = None,
) -> optax.GradientTransformation:
  """AdamW with linear warmup, cosine decay to ``min_lr_ratio * learning_rate``, global-norm
  clipping at ``grad_clip``.

  ``learning_rate`` is the peak learning rate, or a ``TrainConfig`` whose fields of the same names
  (``learning_rate``, ``num_steps``, ``warmup_steps``, ``min_lr_ratio``, ``weight_decay``, ``b1``,
  ``b2``, ``grad_clip``) give every setting; a keyword given (not None) overrides the config's
  value. Without a config, ``num_steps`` is required and the others default to
  ``OPTIMIZER_DEFAULTS`` (warmup 0, ``min_lr_ratio`` 0.1, weight decay 0.1, betas 0.9 / 0.95,
  clipping at 1.0).

  Decoupled weight decay (``weight_decay``, per step, multiplied by the learning rate) applies only
  where ``decay_mask`` is True. Learning rates are per optimizer step (``learning_rate_schedule``):
  0 at step 0, the peak ``learning_rate`` after ``warmup_steps`` steps, ``min_lr_ratio *
  learning_rate`` at ``num_steps`` (the decay length includes the warmup). Source: Loshchilov &
  Hutter, arXiv 1711.05101 (AdamW); ``optax.warmup_cosine_decay_schedule``.

  ``param_dtype`` (default: the config's ``model.param_dtype``, else float32): for ``"bfloat16"``
  parameters the optimizer runs on float32 master weights (``master_weights``).

  Raises:
    TypeError: a number ``learning_rate`` without ``num_steps``.
    ValueError: a non-positive ``learning_rate``/``num_steps``/``grad_clip``, a negative
      ``warmup_steps``/``weight_decay``, ``min_lr_ratio`` outside [0, 1] or betas outside [0, 1), a
      ``param_dtype`` other than float32 / bfloat16.
  """
  given = {
    "num_steps": num_steps,
    "warmup_steps": warmup_steps,
    "min_lr_ratio": min_lr_ratio,
    "weight_decay": weight_decay,
    "b1": b1,
    "b2": b2,
    "grad_clip": grad_clip,
  }
  cfg = None
  if isinstance(learning_rate, TrainConfig):
    cfg = learning_rate
    learning_rate = cfg.learning_rate
    s = {k: getattr(cfg, k) if v is None else v for k, v in given.items()}
  else:
    if num_steps is None:
      raise TypeError(
        "make_optimizer() needs num_steps when learning_rate is a number (or pass a TrainConfig)"
      )
    s = {k: OPTIMIZER_DEFAULTS.get(k) if v is None else v for k, v in given.items()}
  checks = (
    ("learning_rate", learning_rate, learning_rate > 0, "> 0"),
    ("num_steps", s["num_steps"], s["num_steps"] > 0, "> 0"),
    ("warmup_steps", s["warmup_steps"], s["warmup_steps"] >= 0, ">= 0"),
    ("min_lr_ratio", s["min_lr_ratio"], 0 <= s["min_lr_ratio"] <= 1, "in [0, 1]"),
    ("weight_decay", s["weight_decay"], s["weight_decay"] >= 0, ">= 0"),
    ("b1", s["b1"], 0 <= s["b1"] < 1, "in [0, 1)"),
    ("b2", s["b2"], 0 <= s["b2"] < 1, "in [0, 1)"),
    ("grad_clip", s["grad_clip"], s["grad_clip"] > 0, "> 0"),
  )
  for name, value, ok, accepted in checks:
    if not ok:
      raise ValueError(f"{name} must be {accepted}, got {value}")
  schedule = learning_rate_schedule(
    learning_rate, num_steps=s["num_steps"], warmup_steps=s["warmup_steps"], min_lr_ratio=s["min_lr_ratio"]
  )
  tx = optax.chain(
    optax.clip_by_global_norm(s["grad_clip"]),
    optax.adamw(schedule, b1=s["b1"], b2=s["b2"], weight_decay=s["weight_decay"], mask=decay_mask),
  )
  if param_dtype is None and cfg is not None:
    param_dtype = cfg.model.param_dtype
  if param_dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"param_dtype must be float32 or bfloat16, got {param_dtype!r}")
  return tx if param_dtype in (None, "float32") else master_weights(tx)
