"""What keeps a training run safe: one trainer per workdir, signals that stop it after a checkpoint,
and the errors the trainer raises when a run cannot go on.

``workdir_lock`` takes an exclusive ``fcntl.flock`` on ``<workdir>/lock``. The kernel drops the lock
when its process dies (even by SIGKILL), so a lock left by a killed trainer is taken over by the
next one without any staleness rule; the file's text (``pid host``) only names the holder in the
refusal message. ``stop_signals`` turns the first SIGTERM or SIGINT into a request the training loop
honours after the current step (checkpoint, then ``TrainingInterrupted``); a second one exits at
once with status ``128 + signal``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class RunError(Exception):
  """Base of the errors that end a run for a reason the user can act on (printed as one line)."""


class JobRefused(ValueError):
  """A refusal that every process of a multi-process run makes together, after one gather (the
  processes disagree on the config, the data or the workdir): ``run_cli`` then leaves the job with
  all of them (``jax.distributed.shutdown``, a barrier) after printing its line, so that process
  0's exit, which ends the coordination service, cannot abort a peer that has yet to print its own
  (JAX's "coordination service" fatal error, seen under load)."""


class WorkdirInUseError(RunError):
  """Another live process holds the workdir's lock."""


class NonFiniteError(RunError):
  """The loss, gradient norm or updated parameters went non-finite (more often than allowed)."""


class TrainingInterrupted(RunError):
  """The run stopped on SIGTERM/SIGINT after writing a checkpoint.

  Attributes:
    signum: the signal number; ``exit_code`` is the conventional ``128 + signum`` (143 for
      SIGTERM, 130 for SIGINT).
    step: the step the checkpoint holds.
  """

  def __init__(self, message: str, *, signum: int, step: int):
    super().__init__(message)
    self.signum, self.step = signum, step
    self.exit_code = 128 + signum


@contextlib.contextmanager
def workdir_lock(workdir: Path) -> Iterator[None]:
  """Holds an exclusive lock on ``workdir`` (created if missing) for the duration of the block.

  The lock is an ``fcntl.flock`` on ``<workdir>/lock`` (POSIX local filesystems; the file is kept,
  never deleted, so there is no unlink race). A lock whose holder died is free again at once.

  Raises:
    WorkdirInUseError: another live process holds it ("in use by pid N on host H").
  """
  workdir.mkdir(parents=True, exist_ok=True)
  path = workdir / "lock"
  with open(path, "a+") as f:
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      pid, _, host = f.read().strip().partition(" ")
      raise WorkdirInUseError(
        f"workdir {str(workdir)!r} is in use by pid {pid or '?'} on host {host or '?'} ({path}); "
        "wait for that run to end or use another workdir"
      ) from None
    try:
      f.seek(0)
      f.truncate()
      f.write(f"{os.getpid()} {socket.gethostname()}\n")
      f.flush()
      yield
    finally:
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class WorkdirGoneError(RunError):
  """The workdir (or its ``metrics.jsonl``) was deleted, moved or replaced while the run was writing it."""


def check_workdir_intact(workdir: Path, metrics_file: Any, step: int) -> None:
  """Checks that ``metrics_file`` (the open ``<workdir>/metrics.jsonl``) is still the file at that path.

  Called before each metrics write (so before each checkpoint). If the workdir was deleted, moved
  or replaced, the run stops instead of writing metrics into a deleted file and recreating an
  empty workdir for its checkpoints (which would lose the metrics and the lock silently).

  Raises:
    WorkdirGoneError: one line naming the workdir and the step; nothing more is written.
  """
  path = Path(workdir) / "metrics.jsonl"
  try:
    same = os.path.samestat(os.stat(path), os.fstat(metrics_file.fileno()))
  except FileNotFoundError:
    same = False
  if not same:
    raise WorkdirGoneError(
      f"workdir {str(workdir)!r} was deleted, moved or replaced during the run (its metrics.jsonl is gone "
      f"or another file); stopped at step {step} without writing more (the last checkpoint, if it "
      "still exists, resumes the run)"
    )


class StopRequest:
  """Set by ``stop_signals``: ``signum`` is None until the first SIGTERM/SIGINT arrives. In a
  multi-process run a process that received no signal itself takes another process's
  (``from_process`` is that process's index; None for this process's own signal)."""

  signum: int | None = None
  from_process: int | None = None

  @property
  def origin(self) -> str:
    """``" (received by process P)"`` for another process's signal, else ``""``."""
    return "" if self.from_process is None else f" (received by process {self.from_process})"

  @property
  def name(self) -> str:
    """The signal's name (``"SIGTERM"``), or ``""``."""
    return signal.Signals(self.signum).name if self.signum else ""


@contextlib.contextmanager
def stop_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[StopRequest]:
  """Within the block, the first of ``signals`` sets the yielded ``StopRequest`` (the caller stops
  at its next check, after the current step) and a second one exits at once with ``128 + signum``.

  Previous handlers are restored afterwards. Outside the main thread (where Python cannot install
  handlers) the request is never set and signals keep their usual effect.
  """
  request = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield request
    return

  def handle(signum, frame):
    if request.signum is not None and request.from_process is None:  # this process's second signal
      os._exit(128 + signum)
    request.signum, request.from_process = signum, None  # its own signal replaces another process's
    print(
      f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint (send it again to exit "
      "at once, losing the work since the last checkpoint)",
      file=sys.stderr,
      flush=True,
    )

  previous = {s: signal.signal(s, handle) for s in signals}
  try:
    yield request
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def run_cli(prog: str, body: Callable[[], int], *, debug: bool = False) -> int:
  """Run a command-line entry point's ``body`` and turn the errors a user can act on into one line.

  Shared by ``train/train.py`` and ``train/study.py``, so both report errors and signals alike.

  Args:
    prog: the program name that prefixes each message (``"train.py"``).
    body: does the work and returns the exit status.
    debug: re-raise user errors with their traceback instead of the one-line message.

  Returns:
    ``body()``'s status; for ``TrainingInterrupted`` its ``128 + signal`` (143 SIGTERM, 130 Ctrl-C);
    1 for ``NonFiniteError``; 2 for configuration and usage errors (``ValueError``, ``TypeError``,
    ``OSError``, other ``RunError``), printed as ``<prog>: error: <one line>`` on stderr.
  """
  drop_closed_event_loop_noise()
  try:
    return body()
  except TrainingInterrupted as e:
    print(f"{prog}: {e}", file=sys.stderr)
    _leave_job_together()  # every process stops at the same step: none may exit under a peer's line
    return e.exit_code
  except (ValueError, TypeError, OSError, RunError) as e:
    if debug:
      raise
    print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
    if isinstance(e, JobRefused | NonFiniteError):  # decided by all processes together
      _leave_job_together()
    return 1 if isinstance(e, NonFiniteError) else 2


def _leave_job_together() -> None:
  """After the line of a stop that all processes of a multi-process run make together (``JobRefused``,
  a signal's ``TrainingInterrupted``, ``NonFiniteError``): with the streams flushed and then pointed at
  ``/dev/null`` (the runtime's shutdown logs nothing after the line), every process leaves JAX's
  distributed runtime at one barrier (bounded by its shutdown timeout), so none exits while a peer
  still reports (a process that left first took the coordination service with it, and its peer's gRPC
  client logged "Socket closed" after the peer's own line)."""
  import jax  # noqa: PLC0415 (only a multi-process refusal needs it; jax is loaded by then)

  if not jax.distributed.is_initialized():
    return
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError):
      stream.flush()
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 1)
  os.dup2(null, 2)
  with contextlib.suppress(Exception):
    jax.distributed.shutdown()


def one_line(e: BaseException) -> str:
  """The error as one line: pydantic's multi-line validation report joined, its URLs dropped."""
  text = str(e)
  if hasattr(e, "errors") and callable(e.errors):  # pydantic.ValidationError
    try:
      # The offending key and its value only: a section's validator gets the whole section (a
      # dict), which would print every key of, e.g., the model config.
      return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
        + (f" (got {err['input']!r})" if err["loc"] and not isinstance(err["input"], dict | list) else "")
        for err in e.errors()
      )
    except (TypeError, KeyError):
      pass
  return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _is_closed_loop_noise(unraisable: Any) -> bool:
  """True for the ``RuntimeError('Event loop is closed')`` that tensorstore's C++ callbacks hit when
  they call ``loop.call_soon_threadsafe`` on the event loop of an orbax write that already failed
  (that failure itself is raised to the caller as a ``CheckpointError``)."""
  exc = getattr(unraisable, "exc_value", None)
  if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
    return False
  tb = exc.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return tb is None or os.path.join("asyncio", "base_events.py") in tb.tb_frame.f_code.co_filename


def drop_closed_event_loop_noise() -> None:
  """Installs (once) a ``sys.unraisablehook`` that drops ``_is_closed_loop_noise`` and passes every
  other unraisable exception to the hook it replaces.

  Without it, a failed (asynchronous) checkpoint write makes orbax/tensorstore background threads
  print one ``Event loop is closed`` traceback per pending callback (dozens of lines) on stderr,
  before and even in the middle of the one-line error. Called by ``run_cli`` and
  ``jaxpe.checkpoint.manager``.
  """
  previous = sys.unraisablehook
  if getattr(previous, "_jaxpe_filter", False):
    return

  def hook(unraisable):
    if not _is_closed_loop_noise(unraisable):
      previous(unraisable)

  hook._jaxpe_filter = True
  sys.unraisablehook = hook


def exit_process(code: int) -> None:
  """End a command-line process with ``code``; after a failure, without interpreter shutdown.

  A failed run has nothing left to save (checkpoints are atomic), so it leaves with ``os._exit``
  instead of an interpreter shutdown that would run orbax/tensorstore's background threads' cleanup
  (and their tracebacks) after the one-line error. Before that it flushes stdout and stderr and
  points file descriptors 1 and 2 at ``/dev/null`` under the interpreter lock of this thread, so a
  background thread still writing cannot add a fragment after the error line (the noise itself is
  dropped at its source by ``drop_closed_event_loop_noise``). A successful run exits normally.
  """
  if code == 0:
    sys.exit(0)
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
      pass
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 1)
  os.dup2(null, 2)
  os._exit(code)
