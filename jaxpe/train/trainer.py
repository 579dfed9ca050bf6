"""Training a jaxpe decoder: ``train(cfg)`` runs (or resumes) the run a ``TrainConfig`` describes.

config -> data -> checks -> sharded model and optimizer (``state``) -> steps (``loop``) -> eval and
sample (``evaluation``) -> checkpoints -> logs (``run_log``: metrics.jsonl, TensorBoard, loss curve,
summary.json). ``train/train.py`` only parses arguments. This module also exports the names a
user of the trainer needs (``TrainResult``, ``create_state``, ``abstract_state``,
``make_optimizer``, ``decay_mask``, ``next_token_loss``) from the modules that define them.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax

from jaxpe.attention import cpu_flash
from jaxpe.ops import checks as _checks
from jaxpe.train import (
  checkpoint,
  data,
  host_devices,
  loop,
  run_checks,
  run_files,
  run_guard,
  sharding,
  tasks,
  token_data,
)
from jaxpe.train.config import TrainConfig
from jaxpe.train.optimizer import decay_mask, make_optimizer
from jaxpe.train.run_log import TrainResult
from jaxpe.train.state import abstract_state, create_state
from jaxpe.train.steps import next_token_loss

__all__ = [
  "TrainResult",
  "abstract_state",
  "create_state",
  "decay_mask",
  "make_optimizer",
  "next_token_loss",
  "train",
]


def train(cfg: TrainConfig, *, progress: bool = True) -> TrainResult:
  """Trains (or resumes) the run described by ``cfg`` in ``cfg.workdir``.

  Rerunning with the same workdir resumes from the newest intact checkpoint with the same batches;
  a run at or past ``stop_at`` (or ``num_steps``) does no steps and only reports. ``metrics.jsonl``
  keeps one record per step (records after the restored step are dropped). Tokens/s exclude each
  process's first step (compilation). What a run guarantees (locking, signals, non-finite steps,
  damaged files) is described in docs/training.md.

  What it reports (``run_log``): at the start (with ``progress``, on process 0) the data's files
  and bytes on each side, the parameter count, the devices and the mesh; per step a record in
  ``metrics.jsonl`` and TensorBoard events in ``<workdir>/tensorboard`` (with tensorboardX);
  ``loss.png``; and ``summary.json`` (``TrainResult``, with ``completed`` and ``stop_reason``) at
  the end and when a signal stops the run.

  Raises:
    ValueError: an explicit ``cpu_devices`` that JAX's already started CPU backend does not have
      (``host_devices.apply``; in a fresh process the count is set) or that the mesh or batch cannot
      use (``host_devices.check_fits``, before anything is written); resuming with changed run-defining keys (``run_checks.check_resume_config``, against
      ``config.json`` and the checkpoint's metadata) or on changed data (``run_checks.check_resume_data``,
      unless ``data.allow_changed``), data too small for ``seq_len``/``batch_size``, sizes that do
      not divide the mesh; distributed settings that cannot form a job
      (``sharding.initialize_distributed``); processes that disagree on the config or the data
      (``run_checks.check_processes_agree``) or do not share the workdir
      (``run_checks.check_shared_workdir``).
    ConnectionError: JAX could not initialise the multi-process runtime.
    FileNotFoundError: ``cfg.data.path`` does not exist.
    run_guard.WorkdirInUseError: another live trainer holds the workdir.
    run_guard.NonFiniteError: a step's loss, gradient norm or update was non-finite more than
      ``cfg.skip_nonfinite`` times; nothing non-finite was applied or saved.
    run_guard.TrainingInterrupted: SIGTERM/SIGINT (to any process of a multi-process run: all
      stop after the same step); a checkpoint of the current step was written.
    checkpoint.CheckpointError: checkpoints cannot be written, or none of the saved ones is intact.
  """
  start, progress = time.time(), _checks.check_bool("progress", progress)
  cpu_flash.check_settings()  # JAXPE_CPU_FLASH=disabled: refused before anything is made or read
  host_devices.apply(cfg, auto=False)  # an explicit count is honoured or refused, never ignored
  sharding.initialize_distributed(cfg.distributed)  # a no-op for single-process runs
  host_devices.check_fits(cfg)  # an explicit count the mesh or batch cannot use: named, not a mesh error
  run_checks.check_workdir_is_ours(Path(cfg.workdir))  # before any data is read or anything written
  if cfg.data.tokens is not None:  # a token file, memory-mapped (jaxpe.train.token_data)
    d = cfg.data
    corpus = token_data.load_tokens(
      d.tokens,
      eval_fraction=d.eval_fraction,
      vocab_size=cfg.model.vocab_size,
      token_dtype=d.token_dtype,
      eot_token=d.eot_token,
      tokenizer=d.tokenizer,
    )
    fingerprint = token_data.fingerprint(corpus)
    described = corpus.describe()
  elif cfg.data.task is None:
    corpus = data.load_corpus(
      cfg.data.path, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction
    )
    fingerprint = data.fingerprint(corpus)
    described = corpus.describe()  # which files (and bytes) went to each side, what was skipped
  else:  # a synthetic task (jaxpe.train.tasks): generated from the seed, fingerprinted by its config
    corpus, fingerprint = None, tasks.fingerprint(cfg.data.task)
    described = f"data: the synthetic task {cfg.data.task.model_dump(mode='json')} (jaxpe.train.tasks)"
  if progress and jax.process_index() == 0:
    print(described, flush=True)
  run_checks.check_processes_agree(cfg, fingerprint)  # before any process writes anything
  workdir = Path(cfg.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  run_checks.check_shared_workdir(workdir)
  # The processes of a multi-process run share the workdir: process 0 holds its lock.
  lock = run_guard.workdir_lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  with lock, run_guard.stop_signals() as stop:
    saved_config = run_files.read_saved_config(workdir / "config.json")
    ckpt_dir = workdir / "checkpoints"
    if saved_config is not None and ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
      run_checks.check_resume_config(
        saved_config, cfg, source=str(workdir / "config.json")
      )  # before anything is loaded
    # Closing the manager waits for a pending asynchronous save, whichever way the run ends.
    with checkpoint.manager(
      ckpt_dir, max_to_keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoints
    ) as mngr:
      return loop.run_training(
        cfg, workdir, mngr, stop, saved_config, corpus, fingerprint, progress=progress, start=start
      )
