"""The study from start to finish: train (or resume) each model, evaluate each row, write the outputs.

Each model trains in its own workdir ``<workdir>/models/<name>``, so the trainer's checkpoints make a
killed study resume the model it was training, and a finished model (``summary.json`` at
``num_steps``) is not trained again; evaluations are cached next to the checkpoints
(``eval_<name>.json``, keyed by everything they depend on).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxpe.model.build import build_model
from jaxpe.ops import checks as _checks
from jaxpe.study.config import (
  ENCODINGS,
  StudyConfig,
  cache_key,
  eval_model_config,
  model_dir,
  model_train_config,
)
from jaxpe.study.evaluation import emulation_check, evaluate, study_windows
from jaxpe.study.report import markdown, plot_bits_per_byte, plot_loss_vs_position
from jaxpe.study.retrieval_run import finetuned_params, run_retrieval
from jaxpe.study.seeds import combine_seeds, paired_seeds
from jaxpe.train import data, run_checks, run_files, trainer
from jaxpe.train.config import TrainConfig
from jaxpe.train.load import trained_params

__all__ = ["StudyInterrupted", "run_study"]


class StudyInterrupted(RuntimeError):
  """A model's training stopped before ``num_steps``; rerunning the study resumes it."""


def _finished(cfg: TrainConfig) -> dict[str, Any] | None:
  """The run's ``summary.json`` when it reached ``num_steps``, else None.

  Raises:
    ValueError: the finished run's ``config.json`` differs from ``cfg`` in a run-defining key (seed,
      model, data, seq_len, batch_size: ``run_checks.check_resume_config``)."""
  path = Path(cfg.workdir) / "summary.json"
  summary = _read_json(path, "the model is resumed from its checkpoints, which rewrites it")
  if summary is None or not isinstance(summary.get("step"), int):
    return None
  length = summary.get("num_steps") or cfg.num_steps
  if not isinstance(length, int) or summary["step"] < length:
    return None
  saved = run_files.read_saved_config(Path(cfg.workdir) / "config.json")
  if saved is not None:  # a finished model of another seed, model, data or batch stream is not reused
    run_checks.check_resume_config(saved, cfg, source=str(Path(cfg.workdir) / "config.json"))
  return summary


def _read_json(path: Path, then: str) -> dict[str, Any] | None:
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


def _write_atomic(path: Path, text: str) -> None:
  run_files.write_atomic(path, text)  # through a flushed (fsync) temporary file and a rename


@contextlib.contextmanager
def _compilation_cache(path: Path) -> Iterator[None]:
  """XLA's persistent compilation cache in ``path`` while the study runs, unless the process already
  has one (``jax_compilation_cache_dir``): the seeds of an encoding, its format training and its passkey
  evaluation compile the same programs with other weights, and a rerun compiles nothing again. The
  settings before it are restored after, so a later study in this process uses its own workdir and
  other work in the process does not write into this one."""
  if jax.config.jax_compilation_cache_dir:
    yield
    return
  settings = {
    "jax_compilation_cache_dir": str(path),
    "jax_persistent_cache_min_compile_time_secs": 0.2,
    "jax_persistent_cache_min_entry_size_bytes": 0,
  }
  before = {k: getattr(jax.config, k) for k in settings}
  for k, v in settings.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()  # take the directory even after an earlier compile in this process
  try:
    yield
  finally:
    for k, v in before.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


def run_study(study: StudyConfig, *, progress: bool = True) -> dict[str, Any]:
  """Trains (or resumes) every model, evaluates every row and writes the outputs to ``study.workdir``.

  A model whose run reached ``train.num_steps`` is not trained again; an interrupted one resumes
  from its last checkpoint (``jaxpe.train.trainer.train``). Evaluations are cached per row in the model's
  workdir and recomputed only when the model, data, windows or eval lengths change.

  Returns:
    The ``study.json`` dict: ``results[name][str(multiple)]`` is an ``evaluate`` dict, or None where
    the row cannot run at that length; ``models[name]`` says whether it was trained in this process.

  Raises:
    StudyInterrupted: a model stopped before ``num_steps`` (``stop_at``, ``max_seconds``, a signal);
      nothing is evaluated or written, and a rerun resumes it.
    ValueError: held-out data too small for the windows, or any ``trainer.train`` error.
  """
  progress = _checks.check_bool("progress", progress)
  out = Path(study.workdir)
  out.mkdir(parents=True, exist_ok=True)
  with _compilation_cache(out / "xla_cache"):
    return _run_study(study, out, progress)


def _run_study(study: StudyConfig, out: Path, progress: bool) -> dict[str, Any]:
  start = time.time()
  windows = study_windows(study)
  by_seed: dict[str, list[dict[str, Any]]] = {name: [] for name in study.encodings}
  models: dict[str, dict[str, Any]] = {}
  for seed in range(study.seeds):
    for name in study.encodings:
      by_seed[name].append(_evaluate_row(study, name, seed, windows, models, progress))
  results = {
    name: {k: combine_seeds([r[k] for r in rows]) for k in rows[0]} for name, rows in by_seed.items()
  }
  emu = emulation_check(study, windows) if "alibi" in study.encodings else []
  retrieval = run_retrieval(study, windows, progress=progress) if study.passkey_depths else {}
  ref = "rope" if "rope" in study.encodings else study.encodings[0]
  report = {
    "config": study.model_dump(mode="json"),
    "eval_lengths": [m * study.train.seq_len for m in study.eval_multiples],
    "models": models,
    "results": results,
    "paired_reference": ref,
    "paired": paired_seeds(by_seed, ref),
    "results_by_seed": by_seed,
    "emulation_check": emu,
    **retrieval,
    "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__} on "
    f"{jax.devices()[0].platform})",
    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    "wall_seconds_this_process": time.time() - start,
  }
  _write_atomic(out / "study.json", run_files.json_text(report, indent=1))  # NaN as null
  _write_atomic(out / "study.md", markdown(study, report))
  plot_bits_per_byte(study, report, out / "bits_per_byte.png")
  plot_loss_vs_position(study, report, out / "loss_vs_position.png")
  return report


def _evaluate_row(
  study: StudyConfig,
  name: str,
  seed: int,
  windows: Any,
  models: dict[str, dict[str, Any]],
  progress: bool,
) -> dict[str, Any]:
  """Trains (or resumes, or skips when finished) the model of row ``name`` and seed index ``seed``
  (recorded in ``models`` under its directory name) and returns the row's ``evaluate`` dicts by
  ``str(multiple)``, from the cache when its key matches."""
  cfg = model_train_config(study, name, seed)
  base = ENCODINGS[name].base or name
  tag = model_dir(base, seed)
  if tag not in models:
    summary = _finished(cfg)
    trained_now = summary is None
    if trained_now:
      print(f"[study] training {tag} in {cfg.workdir}", flush=True)
      summary = trainer.train(cfg, progress=progress).__dict__
      length = summary.get("num_steps") or cfg.num_steps  # the schedule (fitted to max_seconds)
      if summary["step"] < length:
        raise StudyInterrupted(
          f"model {tag!r} stopped at step {summary['step']} of {length}; rerun the same command to "
          f"resume it from {cfg.workdir}/checkpoints (stopped by stop_at, max_seconds or a signal)"
        )
    models[tag] = {"trained_now": trained_now, **{k: v for k, v in summary.items() if k != "sample"}}
  cache_path = Path(cfg.workdir) / f"eval_{name}.json"
  finetuned = ENCODINGS[name].finetuned  # evaluated on weights fine-tuned with its scaling (retrieval_run)
  key = cache_key(
    cfg.model_dump(mode="json"),
    models[tag]["step"],
    hashlib.sha256(windows.tobytes()).hexdigest(),
    study.eval_multiples,
    ENCODINGS[name].scaling,
    [finetuned, study.passkey_steps, study.passkey_fraction, study.passkey_learning_rate]
    if finetuned
    else None,
  )
  cached = _read_json(cache_path, "the row is evaluated again and the file rewritten") or {}
  if cached.get("key") == key and isinstance(cached.get("results"), dict):  # null numbers are NaN
    return {m: None if e is None else run_files.nan_for_null(e) for m, e in cached["results"].items()}
  row: dict[str, Any] = {}
  if finetuned:
    d = study.train.data
    tokens = data.load_corpus(d.path, max_bytes=d.max_bytes, eval_fraction=d.eval_fraction).train
    params = finetuned_params(study, name, seed, tokens, progress)
  else:
    params = trained_params(cfg)
  for m in study.eval_multiples:
    mcfg = eval_model_config(study, name, m)
    if mcfg is None:
      row[str(m)] = None
      continue
    print(f"[study] evaluating {model_dir(name, seed)} at {m}x ({m * study.train.seq_len} bytes)", flush=True)
    row[str(m)] = evaluate(build_model(mcfg, params), windows, m * study.train.seq_len, study.eval_batch_size)
  _write_atomic(cache_path, run_files.json_text({"key": key, "results": row}))
  return row
