"""The input pipeline on grain (``data.loader=grain``): the run's batches as a ``grain.MapDataset``,
read by prefetching threads while the step runs, with grain's checkpointable iterator state saved
beside each checkpoint.

Element ``i`` of the dataset is this process's rows of the global batch of step ``i``, made by the
same function the default loader calls (text windows ``data.train_batch``, packed rows
``jaxpe.train.packing``, task samples ``jaxpe.train.tasks``), so the batches are the default loader's,
bit for bit: the loader only changes when a batch is made (ahead, in ``data.grain_workers`` threads,
``prefetch_buffer_size`` batches ahead), never which. Each process reads only its rows (the block of
the global batch its devices hold, ``sharding.process_rows``: grain's ``ShardByJaxProcess`` cut by the
batch's sharding instead of by index, so the rows match the devices that use them).

The iterator's state (``{"next_index": step}``, grain's ``DatasetIterator.get_state``) is written to
``WORKDIR/data_state/STEP.processP.json`` with every checkpoint and read back on resume; since it is
keyed by the checkpoint's step and written before the checkpoint, a run killed at any moment (kill -9)
resumes from its newest intact checkpoint with the matching state.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxpe.errors import require_extra
from jaxpe.train import data, run_files, sharding, tasks

__all__ = [
  "PREFETCH",
  "GrainBatches",
  "batch_maker",
  "prune_states",
  "read_state",
  "state_path",
  "write_state",
]

PREFETCH = 4
"""Batches the grain iterator reads ahead of the step."""
_END = 2**62  # the dataset's length: steps are never that many


class GrainBatches:
  """This process's batch rows, step after step, from a grain pipeline.

  Args:
    make: ``make(step=, rows=)`` -> ``rows`` of the global batch of ``step`` (``[b, ...]``).
    rows: this process's rows (``sharding.process_rows``).
    state: grain iterator state to continue from (``read_state``), or None: start at ``start``.
    start: the step the run is at.
    workers: prefetching threads (``grain.ReadOptions.num_threads``).

  Raises:
    ValueError: a ``state`` that is not at ``start`` (a data state of another step).
    MissingExtraError: grain is not installed.
  """

  def __init__(
    self, make: Callable[..., np.ndarray], rows: slice, *, state: dict | None, start: int, workers: int
  ):
    require_extra("train", "data.loader=grain", ("grain",))
    import grain

    def element(step) -> np.ndarray:
      return make(step=int(step), rows=rows)

    ds = grain.MapDataset.range(_END).map(element)
    options = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=PREFETCH)
    self._it = iter(ds.to_iter_dataset(options))
    if state is not None and state.get("next_index") != start:
      raise ValueError(f"the saved grain data state {state} is not at the checkpoint's step {start}")
    self._it.set_state(state if state is not None else {"next_index": start})

  def next(self, step: int) -> np.ndarray:
    """The rows of step ``step`` (the iterator's next element).

    Raises:
      RuntimeError: the iterator is not at ``step``.
    """
    at = self._it.get_state().get("next_index")
    if at != step:
      raise RuntimeError(f"the grain iterator is at step {at}, the run at {step}")
    return next(self._it)

  def state(self) -> dict:
    """grain's iterator state (JSON-able)."""
    return self._it.get_state()

  def save(self, workdir: Path, step: int, *, kept) -> None:
    """Writes the state for the checkpoint of ``step`` (before it is saved) and removes the states
    of steps before the oldest checkpoint ``kept`` (``mngr.all_steps()``)."""
    process = jax.process_index()
    write_state(workdir, step, process, self.state())
    prune_states(workdir, min(kept, default=step), process)


def for_run(cfg, make: Callable[..., np.ndarray], batch_sharding, step: int) -> GrainBatches:
  """The ``GrainBatches`` of a run (``cfg`` a ``TrainConfig``) at ``step``: this process's rows of
  ``batch_sharding``, from the state saved for ``step`` (``read_state``) or from ``step``."""

  return GrainBatches(
    make,
    sharding.process_rows(batch_sharding, cfg.batch_size),
    state=read_state(Path(cfg.workdir), step, jax.process_index()),
    start=step,
    workers=cfg.data.grain_workers,
  )


def batch_maker(cfg, corpus, packed_batch=None) -> tuple[Callable[..., np.ndarray], tuple[int, ...]]:
  """``(make(step=, rows=), global shape)`` of a run's training batches: text windows
  (``data.train_batch``, ``[B, T + 1]``), packed rows (``packed_batch``, ``jaxpe.train.packing``,
  ``[B, 3, T + 1]``) or task samples (``tasks.task_batch``, ``[B, 2, T + 1]``), for ``cfg`` (a
  ``TrainConfig``) and ``corpus`` (None for a task)."""
  shape = (cfg.batch_size, cfg.seq_len + 1)
  make = functools.partial(data.train_batch, corpus.train) if corpus is not None else None
  if cfg.data.packing is not None:  # [B, 3, T + 1]: tokens, loss weights, segment ids
    make, shape = packed_batch, (shape[0], 3, shape[1])
  if cfg.data.task is not None:  # [B, 2, T + 1]: tokens and answer mask (next_token_loss)
    make, shape = functools.partial(tasks.task_batch, cfg.data.task), (shape[0], 2, shape[1])
  fixed = dict(seed=cfg.seed, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
  return (lambda *, step, rows: make(step=step, rows=rows, **fixed)), shape


def state_path(workdir: Path, step: int, process: int) -> Path:
  """``WORKDIR/data_state/STEP.processP.json``."""
  return Path(workdir) / "data_state" / f"{step}.process{process}.json"


def write_state(workdir: Path, step: int, process: int, state: dict) -> None:
  """Writes ``state`` for the checkpoint of ``step`` (atomically)."""
  path = state_path(workdir, step, process)
  path.parent.mkdir(parents=True, exist_ok=True)
  run_files.write_atomic(path, run_files.json_text(state))


def read_state(workdir: Path, step: int, process: int) -> dict | None:
  """The state saved for ``step``, None when there is none (a checkpoint of the default loader)."""
  path = state_path(workdir, step, process)
  return json.loads(path.read_text()) if path.is_file() else None


def prune_states(workdir: Path, keep_from: int, process: int) -> None:
  """Removes this process's states of steps before ``keep_from`` (the oldest checkpoint kept)."""
  folder = Path(workdir) / "data_state"
  for p in folder.glob(f"*.process{process}.json") if folder.is_dir() else ():
    step = p.name.split(".")[0]
    if step.isdigit() and int(step) < keep_from:
      p.unlink(missing_ok=True)
