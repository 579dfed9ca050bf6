"""The run's state: the model and optimizer built into their shardings on the mesh, and the state a
run continues from (a fresh one, or the newest intact checkpoint restored, in either layer layout,
with its position in the batch stream and its learning-rate schedule).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxpe.model import decoder as model_lib
from jaxpe.model.decoder import Decoder
from jaxpe.train import checkpoint, load, run_checks, sharding
from jaxpe.train.config import TrainConfig
from jaxpe.train.optimizer import make_optimizer

__all__ = [
  "RunState",
  "abstract_state",
  "create_state",
  "load_init_from",
  "num_params",
  "restore_or_create",
  "with_schedule",
]


def _make(cfg: TrainConfig):
  model = Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)


def create_state(cfg: TrainConfig, mesh: jax.sharding.Mesh):
  """Builds model and optimizer directly into their shardings on ``mesh`` (``cfg.logical_rules``).

  Returns:
    ``(graphdef, state, shardings)``: the ``nnx.split`` of ``(Decoder, nnx.Optimizer)`` and the
    ``NamedSharding`` pytree of ``state`` (from the parameters' logical axis names).
  """
  model, optimizer = sharding.create_sharded(functools.partial(_make, cfg), mesh, cfg.logical_rules)
  graphdef, state = nnx.split((model, optimizer))
  return graphdef, state, sharding.state_shardings(state, mesh, cfg.logical_rules)


def abstract_state(cfg: TrainConfig, mesh: jax.sharding.Mesh):
  """``(graphdef, abstract_state)`` of ``create_state`` without computing anything: the leaves are
  ``jax.ShapeDtypeStruct`` with their ``NamedSharding`` on ``mesh`` (restore targets)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(functools.partial(_make, cfg)))
  shardings = sharding.state_shardings(abstract, mesh, cfg.logical_rules)
  return graphdef, checkpoint.abstract_with_shardings(abstract, shardings)


def num_params(state: nnx.State) -> int:
  """The number of model parameters (``nnx.Param`` elements) in a ``create_state`` state."""
  return int(
    sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(nnx.filter_state(state[0], nnx.Param)))
  )


def with_schedule(graphdef, state, cfg: TrainConfig, num_steps: int):
  """``graphdef`` whose optimizer runs the schedule of ``num_steps`` steps (same state layout)."""
  model, optimizer = nnx.merge(graphdef, state)
  optimizer.tx = make_optimizer(cfg, num_steps=num_steps)
  return nnx.graphdef((model, optimizer))


def _resumed_schedule(meta: dict[str, Any], cfg: TrainConfig) -> tuple[int, bool]:
  """(schedule length, already fitted) to continue a checkpoint with: the saved schedule unless the
  configured ``num_steps`` changed since (then ``cfg.num_steps``, to be fitted again)."""
  saved_num_steps = meta.get("config", {}).get("num_steps")
  if "schedule_steps" in meta and saved_num_steps == cfg.num_steps:
    return int(meta["schedule_steps"]), bool(meta.get("schedule_fitted", False))
  return cfg.num_steps, False


def _saved_layout(meta: dict[str, Any], saved_config: str | None, cfg: TrainConfig) -> bool:
  """``model.scan_layers`` of the run that wrote a checkpoint: from its metadata, else from the
  saved ``config.json``, else the current config's."""
  if isinstance(meta.get("config"), dict):
    return bool(meta["config"].get("model", {}).get("scan_layers", False))
  if saved_config is not None:
    return bool(json.loads(saved_config).get("model", {}).get("scan_layers", False))
  return cfg.model.scan_layers


def nonfinite_reason(state: Any) -> str | None:
  """Restore check: a reason when ``state`` holds a NaN or infinity (written by an older version).

  Checked on the host, shard by shard (each process its own shards, then the processes agree), with
  no XLA computation: eager per-leaf reductions on sharded arrays dispatch one small SPMD program
  with an all-reduce per leaf, and on the CPU runtime such a queue of asynchronous collective
  programs deadlocked (one device's launch waited on the in-flight limit while the other devices
  waited in the all-reduce; XLA aborted after 40 s)."""
  finite = True
  for x in jax.tree.leaves(state):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    shards = [s.data for s in x.addressable_shards] if isinstance(x, jax.Array) else [x]
    finite = finite and all(bool(np.isfinite(np.asarray(d)).all()) for d in shards)
  if jax.process_count() > 1:  # every process decides alike (the same step is used or moved aside)
    finite = bool(np.all(multihost_utils.process_allgather(np.bool_(finite))))
  return None if finite else "it holds non-finite values"


@dataclass
class RunState:
  """Where a run stands: ``graphdef`` and ``state`` of ``(Decoder, nnx.Optimizer)`` (the optimizer
  in ``graphdef`` runs the schedule of ``schedule_steps`` steps), ``step`` optimizer steps done (also
  the position in the batch stream), ``skipped`` non-finite steps skipped so far, and ``fitted``:
  whether the schedule was already fitted to ``max_seconds`` (``jaxpe.train.pacing``); ``init_from``:
  ``{"path", "step"}`` of the checkpoint the parameters started from (``cfg.init_from``), else None."""

  graphdef: nnx.GraphDef
  state: nnx.State
  schedule_steps: int
  step: int = 0
  skipped: int = 0
  fitted: bool = False
  init_from: dict[str, Any] | None = None

  @property
  def updates(self) -> int:
    """Updates applied so far (steps less the skipped ones): the optimizer's schedule count."""
    return self.step - self.skipped


def load_init_from(cfg: TrainConfig, state: nnx.State, state_shardings: Any) -> dict[str, Any]:
  """Replaces the model parameters in ``state`` (a ``create_state`` state) by those of the latest
  checkpoint in ``cfg.init_from`` (``jaxpe.train.load.init_source``), placed in their shardings of
  ``state_shardings`` (each process fills its own shards); the optimizer state is left as created.

  Returns:
    ``{"path": cfg.init_from, "step": the source checkpoint's step}``.

  Raises:
    ValueError: a parameter missing on either side or of another shape (naming ``init_from``, the
      parameter's path and both shapes); ``init_source``'s errors (a missing source, no intact checkpoint).
  """
  source, step = load.init_source(cfg)
  where = f"init_from {cfg.init_from!r} (checkpoint of step {step})"
  src = {".".join(map(str, k)): v for k, v in nnx.traversals.flatten_mapping(source).items()}
  params = nnx.filter_state(state[0], nnx.Param)
  dest = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
  missing, extra = sorted(dest.keys() - src.keys()), sorted(src.keys() - dest.keys())
  if missing or extra:
    raise ValueError(
      f"{where} has other parameters than this model: missing {missing[:8]}, unexpected {extra[:8]} "
      "(init_from needs a run of the same architecture)"
    )
  for name, var in dest.items():
    if tuple(src[name].shape) != tuple(var.shape):
      raise ValueError(
        f"{where}: parameter {name!r} has shape {tuple(src[name].shape)} there, this model's is "
        f"{tuple(var.shape)} (init_from needs the same parameter shapes)"
      )
  shardings = {
    ".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.filter_state(state_shardings[0], nnx.Param))
  }
  for name, var in dest.items():
    value = np.asarray(src[name], var.dtype)
    var.set_value(
      jax.make_array_from_callback(value.shape, shardings[name].get_value(), lambda i, v=value: v[i])
    )
  return {"path": cfg.init_from, "step": step}


def restore_or_create(
  cfg: TrainConfig,
  mngr,
  mesh: jax.sharding.Mesh,
  *,
  saved_config: str | None,
  fingerprint: dict[str, Any],
) -> tuple[RunState, Any, dict[str, Any] | None]:
  """The state a run starts from: the newest intact checkpoint in ``mngr`` (checked against ``cfg``
  and ``fingerprint`` before anything is loaded; a checkpoint of the other ``scan_layers`` layout is
  converted into this one), else a fresh ``create_state`` (with ``cfg.init_from``'s model parameters:
  ``load_init_from``).

  Returns:
    ``(run_state, state_shardings, meta)``; ``meta`` is the restored checkpoint's metadata, None for
    a fresh state.

  Raises:
    ValueError: the checkpoint's config or data differ (``run_checks.check_resume_config``,
      ``run_checks.check_resume_data``); a fresh run's ``cfg.init_from`` that ``load_init_from`` refuses.
    FileNotFoundError: a fresh run's ``cfg.init_from`` holds no run or no checkpoint.
    checkpoint.CheckpointError: none of the saved checkpoints is intact.
  """
  graphdef, state, state_shardings = create_state(cfg, mesh)

  def check_meta(meta):
    if "config" in meta:
      run_checks.check_resume_config(meta["config"], cfg, source=f"the checkpoint of step {meta['step']}")
    run_checks.check_resume_data(meta, fingerprint, cfg)

  def restore_target(meta):  # in the layer layout the checkpoint was written in
    saved_scan = _saved_layout(meta, saved_config, cfg)
    if saved_scan == cfg.model.scan_layers:
      return checkpoint.abstract_with_shardings(state, state_shardings)
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"scan_layers": saved_scan})})
    return abstract_state(other, mesh)[1]

  run = RunState(graphdef, state, schedule_steps=cfg.num_steps)  # fitted to max_seconds once
  restored = checkpoint.restore_latest(
    mngr, restore_target, check_meta=check_meta, check_state=nonfinite_reason
  )
  meta = None
  if restored is not None:
    saved, meta = restored
    if _saved_layout(meta, saved_config, cfg) != cfg.model.scan_layers:  # loop <-> scanned layers
      convert = model_lib.to_scan_layout if cfg.model.scan_layers else model_lib.to_loop_layout
      # One jitted program into the target shardings (not eager per-leaf stacking on sharded arrays).
      convert = jax.jit(convert, out_shardings=nnx.to_pure_dict(state_shardings))
      nnx.replace_by_pure_dict(state, convert(nnx.to_pure_dict(saved)))
      saved = state
    run.state = saved
    run.step, run.skipped = int(meta["data_position"]), int(meta.get("skipped_steps", 0))
    run.schedule_steps, run.fitted = _resumed_schedule(meta, cfg)
    run.init_from = meta.get("init_from")
  elif cfg.init_from is not None:  # a fresh run: its parameters from another run (a resume: its own)
    run.init_from = load_init_from(cfg, run.state, state_shardings)
  if run.schedule_steps != cfg.num_steps:
    run.graphdef = with_schedule(run.graphdef, run.state, cfg, run.schedule_steps)
  return run, state_shardings, meta
