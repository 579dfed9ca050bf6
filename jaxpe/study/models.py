"""The study's models: train (or resume, or reuse when finished) a row's model through the ordinary
trainer, and position interpolation's fine-tuning (``rope_pi_ft``) of the trained rope weights.

A finished model is reused only when its run-defining keys (``run_checks.check_resume_config``) and
its data fingerprint (``summary.json``'s ``run.data.sha256``: ``jaxpe.train.data.fingerprint`` of the
corpus, ``jaxpe.train.tasks.fingerprint`` of a task) match the study's, as the trainer refuses to
resume on changed data (``data.allow_changed`` lets both go on).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpe.model.build import build_model, model_params
from jaxpe.model.config import ModelConfig
from jaxpe.ops import checks as _checks
from jaxpe.train import run_checks, run_files, run_guard, run_log, trainer
from jaxpe.train.config import TrainConfig
from jaxpe.train.load import trained_params
from jaxpe.train.steps import next_token_loss

__all__ = ["StudyInterrupted", "finetune", "finetuned_cached", "read_json", "train_model", "write_atomic"]


class StudyInterrupted(RuntimeError):
  """A model's training stopped before ``num_steps``; rerunning the study resumes it."""


def read_json(path: Path, then: str) -> dict[str, Any] | None:
  """The JSON object in ``path``; None when there is no file, or (with a warning naming the file, the
  reason and what happens ``then``) when it cannot be read or is not a JSON object."""
  if not path.is_file():
    return None
  try:
    value = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, ValueError) as e:
    print(
      f"[study] warning: cannot read {path} ({type(e).__name__}: {e}); {then}", file=sys.stderr, flush=True
    )
    return None
  if not isinstance(value, dict):
    print(f"[study] warning: {path} holds no JSON object; {then}", file=sys.stderr, flush=True)
    return None
  return value


def write_atomic(path: Path, text: str) -> None:
  run_files.write_atomic(path, text)  # through a flushed (fsync) temporary file and a rename


NOT_TRAINING_KEYS = (
  "workdir",
  "async_checkpoints",
  "checkpoint_every",
  "keep_checkpoints",
  "eval_every",
  "eval_batches",
  "sample_len",
  "sample_prompt",
  "stop_at",
  "max_seconds",
  "cpu_devices",
  "distributed",
  "mesh_shape",
  "logical_rules",
  "skip_nonfinite",
  *run_checks.RESUME_CHANGEABLE,
)
"""Keys (dotted, or sections) that do not change a finished model's weights (where and how it was
run, what it logged, its time limits; ``max_seconds``'s fitted schedule is ``summary.json``'s
``num_steps``): ``finished`` reuses a model when only these differ."""


def finished(cfg: TrainConfig, fingerprint: str) -> dict[str, Any] | None:
  """The run's ``summary.json`` when it reached ``num_steps``, else None.

  Raises:
    ValueError: the finished run's ``config.json`` differs from ``cfg`` in a run-defining key (seed,
      model, data, seq_len, batch_size: ``run_checks.check_resume_config``), or its data fingerprint is
      not ``fingerprint`` (the sha256 of the data now) and ``cfg.data.allow_changed`` is false."""
  path = Path(cfg.workdir) / "summary.json"
  summary = read_json(path, "the model is resumed from its checkpoints, which rewrites it")
  if summary is None or not isinstance(summary.get("step"), int):
    return None
  length = summary.get("num_steps") or cfg.num_steps
  if not isinstance(length, int) or summary["step"] < length:
    return None
  saved = run_files.read_saved_config(Path(cfg.workdir) / "config.json")
  if saved is not None:  # a finished model of another seed, model, data or batch stream is not reused
    run_checks.check_resume_config(saved, cfg, source=str(Path(cfg.workdir) / "config.json"))
    # Nor one trained under other training keys that a resume may change (learning rate, steps,
    # warmup, ...): reused only on the same config (issue 48 kind 5).
    differing = run_checks.config_differences(saved, cfg, ignore=NOT_TRAINING_KEYS)
    if differing:
      raise ValueError(
        f"the finished model in {cfg.workdir} was trained with other settings than the study now gives "
        f"({differing}; saved in {Path(cfg.workdir) / 'config.json'}): it is not reused under the new "
        "config; use a new study workdir (or the saved values)"
      )
  run = summary.get("run")
  old = (
    run.get("data", {}).get("sha256") if isinstance(run, dict) and isinstance(run.get("data"), dict) else None
  )
  if old is not None and old != fingerprint and not cfg.data.allow_changed:
    raise ValueError(
      f"the finished model in {cfg.workdir} was trained on other data (fingerprint {str(old)[:12]}, the data "
      f"now gives {fingerprint[:12]}): use a new workdir, or train.data.allow_changed=true to reuse it anyway"
    )
  return summary


def train_model(cfg: TrainConfig, tag: str, fingerprint: str, progress: bool) -> dict[str, Any]:
  """The ``summary.json`` dict of the finished run of ``cfg`` (trained or resumed here when not
  finished: ``jaxpe.train.trainer.train``), with ``trained_now``.

  Raises:
    StudyInterrupted: the run stopped before ``num_steps`` (``stop_at``, ``max_seconds``, a signal).
    ValueError: ``finished``'s, or ``trainer.train``'s.
  """
  summary = finished(cfg, fingerprint)
  trained_now = summary is None
  if trained_now:
    print(f"[study] training {tag} in {cfg.workdir}", flush=True)
    # named as summary.json names them (eval_bits_per_answer for a task model), as a reused model's are
    summary = run_log.summary_dict(trainer.train(cfg, progress=progress))
    length = summary.get("num_steps") or cfg.num_steps  # the schedule (fitted to max_seconds)
    if summary["step"] < length:
      raise StudyInterrupted(
        f"model {tag!r} stopped at step {summary['step']} of {length}; rerun the same command to "
        f"resume it from {cfg.workdir}/checkpoints (stopped by stop_at, max_seconds or a signal)"
      )
  return {"trained_now": trained_now, **{k: v for k, v in summary.items() if k != "sample"}}


def finetune(
  cfg: ModelConfig,
  params: dict[str, np.ndarray],
  batch_at: Callable[[int], np.ndarray],
  *,
  steps: int,
  learning_rate: float,
) -> dict[str, np.ndarray]:
  """``params`` (``jaxpe.model.build.model_params`` layout) of a model built from ``cfg`` after
  ``steps`` Adam steps (constant ``learning_rate``, b2 0.95, global-norm clip 1, no weight decay) of
  ``jaxpe.train.steps.next_token_loss`` on ``batch_at(i)`` (``[B, T + 1]`` text or ``[B, 2, T + 1]``
  task batches, the loss then on the answers).

  Raises:
    ValueError: ``steps`` < 0, or ``learning_rate`` not finite and > 0.
    jaxpe.train.run_guard.NonFiniteError: a step whose loss, gradient norm or updated parameters are
      not finite (each step is checked after its update, the last one too, as the trainer's), naming
      the step; no non-finite parameters are returned.
  """
  if not _checks.is_int(steps) or steps < 0:
    raise ValueError(f"steps must be an int >= 0, got {steps!r}")
  steps = int(steps)
  if not (np.isfinite(learning_rate) and learning_rate > 0):
    raise ValueError(f"learning_rate must be finite and > 0, got {learning_rate!r}")
  model = build_model(cfg, params)
  graphdef, weights, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate, b2=0.95))
  opt_state = tx.init(weights)

  @jax.jit
  def step(weights, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda w: next_token_loss(nnx.merge(graphdef, w, rest), batch))(weights)
    updates, opt_state = tx.update(grads, opt_state, weights)
    weights = optax.apply_updates(weights, updates)
    return weights, opt_state, jnp.stack([loss, optax.tree.norm(grads), optax.tree.norm(weights)])

  for i in range(steps):
    weights, opt_state, norms = step(weights, opt_state, jnp.asarray(batch_at(i)))
    loss, grad_norm, param_norm = (float(x) for x in np.asarray(norms))
    if not np.isfinite([loss, grad_norm, param_norm]).all():  # after the update: the last one too
      raise run_guard.NonFiniteError(
        f"fine-tuning step {i + 1} of {steps} is not finite: loss {loss}, gradient norm {grad_norm}, "
        f"parameter norm after the update {param_norm}; lower finetune_learning_rate"
      )
  return model_params(nnx.merge(graphdef, weights, rest))


def finetuned_cached(
  path: Path,
  key: str,
  cfg: ModelConfig,
  base: TrainConfig,
  batch_at: Callable[[int], np.ndarray],
  *,
  steps: int,
  learning_rate: float,
  announce: Callable[[], None] = lambda: None,
) -> dict[str, np.ndarray]:
  """``finetune`` of ``base``'s trained weights, cached in ``path`` (an ``.npz`` holding ``key``): a
  cache of another key, or a damaged one, is fine-tuned again (after ``announce()``) and rewritten."""
  if path.is_file():
    try:
      with np.load(path) as f:
        if str(f["__key__"]) == key:
          return {k: f[k] for k in f.files if k != "__key__"}
    except (OSError, ValueError, KeyError):
      pass
  announce()
  params = finetune(cfg, trained_params(base), batch_at, steps=steps, learning_rate=learning_rate)
  tmp = path.with_name(path.name.replace(".npz", ".tmp.npz"))
  np.savez(tmp, __key__=np.asarray(key), **params)
  tmp.replace(path)
  return params
