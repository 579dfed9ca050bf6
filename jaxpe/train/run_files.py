"""The files a run keeps at the top of its workdir, written atomically and read back defensively:
``config.json``, ``metrics.jsonl`` (one JSON record per step), ``summary.json`` and ``loss.png``.

A damaged file (a torn write, an edit, bytes that are not UTF-8) never blocks a resume: the lines
or the file are skipped with a warning naming them.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from jaxpe.train import data

__all__ = [
  "RUN_FILES",
  "json_text",
  "nan_for_null",
  "plot_loss_curve",
  "read_metrics",
  "read_saved_config",
  "truncate_metrics",
  "write_atomic",
]

log = logging.getLogger(__name__)

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png")
"""The files a run writes at the top of its workdir (besides ``checkpoints/`` and ``tensorboard/``),
replacing them."""


def _finite(value: Any) -> Any:
  """``value`` with every non-finite float (NaN, +-inf) replaced by None, through dicts, lists and
  tuples (tuples become lists, as JSON writes them)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_finite(v) for v in value]
  return value


def json_text(value: Any, **kwargs: Any) -> str:
  """``value`` as strict JSON (RFC 8259): non-finite floats (NaN, +-inf), which JSON cannot hold and
  strict parsers refuse as Python's bare ``NaN`` / ``Infinity`` tokens, are written as ``null``
  (docs/training.md, "Run files"); ``kwargs`` go to ``json.dumps`` (``indent``, ``sort_keys``).
  Every JSON file jaxpe writes goes through here; ``nan_for_null`` reads such numbers back.

  Raises:
    TypeError: a value JSON cannot hold (not a dict, list, tuple, str, int, float, bool or None).
  """
  return json.dumps(_finite(value), allow_nan=False, **kwargs)


def nan_for_null(value: Any) -> Any:
  """``value`` read from a ``json_text`` file with every None inside it (dicts and lists, at any
  depth, and ``value`` itself) read as NaN: for a record whose values are all numbers (a
  ``metrics.jsonl`` record, an evaluation's numbers), where ``null`` can only be a non-finite one."""
  if value is None:
    return math.nan
  if isinstance(value, dict):
    return {k: nan_for_null(v) for k, v in value.items()}
  if isinstance(value, list):
    return [nan_for_null(v) for v in value]
  return value


def write_atomic(path: Path, text: str) -> None:
  """Writes ``text`` to ``path`` through a temporary file, flushed to disk (``fsync``), and a rename
  (readers see the old or the new file, never a partial one; after a crash the file is whole).

  Raises:
    OSError: the directory is missing or not writable.
  """
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_saved_config(path: Path) -> str | None:
  """``config.json``'s text, or None (with a warning) when it is missing or is not a JSON object
  (bytes that are not UTF-8, a syntax error, a list...): the checkpoints' metadata carries the same
  keys, so a damaged file never blocks a resume."""
  if not path.is_file():
    return None
  try:
    text = path.read_bytes().decode()
    if not isinstance(json.loads(text), dict):
      raise ValueError("not a JSON object")
  except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
    log.warning(
      "ignoring %s: it is not a valid JSON object (%s); the run is checked against its checkpoint instead",
      path,
      e,
    )
    return None
  return text


def _read_lines(path: Path) -> list[str]:
  """The lines of a text file the trainer wrote; bytes that are not UTF-8 (damage) become U+FFFD."""
  return path.read_bytes().decode(errors="replace").splitlines()


def _is_number(x: Any) -> bool:
  return isinstance(x, int | float) and not isinstance(x, bool)


_CHECKED = ("eval_bits_per_byte", "eval_bits_per_token", "eval_bits_per_answer", "tokens_per_second")


def _is_metrics_record(record: Any) -> bool:
  """A dict with an integer ``step``, a numeric ``loss``, and numbers for the other keys read back
  (``eval_bits_per_byte`` or its token / answer unit, ``tokens_per_second``) where present."""
  return (
    isinstance(record, dict)
    and isinstance(record.get("step"), int)
    and not isinstance(record["step"], bool)
    and _is_number(record.get("loss"))
    and all(_is_number(record[k]) for k in _CHECKED if k in record)
  )


def read_metrics(path: Path) -> list[dict[str, Any]]:
  """The records of ``metrics.jsonl`` at ``path`` ([] when it is missing), ``null`` numbers (a
  non-finite loss or norm, ``json_text``) read as NaN; lines that do not parse as a record with a
  step (a torn write, an edit) are skipped with a warning naming the file and line."""
  if not path.is_file():
    return []
  records = []
  for number, line in enumerate(_read_lines(path), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if isinstance(record, dict) and record.get("step") is not None:
        record = {k: v if k == "step" else nan_for_null(v) for k, v in record.items()}
      if _is_metrics_record(record):
        records.append(record)
        continue
    except json.JSONDecodeError:
      pass
    log.warning("%s line %d is not a metrics record; skipped: %.80r", path, number, line)
  return records


def truncate_metrics(path: Path, step: int) -> list[dict[str, Any]]:
  """Drops the records of ``metrics.jsonl`` at ``path`` after ``step`` (written after the last
  checkpoint by a crashed process) and lines that do not parse; creates the file when missing.
  Returns the records kept."""
  lines = _read_lines(path) if path.is_file() else []
  records = read_metrics(path)
  kept = [r for r in records if r["step"] <= step]
  if len(kept) != len([line for line in lines if line.strip()]) or not path.is_file():
    write_atomic(path, "".join(json_text(r) + "\n" for r in kept))
  return kept


def plot_loss_curve(metrics_path: Path, out_path: Path, unigram: float, *, unit: str = "byte") -> None:
  """Plots training and held-out bits per ``unit`` (byte for text, token for a token file, answer
  for a task: ``run_log.score_unit``; from ``metrics.jsonl`` at ``metrics_path``) against step,
  with the unigram entropy ``unigram`` (bits per ``unit``) for reference, to the PNG ``out_path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_metrics(metrics_path)
  steps = [r["step"] for r in records]
  train_bpb = [data.bits_per_byte(r["loss"]) for r in records]
  key = f"eval_bits_per_{unit}"
  evals = [(r["step"], r[key]) for r in records if key in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, train_bpb, lw=0.8, label="train")
  if evals:
    ax.plot(*zip(*evals), "o-", label="held-out")
  ax.axhline(unigram, ls="--", c="gray", label=f"unigram entropy {unigram:.2f}")
  ax.set_xlabel("step")
  ax.set_ylabel(f"bits per {unit}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)
