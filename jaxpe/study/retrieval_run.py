"""The study's retrieval step: for each task (``study.tasks``), train every (encoding, seed) model on
it through the ordinary trainer (``<workdir>/models/<task>/<name>``), score every row at every eval
length on the same held-out samples, combine the seeds, pair with rope (and the rope_alibi rows with
alibi), and re-check the emulation guarantee on retrieval. Also position interpolation's fine-tuning
(``finetuned_params``) for the text and the task rows.

Scores are cached per row next to the checkpoints (``retrieval_<name>.json``), fine-tuned weights as
``finetuned_<name>.npz``, both keyed by everything they depend on, so a rerun (or a resumed, killed
study) reuses them and writes the same tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxpe.model.build import build_model
from jaxpe.ops import checks as _checks
from jaxpe.study.config import (
  ENCODINGS,
  StudyConfig,
  cache_key,
  eval_model_config,
  model_dir,
  model_train_config,
  streaming_sizes,
  task_train_config,
)
from jaxpe.study.models import finetuned_cached, read_json, train_model, write_atomic
from jaxpe.study.retrieval import combine_task, paired_task, score_task, task_emulation
from jaxpe.train import data, run_files, tasks
from jaxpe.train.data_config import TaskConfig
from jaxpe.train.load import trained_params

__all__ = ["EVAL_SEED", "finetuned_params", "run_retrieval"]

EVAL_SEED = 20260
"""Seed of the held-out task samples (``tasks.held_out``): the same for every row, seed and run."""
SCORES_VERSION = 2
"""Bumped when ``score_task``'s dict changes (2: each sample's ``answers``), so older cached scores are
scored again."""


def finetuned_params(
  study: StudyConfig,
  name: str,
  seed: int,
  *,
  task: TaskConfig | None = None,
  tokens: np.ndarray | None = None,
  progress: bool = True,
) -> dict[str, np.ndarray]:
  """The weights of the ``finetuned`` row ``name`` (``rope_pi_ft``) and seed index ``seed``: its base's
  trained weights (of ``task``'s models, or the text models: then ``tokens`` [n] uint8 are the training
  bytes) after ``study.finetune_steps`` Adam steps (``finetune_learning_rate``) with its scaling at
  factor M = max(eval_multiples) (``eval_model_config``), at length M T and batch max(1, B // M) (about
  as many tokens per step as training), on the base's own data (text windows or task batches, seed
  ``train.seed + seed``). Cached as ``finetuned_<name>.npz`` in the base model's workdir.
  """
  progress = _checks.check_bool("progress", progress)
  base = model_train_config(study, name, seed, task)
  m = study.eval_multiples[-1]
  model_cfg = eval_model_config(study, name, m, task)
  seq_len, batch = m * base.seq_len, max(1, base.batch_size // m)
  if task is None:
    batch_at = lambda i: data.train_batch(tokens, step=i, seed=base.seed, batch_size=batch, seq_len=seq_len)  # noqa: E731
  else:
    batch_at = lambda i: tasks.task_batch(task, step=i, seed=base.seed, batch_size=batch, seq_len=seq_len)  # noqa: E731
  key = cache_key(
    base.model_dump(mode="json"),
    model_cfg.model_dump(mode="json"),
    seq_len,
    batch,
    study.finetune_steps,
    study.finetune_learning_rate,
  )
  where = f"{task.name}/" if task is not None else ""

  def announce() -> None:
    if progress:
      print(f"[study] fine-tuning {where}{model_dir(name, seed)} at length {seq_len}", flush=True)

  return finetuned_cached(
    Path(base.workdir) / f"finetuned_{name}.npz",
    key,
    model_cfg,
    base,
    batch_at,
    steps=study.finetune_steps,
    learning_rate=study.finetune_learning_rate,
    announce=announce,
  )


def _row(
  study: StudyConfig,
  task: TaskConfig,
  name: str,
  seed: int,
  samples_at: dict[int, np.ndarray],
  models: dict[str, dict[str, Any]],
  progress: bool,
) -> dict[str, Any]:
  """Row ``name``'s ``score_task`` dicts by ``str(multiple)`` for seed index ``seed`` (None where it
  cannot run), from the cache when its key matches; trains the row's model first when needed."""
  cfg = model_train_config(study, name, seed, task)
  tag = f"{task.name}/{model_dir(ENCODINGS[name].base or name, seed)}"
  if tag not in models:
    models[tag] = train_model(cfg, tag, tasks.fingerprint(task)["sha256"], progress)
  enc = ENCODINGS[name]
  key = cache_key(
    SCORES_VERSION,
    cfg.model_dump(mode="json"),
    models[tag]["step"],
    EVAL_SEED,
    study.task_samples,
    study.eval_multiples,
    enc.scaling,
    *([streaming_sizes(study, name, task)] if enc.streaming is not None else []),  # older keys stay
    [study.finetune_steps, study.finetune_learning_rate] if enc.finetuned else None,
  )
  path = Path(cfg.workdir) / f"retrieval_{name}.json"
  cached = read_json(path, "the row is scored again and the file rewritten") or {}
  if cached.get("key") == key and isinstance(cached.get("results"), dict):  # null numbers are NaN
    return {m: None if e is None else run_files.nan_for_null(e) for m, e in cached["results"].items()}
  if enc.finetuned:
    params = finetuned_params(study, name, seed, task=task, progress=progress)
  else:
    params = trained_params(cfg)
  if progress:
    print(
      f"[study] retrieval {task.name}/{model_dir(name, seed)} at {list(study.eval_multiples)}x", flush=True
    )
  row: dict[str, Any] = {}
  sizes = streaming_sizes(study, name, task)
  for m in study.eval_multiples:
    mcfg = eval_model_config(study, name, m, task)
    row[str(m)] = (
      None
      if mcfg is None
      else score_task(build_model(mcfg, params), samples_at[m], study.eval_batch_size, sizes)
    )
  write_atomic(path, run_files.json_text({"key": key, "results": row}))
  return row


def run_retrieval(
  study: StudyConfig, models: dict[str, dict[str, Any]], *, progress: bool = True
) -> dict[str, Any]:
  """Retrieval for every task, row and seed (``models`` gains each task model's summary under
  ``<task>/<model_dir>``).

  Returns:
    ``{"retrieval": {task: {name: {str(multiple): combine_task entry or None}}}, "retrieval_by_seed":
    {task: {name: [per seed {str(multiple): score_task dict or None}]}}, "retrieval_paired": {task:
    paired_task from rope}, "retrieval_vs_alibi": {task: paired_task of the rope_alibi rows from alibi},
    "retrieval_emulation_check": {task: task_emulation rows (seed 0's alibi weights)}}``; empty dicts
    without tasks.

  Raises:
    jaxpe.study.models.StudyInterrupted: a task model stopped before its ``num_steps``.
  """
  progress = _checks.check_bool("progress", progress)
  out: dict[str, dict[str, Any]] = {
    k: {}
    for k in (
      "retrieval",
      "retrieval_by_seed",
      "retrieval_paired",
      "retrieval_vs_alibi",
      "retrieval_emulation_check",
    )
  }
  ref = "rope" if "rope" in study.encodings else study.encodings[0]
  for task in study.tasks:
    t = task_train_config(study, task).seq_len
    samples_at = {
      m: tasks.held_out(task, seed=EVAL_SEED, count=study.task_samples, length=m * t)
      for m in study.eval_multiples
    }
    by_seed: dict[str, list[dict[str, Any]]] = {name: [] for name in study.encodings}
    for seed in range(study.seeds):
      for name in study.encodings:
        by_seed[name].append(_row(study, task, name, seed, samples_at, models, progress))
    out["retrieval"][task.name] = {
      n: {k: combine_task([r[k] for r in rows]) for k in rows[0]} for n, rows in by_seed.items()
    }
    out["retrieval_by_seed"][task.name] = by_seed
    out["retrieval_paired"][task.name] = paired_task(by_seed, ref)
    if "alibi" in study.encodings:
      emulated = {n: v for n, v in by_seed.items() if n.startswith("rope_alibi") or n == "alibi"}
      out["retrieval_vs_alibi"][task.name] = {
        n: v for n, v in paired_task(emulated, "alibi").items() if n != "alibi"
      }
      cfg = model_train_config(study, "alibi", 0, task)
      out["retrieval_emulation_check"][task.name] = task_emulation(
        cfg.model,
        trained_params(cfg),
        {m * t: s for m, s in samples_at.items()},
        study.eval_batch_size,
        study.eval_multiples[-1] * t,
      )
  return out
