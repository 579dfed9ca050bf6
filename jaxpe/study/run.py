"""The study from start to finish: train (or resume) each model, evaluate each row, run the retrieval
tasks, write the outputs.

Each model trains in its own workdir ``<workdir>/models/<name>`` (a task's in
``<workdir>/models/<task>/<name>``), so the trainer's checkpoints make a killed study resume the model
it was training, and a finished model (``summary.json`` at ``num_steps``, on the same data: its
fingerprint) is not trained again (``jaxpe.study.models``); evaluations are cached next to the
checkpoints (``eval_<name>.json``, ``retrieval_<name>.json``, keyed by everything they depend on).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
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
  streaming_sizes,
)
from jaxpe.study.evaluation import emulation_check, evaluate, study_windows
from jaxpe.study.models import StudyInterrupted, read_json, train_model, write_atomic
from jaxpe.study.report import markdown, plot_bits_per_byte, plot_loss_vs_position, plot_retrieval
from jaxpe.study.retrieval_run import finetuned_params, run_retrieval
from jaxpe.study.seeds import combine_seeds, paired_seeds
from jaxpe.train import data, run_files
from jaxpe.train.load import trained_params

__all__ = ["StudyInterrupted", "run_study"]


@contextlib.contextmanager
def _compilation_cache(path: Path) -> Iterator[None]:
  """XLA's persistent compilation cache in ``path`` while the study runs, unless the process already
  has one (``jax_compilation_cache_dir``): the seeds of an encoding, its fine-tuning and its retrieval
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
    ValueError: held-out data too small for the windows; a finished model trained on other data
      (``jaxpe.study.models.finished``); any ``trainer.train`` error.
  """
  progress = _checks.check_bool("progress", progress)
  out = Path(study.workdir)
  out.mkdir(parents=True, exist_ok=True)
  with _compilation_cache(out / "xla_cache"):
    return _run_study(study, out, progress)


def _run_study(study: StudyConfig, out: Path, progress: bool) -> dict[str, Any]:
  start = time.time()
  d = study.train.data
  corpus = data.load_corpus(d.path, max_bytes=d.max_bytes, eval_fraction=d.eval_fraction)
  fingerprint = data.fingerprint(corpus)["sha256"]
  windows = study_windows(study)
  by_seed: dict[str, list[dict[str, Any]]] = {name: [] for name in study.encodings}
  models: dict[str, dict[str, Any]] = {}
  for seed in range(study.seeds):
    for name in study.encodings:
      by_seed[name].append(_evaluate_row(study, name, seed, windows, models, corpus, fingerprint, progress))
  results = {
    name: {k: combine_seeds([r[k] for r in rows]) for k in rows[0]} for name, rows in by_seed.items()
  }
  emu = emulation_check(study, windows) if "alibi" in study.encodings else []
  retrieval = run_retrieval(study, models, progress=progress)
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
  outputs = ["study.json", "study.md", "bits_per_byte.png", "loss_vs_position.png"]
  outputs += ["retrieval.png"] if study.tasks else []
  if all((out / name).is_file() for name in outputs) and _same_report(out / "study.json", report):
    # A rerun that trained and evaluated nothing new writes nothing (the outputs' dates stay the run's).
    print(f"[study] nothing changed: {', '.join(outputs)} in {out} are kept as they are", flush=True)
    return report
  write_atomic(out / "study.json", run_files.json_text(report, indent=1))  # NaN as null
  write_atomic(out / "study.md", markdown(study, report))
  plot_bits_per_byte(study, report, out / "bits_per_byte.png")
  plot_loss_vs_position(study, report, out / "loss_vs_position.png")
  if study.tasks:
    plot_retrieval(study, report, out / "retrieval.png")
  return report


_VOLATILE = ("machine", "date_utc", "wall_seconds_this_process")
"""``study.json`` keys that say when and where the report was made, not what it holds."""


def _same_report(path: Path, report: dict[str, Any]) -> bool:
  """Whether ``path`` (an earlier ``study.json``) holds ``report``'s results, config and models, apart
  from ``_VOLATILE`` keys and each model's ``trained_now``."""
  saved = read_json(path, "it is written again")
  if saved is None:
    return False

  def essence(value: dict[str, Any]) -> dict[str, Any]:
    value = {k: v for k, v in value.items() if k not in _VOLATILE}
    models = value.get("models")
    if isinstance(models, dict):
      value["models"] = {
        k: {kk: vv for kk, vv in m.items() if kk != "trained_now"} if isinstance(m, dict) else m
        for k, m in models.items()
      }
    return value

  return essence(saved) == essence(json.loads(run_files.json_text(report)))


def _evaluate_row(
  study: StudyConfig,
  name: str,
  seed: int,
  windows: Any,
  models: dict[str, dict[str, Any]],
  corpus: data.Corpus,
  fingerprint: str,
  progress: bool,
) -> dict[str, Any]:
  """Trains (or resumes, or skips when finished) the model of row ``name`` and seed index ``seed``
  (recorded in ``models`` under its directory name) and returns the row's ``evaluate`` dicts by
  ``str(multiple)``, from the cache when its key matches."""
  cfg = model_train_config(study, name, seed)
  base = ENCODINGS[name].base or name
  tag = model_dir(base, seed)
  if tag not in models:
    models[tag] = train_model(cfg, tag, fingerprint, progress)
  cache_path = Path(cfg.workdir) / f"eval_{name}.json"
  finetuned = ENCODINGS[name].finetuned  # evaluated on weights fine-tuned with its scaling (retrieval_run)
  key = cache_key(
    cfg.model_dump(mode="json"),
    models[tag]["step"],
    hashlib.sha256(windows.tobytes()).hexdigest(),
    study.eval_multiples,
    ENCODINGS[name].scaling,
    *([streaming_sizes(study, name)] if ENCODINGS[name].streaming is not None else []),  # older keys stay
    [finetuned, study.finetune_steps, study.finetune_learning_rate] if finetuned else None,
  )
  cached = read_json(cache_path, "the row is evaluated again and the file rewritten") or {}
  if cached.get("key") == key and isinstance(cached.get("results"), dict):  # null numbers are NaN
    return {m: None if e is None else run_files.nan_for_null(e) for m, e in cached["results"].items()}
  row: dict[str, Any] = {}
  if finetuned:
    params = finetuned_params(study, name, seed, tokens=corpus.train, progress=progress)
  else:
    params = trained_params(cfg)
  for m in study.eval_multiples:
    mcfg = eval_model_config(study, name, m)
    if mcfg is None:
      row[str(m)] = None
      continue
    print(f"[study] evaluating {model_dir(name, seed)} at {m}x ({m * study.train.seq_len} bytes)", flush=True)
    length = m * study.train.seq_len
    row[str(m)] = evaluate(
      build_model(mcfg, params), windows, length, study.eval_batch_size, streaming_sizes(study, name)
    )
  write_atomic(cache_path, run_files.json_text({"key": key, "results": row}))
  return row
