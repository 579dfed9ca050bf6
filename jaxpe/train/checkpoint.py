"""Checkpoints with orbax ``CheckpointManager``: model + optimizer state, step and data position.

Orbax writes each step to a temporary directory and renames it when complete, so an interrupted
save never replaces a good checkpoint. Restores are sharded: each leaf is read straight into the
sharding of the target (``jax.ShapeDtypeStruct(..., sharding=...)``), which also moves a state
saved on one mesh shape onto another.

Failures are reported, not hidden: a save that cannot write (permission, full disk) raises
``CheckpointError`` at once with the operating system's reason, and a restore skips a damaged newest
step (naming it and moving it aside) for the previous intact one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpe.errors import CheckpointError  # noqa: F401  (raised here; one class for every checkpoint)
from jaxpe.ops import checks as _checks
from jaxpe.train import run_guard

log = logging.getLogger(__name__)


def manager(
  directory: str | Path, *, max_to_keep: int = 2, async_save: bool = False, read_only: bool = False
) -> ocp.CheckpointManager:
  """A CheckpointManager over ``directory`` (created if missing), keeping the newest
  ``max_to_keep`` (> 0) checkpoints; each step is a subdirectory named by the step number.

  ``read_only=True`` opens an existing directory for restores only: nothing is created, probed,
  cleaned up or moved (a read-only directory or filesystem works), and saves are refused.

  Saves are synchronous (``save`` returns when the step is on disk) unless ``async_save``: then
  ``save`` returns once the arrays are copied to host memory (the caller may donate or overwrite
  them at once) and a background thread writes them; the step directory still appears only when
  complete. The next ``save``, ``finish`` and closing the manager wait for a pending write. In a
  multi-process run every process makes the same calls; orbax writes each process's shards and
  process 0 the metadata.

  Raises:
    CheckpointError: ``directory`` cannot be created or written (checked up front; not for
      ``read_only``); with ``read_only``, ``directory`` is not a directory.
  """
  async_save, read_only = (
    _checks.check_bool("async_save", async_save),
    _checks.check_bool("read_only", read_only),
  )
  directory = Path(directory).absolute()
  if read_only:
    if not directory.is_dir():
      raise CheckpointError(f"no checkpoint directory {str(directory)!r}")
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that a reader's directory is read-only: it is meant to be
    try:
      return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
          read_only=True, create=False, cleanup_tmp_directories=False, save_interval_steps=0
        ),
      )
    finally:
      absl.setLevel(level)
  check_writable(directory)
  run_guard.drop_closed_event_loop_noise()  # a failed background write is one CheckpointError, no tracebacks
  if async_save:
    _quiet_background_failures()
  return ocp.CheckpointManager(
    directory,
    options=ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
    ),
  )


class _BackgroundFailureFilter(logging.Filter):
  """Drops the ERROR records (each with a traceback of dozens of lines) that orbax logs through absl
  from its background threads when an asynchronous write fails; that failure is raised to the
  caller by the next ``save`` or ``finish`` as one ``CheckpointError`` naming the step (its
  ``__cause__`` keeps the details, and ``--debug`` shows them)."""

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in record.pathname
    background = record.thread != threading.main_thread().ident
    return not (from_orbax and background and record.levelno >= logging.ERROR)


def _quiet_background_failures() -> None:
  absl = logging.getLogger("absl")
  if not any(isinstance(f, _BackgroundFailureFilter) for f in absl.filters):
    absl.addFilter(_BackgroundFailureFilter())


_pending: weakref.WeakKeyDictionary[ocp.CheckpointManager, int] = weakref.WeakKeyDictionary()
"""The step each manager may still be writing in the background (set by ``save``, cleared by
``_wait_pending``), so that a failed background write is reported with its own step."""


def _wait_pending(mngr: ocp.CheckpointManager, then: str = "") -> None:
  """Waits for ``mngr``'s pending save; raises its failure naming the step that was being written."""
  step = _pending.pop(mngr, None)
  try:
    with _quiet_orbax():
      mngr.wait_until_finished()
  except Exception as e:
    what = f"checkpoint step {step}" if step is not None else "a checkpoint"
    raise CheckpointError(
      f"could not write {what} to {str(mngr.directory)!r} (in the background): {_reason(e)}{then}"
    ) from e


def check_writable(directory: Path) -> None:
  """Creates ``directory`` if needed and writes and removes a small file in it.

  Raises:
    CheckpointError: naming the directory and the operating system's reason.
  """
  try:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-") as f:
      f.write(b"\0" * 4096)
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
    raise CheckpointError(f"cannot write checkpoints to {str(directory)!r}: {e.strerror or e}") from e


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
  """Saves ``state`` (a pytree of arrays, any shapes, dtypes and shardings) and the JSON-serialisable
  dict ``meta`` at ``step`` (an optimizer step, >= 0): completely with a synchronous manager; with
  an asynchronous one (``manager(async_save=True)``) it returns after the copy to host memory, and
  a failure of the background write is raised by the next ``save`` or by ``finish``.

  Raises:
    CheckpointError: the directory is not writable, lacks the space for the state, or a write
      failed (full disk, quota); one message naming the step, the directory and the reason. The incomplete step is left in a
      temporary directory (``<step>.orbax-checkpoint-tmp*``) that restores ignore.
    ValueError: orbax's error when ``step`` is already saved.
  """
  directory = Path(mngr.directory)
  _wait_pending(mngr, f"; step {step} was not saved")  # an earlier background write's failure, by its step
  check_writable(directory)
  _check_space(directory, step, state)
  try:
    with _quiet_orbax():
      mngr.save(  # waits for the previous asynchronous save first (raising its error)
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
      )
  except Exception as e:
    if isinstance(e, ValueError) and step in mngr.all_steps():
      raise
    raise CheckpointError(
      f"could not write checkpoint step {step} to {str(directory)!r}: {_reason(e)}"
    ) from e
  _pending[mngr] = step


def finish(mngr: ocp.CheckpointManager) -> None:
  """Waits until a pending asynchronous save is on disk.

  Raises:
    CheckpointError: the background write failed (naming its step, the directory and the reason).
  """
  _wait_pending(mngr)


def _check_space(directory: Path, step: int, state: Any) -> None:
  """Refuses a save that cannot fit: the bytes this process writes (its replica-0 shards) against
  the free space of ``directory``'s filesystem."""
  needed = sum(
    shard.data.nbytes
    for leaf in jax.tree.leaves(state)
    if isinstance(leaf, jax.Array)
    for shard in leaf.addressable_shards
    if shard.replica_id == 0
  )
  free = shutil.disk_usage(directory).free
  if needed > free:
    raise CheckpointError(
      f"could not write checkpoint step {step} to {str(directory)!r}: it needs {needed / 2**20:.1f} MiB and "
      f"only {free / 2**20:.1f} MiB are free"
    )


def restore_latest(
  mngr: ocp.CheckpointManager,
  abstract_state: Any | Callable[[dict[str, Any]], Any],
  *,
  check_meta: Callable[[dict[str, Any]], None] | None = None,
  check_state: Callable[[Any], str | None] | None = None,
) -> tuple[Any, dict[str, Any]] | None:
  """Restores the newest intact checkpoint into the shapes, dtypes and shardings of ``abstract_state``.

  A step that cannot be read (truncated or altered files, missing items, corrupt metadata) or that
  ``check_state`` rejects is damaged: it is logged (a warning naming the step and the reason) and
  the previous step is tried. When an older step restores, the damaged newer ones are moved to
  ``<directory>.damaged/<step>`` (nothing is deleted), so later saves of those steps succeed.

  Args:
    abstract_state: pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set, or a function of a
      step's metadata returning it (e.g. the layer layout the checkpoint was written in).
    check_meta: called with each step's metadata before its state is read; its exceptions (e.g.
      a ``ValueError`` for a changed run) propagate.
    check_state: returns a reason (string) when a restored state must not be used (e.g. it holds
      non-finite values), else None.

  Returns:
    ``(state, meta)``, or None when the directory holds no checkpoint.

  Raises:
    CheckpointError: there are checkpoints but none is intact (each step and reason named;
      nothing is moved).
  """
  failures: list[tuple[int, str]] = []
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      with _quiet_orbax():
        meta = dict(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    except Exception as e:
      failures.append(_damaged(mngr, step, f"unreadable metadata ({_reason(e)})"))
      continue
    if check_meta is not None:
      check_meta(meta)
    try:
      with _quiet_orbax():
        target = abstract_state(meta) if callable(abstract_state) else abstract_state
        state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    except Exception as e:
      failures.append(_damaged(mngr, step, f"unreadable state ({_reason(e)})"))
      continue
    problem = check_state(state) if check_state is not None else None
    if problem:
      failures.append(_damaged(mngr, step, problem))
      continue
    _move_aside(mngr, [s for s, _ in failures])
    return state, meta
  if failures:
    detail = "; ".join(f"step {s}: {why}" for s, why in failures)
    raise CheckpointError(
      f"no intact checkpoint in {str(mngr.directory)!r} ({detail}); move that directory away to start afresh"
    )
  return None


def abstract_with_shardings(state: Any, shardings: Any) -> Any:
  """Restore targets: a pytree like ``state`` of ``jax.ShapeDtypeStruct`` with each leaf's shape and
  dtype and the matching ``NamedSharding`` from ``shardings`` (same tree structure)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def _damaged(mngr: ocp.CheckpointManager, step: int, why: str) -> tuple[int, str]:
  log.warning("checkpoint step %d in %s is damaged: %s; trying the previous one", step, mngr.directory, why)
  return step, why


def _move_aside(mngr: ocp.CheckpointManager, steps: list[int]) -> None:
  if not steps or getattr(getattr(mngr, "_options", None), "read_only", False):  # a reader moves nothing
    return
  directory = Path(mngr.directory)
  aside = directory.with_name(directory.name + ".damaged")
  for step in steps if jax.process_index() == 0 else ():  # one process moves (shared directory)
    aside.mkdir(exist_ok=True)
    target = aside / str(step)
    n = 1
    while target.exists():
      target, n = aside / f"{step}.{n}", n + 1
    os.replace(directory / str(step), target)
    log.warning("moved damaged checkpoint step %d to %s", step, target)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("jaxpe: damaged checkpoints moved aside")
  mngr.reload()


def _reason(e: BaseException) -> str:
  """The operating system's reason inside an orbax/tensorstore error, else the first line of the
  innermost error of the chain (tensorstore's, which names the file)."""
  chain = list(_chain(e))
  for err in chain:
    if isinstance(err, OSError) and err.strerror:
      return f"{err.strerror} ({err.filename})" if err.filename else err.strerror
    code = re.search(r"os_error_code='(\d+)'", str(err))
    if code:
      return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
  text = str(chain[-1]).strip()
  first = text.splitlines()[0].split(". See full")[0] if text else ""
  return f"{type(chain[-1]).__name__}: {first[:300]}"


def _chain(e: BaseException | None) -> Iterator[BaseException]:
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
  """Holds back what orbax and tensorstore print while they work: absl's logged tracebacks, and the
  tracebacks tensorstore's C++ callbacks print straight to file descriptor 2 after a failed write
  ("Event loop is closed"). A failure surfaces as one exception (its chain keeps the details);
  after a success, anything printed to descriptor 2 is passed on."""
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.CRITICAL)
  sys.stderr.flush()
  with tempfile.TemporaryFile() as held:
    saved = os.dup(2)
    os.dup2(held.fileno(), 2)
    ok = False
    try:
      yield
      ok = True
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      absl.setLevel(level)
      if ok and held.tell():
        held.seek(0)
        os.write(2, held.read())
