"""TensorBoard event files written synchronously: ``EventFile`` (tensorboardX's event format).

tensorboardX's ``SummaryWriter`` writes events from a queue in a background thread and flushes on a
timer; its ``flush()`` does not wait for the queue, so events a run logged before a checkpoint
could be lost by a kill -9 after it (issue 39). ``EventFile`` writes each event at once, in the
calling thread, with tensorboardX's own pieces (``EventsWriter``: the TFRecord file, its CRCs and
the ``fsync``; ``summary.scalar`` / ``summary.text``: the protobufs), so ``flush()`` makes every
event logged so far durable. tensorboardX is an optional dependency (the ``train`` extra).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["EventFile", "import_tensorboardx"]

FLUSH_SECONDS = 10.0
"""Events are flushed at least this often while a run logs (live viewing), and at each ``flush()``."""


def import_tensorboardx():
  """``(EventsWriter, event_pb2, summary)`` of tensorboardX, imported without torch.

  tensorboardX imports torch if it is installed, only to accept torch tensors (``try: import torch
  except ImportError``); that costs ~4.7 s at every run's start on the 2-core reference machine, and
  jaxpe passes it Python floats. Unless torch is already loaded, the import runs with torch marked
  absent (``sys.modules["torch"] = None``, Python's documented way to block an import), and the mark
  is removed at once, so a later ``import torch`` works as usual.

  Raises:
    ImportError: tensorboardX is not installed.
  """
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # type: ignore[assignment]
  try:
    from tensorboardX import summary
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2
  finally:
    if blocked and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return EventsWriter, event_pb2, summary


class EventFile:
  """One new event file ``<logdir>/events.out.tfevents.<time>.<host>``, as ``SummaryWriter`` names
  and starts it (``purge_step``: TensorBoard hides the events of steps >= it from earlier files, a
  resumed run's steps after its checkpoint). Events are written at once; ``flush`` (also every
  ``FLUSH_SECONDS`` while events come) writes them to disk and ``fsync``-s the file.

  Raises:
    ImportError: tensorboardX is not installed.
    OSError: ``logdir`` cannot be made or written.
  """

  def __init__(self, logdir: Path, *, purge_step: int | None = None):
    events_writer, self._pb, self._summary = import_tensorboardx()
    Path(logdir).mkdir(parents=True, exist_ok=True)
    self._file = events_writer(str(Path(logdir) / "events"))
    self._flushed = time.time()
    if purge_step is not None:  # as SummaryWriter(purge_step=...) starts its file
      self._add(self._pb.Event(step=purge_step, file_version="brain.Event:2"))
      self._add(self._pb.Event(step=purge_step, session_log=self._pb.SessionLog(status=1)))  # START

  def _add(self, event) -> None:
    event.wall_time = time.time()
    self._file.write_event(event)
    if event.wall_time - self._flushed > FLUSH_SECONDS:
      self.flush()

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    """A scalar ``value`` of ``tag`` at ``step``."""
    self._add(self._pb.Event(summary=self._summary.scalar(tag, float(value)), step=int(step)))

  def add_text(self, tag: str, text: str, step: int) -> None:
    """A text (markdown) ``text`` of ``tag`` at ``step``."""
    self._add(self._pb.Event(summary=self._summary.text(tag, text), step=int(step)))

  def flush(self) -> None:
    """Every event added so far on disk (written and ``fsync``-ed)."""
    self._file.flush()
    self._flushed = time.time()

  def close(self) -> None:
    """Flushes and closes the file."""
    self._file.close()
