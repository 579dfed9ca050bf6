"""What a run reports while it trains (the log a maxtext or nanoGPT user expects).

At the start: the parameter count, the devices and the mesh (shape and axis names); the data
(which files and how many bytes went to training and held-out) is ``data.Corpus.describe()``,
printed before. Per step: one record in ``<workdir>/metrics.jsonl`` and the same scalars as
TensorBoard events in ``<workdir>/tensorboard/`` (through tensorboardX, an optional dependency in
the ``train`` extra; without it the run says so in one line and writes no events), and progress on
the console. At the end (and when a signal stops the run): ``summary.json``, a ``TrainResult``
that says whether the schedule completed and why the run stopped. Losses are shown in bits per
byte, the unit of ``loss.png`` and the README; the records keep ``loss`` in nats per token too.

The unit of the bits (``score_unit``) is what the run scores: a byte for text (the default, byte-level
vocabulary), a token for a token file (``data.tokens``: ids of a tokenizer, each several bytes), an
answer for a synthetic task (``data.task``: the loss counts only answer targets). Every key and
label says it: ``train_bits_per_byte`` / ``eval_bits_per_byte`` / ``unigram_bits_per_byte`` and
"bits/byte" for text, ``..._bits_per_token`` and "bits/token" for a token file, ``..._bits_per_answer``
and "bits/answer" for a task (TensorBoard ``train/bits_per_<unit>``, ``eval/bits_per_<unit>``).

A record (``metrics.jsonl``; all numbers): ``step``; ``loss`` (training cross-entropy, nats/token,
before the update); ``train_bits_per_byte`` (the same in bits per ``score_unit``: ``train_bits_per_token``
for a token file, ``train_bits_per_answer`` for a task); ``grad_norm``; ``data_seconds`` (wall time
the loop waited for the step's batch: made, or taken from grain's prefetch, and placed on the devices);
``learning_rate`` (the one this step's update used); ``step_seconds`` (wall time of the step, the
first of each process including compilation); ``tokens_per_second`` (this process's mean over its
timed steps, compiling steps excluded); ``model_flops_per_second`` (``jaxpe.train.flops``: the
model's training FLOPs per token times ``tokens_per_second``) and ``mfu`` (that over the devices'
peak: the bfloat16 peak of a known GPU/TPU, or the float32 matmul ceiling measured on CPU at the
start; absent for other devices); and where they apply ``schedule_steps`` (the schedule was
fitted), ``skipped`` and ``param_norm`` (a non-finite step), ``eval_bits_per_byte`` (per unit, as
``train_bits_per_byte``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import jax

from jaxpe.train import data, events, pacing, run_files, run_guard

__all__ = [
  "STOP_REASONS",
  "TENSORBOARD_DIR",
  "RunLog",
  "TrainResult",
  "console_figures",
  "UNITS",
  "read_summary",
  "record_unit",
  "run_info",
  "score_unit",
  "summary_dict",
  "start_lines",
  "tensorboard_scalars",
  "unit_key",
  "write_summary",
]

STOP_REASONS = ("schedule_done", "stop_at", "max_seconds", "signal")
"""Why a run stopped (``TrainResult.stop_reason``): its schedule is complete, it reached
``stop_at``, it ran out of ``max_seconds``, or SIGTERM/SIGINT (a checkpoint was written)."""


UNITS = ("byte", "token", "answer")
"""What a run's bits are per (``score_unit``)."""


def score_unit(cfg) -> str:
  """What the bits of a run (``cfg`` a ``TrainConfig``) are per: ``"token"`` for a token file
  (``data.tokens``), ``"answer"`` for a synthetic task (``data.task``: only answer targets are
  scored), else ``"byte"`` (text, byte-level)."""
  if cfg.data.task is not None:
    return "answer"
  return "token" if cfg.data.tokens is not None else "byte"


def unit_key(key: str, unit: str) -> str:
  """``key`` (a ``..._bits_per_byte`` name) with ``unit`` in place of byte; other keys unchanged."""
  return key[: -len("byte")] + unit if key.endswith("_bits_per_byte") else key


def held_out_report(
  step: int, bits: float, unit: str, unigram: float, bytes_per_token: float
) -> tuple[dict[str, float], str]:
  """The metrics record's held-out keys and the log line of an evaluation at ``step``: ``bits`` per
  ``unit`` (``score_unit``) beside the unigram baseline; for a token run whose tokenizer gives each
  token's bytes (``bytes_per_token`` not NaN), also ``eval_bits_per_byte`` = bits / bytes_per_token."""
  record = {f"eval_bits_per_{unit}": bits}
  per_byte = ""
  if not math.isnan(bytes_per_token):
    record["eval_bits_per_byte"] = bits / bytes_per_token
    per_byte = f", {record['eval_bits_per_byte']:.3f} bits/byte"
  return record, f"step {step}: held-out {bits:.3f} bits/{unit}{per_byte} (unigram {unigram:.3f} bits/{unit})"


@dataclass
class TrainResult:
  """What a run reports at the end (also written to ``<workdir>/summary.json``).

  ``step``: optimizer steps done; ``train_loss``: last training loss in nats/token (the
  optimizer's unit, ``metrics.jsonl``'s ``loss``); ``train_bits_per_byte``: the same in bits/byte,
  the unit of every other figure; ``eval_bits_per_byte`` and ``unigram_bits_per_byte``: held-out cross-entropy and the held-out
  unigram entropy (bits/byte); ``tokens_per_second``: training throughput of the last process that
  timed steps (first step of each process excluded); ``wall_seconds``: this process's wall time;
  ``sample``: prompt + generated text; ``num_steps``: the schedule's length (``cfg.num_steps``, or
  fewer when fitted to ``max_seconds``: see ``jaxpe.pacing``), the run is complete at that step;
  ``completed``: whether it is (``step >= num_steps``); ``stop_reason``: one of
  ``STOP_REASONS``; ``run``: what the run started with (``run_info``: parameters, devices, mesh,
  data); ``unit``: what the bits are per (``score_unit``: byte, token or answer). The fields keep
  the byte names for every unit (their values are bits per ``unit``); ``summary.json``
  (``summary_dict``) names them by the unit (``eval_bits_per_token``, ...).
  ``bytes_per_token``: for a token-file run with a byte-level tokenizer, the bytes of text per scored
  held-out token (``evaluation.held_out_bytes_per_token``; ``summary.json`` then also holds
  ``eval_bits_per_byte``, the held-out bits over those bytes); NaN otherwise.
  """

  step: int
  train_loss: float
  eval_bits_per_byte: float
  unigram_bits_per_byte: float
  tokens_per_second: float
  wall_seconds: float
  sample: str
  num_steps: int = 0
  completed: bool = False
  stop_reason: str = ""
  run: dict[str, Any] = field(default_factory=dict)
  train_bits_per_byte: float = math.nan
  unit: str = "byte"
  bytes_per_token: float = math.nan


def summary_dict(result: TrainResult) -> dict[str, Any]:
  """``result`` as ``summary.json`` holds it: its fields, the bits named by its ``unit``
  (``eval_bits_per_token`` for a token file; unchanged for bytes), and for a token file whose
  ``bytes_per_token`` is known the held-out ``eval_bits_per_byte``."""
  out = {unit_key(k, result.unit): v for k, v in result.__dict__.items()}
  if result.unit == "token" and result.bytes_per_token > 0:  # known bytes: bits per byte too
    out["eval_bits_per_byte"] = result.eval_bits_per_byte / result.bytes_per_token
  return out


def read_summary(workdir: Path) -> TrainResult | None:
  """``<workdir>/summary.json`` as a ``TrainResult`` (null numbers read as NaN), or None when it is
  missing, damaged or not a summary (a rerun then writes it again)."""
  try:
    raw = json.loads((workdir / "summary.json").read_bytes().decode())
    names = {unit_key(f.name, raw.get("unit", "byte")): f.name for f in fields(TrainResult)}
    values = {names[k]: math.nan if v is None else v for k, v in raw.items() if k in names}
    return TrainResult(**values)
  except (OSError, ValueError, TypeError, AttributeError):
    return None


TENSORBOARD_DIR = "tensorboard"
"""The folder under the workdir that holds the TensorBoard event files (``tensorboard --logdir``)."""


def run_info(
  mesh: jax.sharding.Mesh, num_params: int, fingerprint: dict[str, Any], corpus: data.Corpus | None
) -> dict:
  """What a run starts with, for the start lines, TensorBoard and ``summary.json`` (``run``):
  ``num_params``; ``devices`` (``count``, ``platform``, ``kind``, ``processes``); ``mesh`` (axis
  name -> size, in the mesh's axis order); ``data`` (``path``, ``train_bytes``, ``eval_bytes``,
  ``train_files``, ``held_files``: counts, and the data's ``sha256`` fingerprint)."""
  devices = jax.devices()
  return {
    "num_params": num_params,
    "devices": {
      "count": len(devices),
      "platform": devices[0].platform,
      "kind": devices[0].device_kind,
      "processes": jax.process_count(),
    },
    "mesh": {name: int(size) for name, size in mesh.shape.items()},
    "data": {
      "path": corpus.where,
      "train_bytes": fingerprint["train_bytes"],
      "eval_bytes": fingerprint["eval_bytes"],
      "train_files": len(corpus.train_files),
      "held_files": len(corpus.held_files),
      "sha256": fingerprint["sha256"],
    }
    if corpus is not None
    else {"task": fingerprint["task"], "sha256": fingerprint["sha256"]},
  }


def start_lines(info: dict) -> list[str]:
  """The console lines of ``run_info``: parameters, devices, mesh shape and axis names."""
  d, mesh = info["devices"], info["mesh"]
  return [
    f"model: {info['num_params']:,} parameters",
    f"devices: {d['count']} x {d['kind']} ({d['platform']}), {d['processes']} process{'es' * (d['processes'] != 1)}",
    f"mesh: {' x '.join(f'{name} {size}' for name, size in mesh.items())} "
    f"(shape {tuple(mesh.values())}, axis names {tuple(mesh)})",
    *([f"mfu: model FLOP/s against {info['mfu_peak']['source']}"] if "mfu_peak" in info else []),
  ]


_TAGS = {
  "loss": "train/loss_nats_per_token",
  **{f"{side}_bits_per_{unit}": f"{side}/bits_per_{unit}" for side in ("train", "eval") for unit in UNITS},
}


def record_unit(record: dict[str, Any]) -> str:
  """The unit of a ``metrics.jsonl`` record's bits: the one of its ``train_bits_per_<unit>`` key."""
  return next((u for u in UNITS if f"train_bits_per_{u}" in record), "byte")


def tensorboard_scalars(record: dict[str, Any]) -> dict[str, float]:
  """TensorBoard tag -> value for a ``metrics.jsonl`` record: ``train/bits_per_byte``,
  ``eval/bits_per_byte`` (``bits_per_token`` / ``bits_per_answer`` for those units),
  ``train/loss_nats_per_token`` and ``train/<key>`` for its other numbers (``learning_rate``,
  ``step_seconds``, ``tokens_per_second``, ``grad_norm``, ...); not ``step`` (the event's step) nor
  flags."""
  return {
    _TAGS.get(k, f"train/{k}"): float(v)
    for k, v in record.items()
    if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
  }


def console_figures(record: dict[str, Any]) -> dict[str, str]:
  """The progress bar's figures for a record: loss in bits per its unit (bits/byte for text),
  learning rate, step time, tokens/s, MFU (where known)."""
  unit = record_unit(record)
  return {
    "loss": f"{record[f'train_bits_per_{unit}']:.3f} bits/{unit}",
    "lr": f"{record['learning_rate']:.2e}",
    "time": f"{record['step_seconds']:.3f} s/step",
    "tok/s": f"{record['tokens_per_second']:,.0f}",
    **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}),
  }


def _open_tensorboard(logdir: Path):
  """``(True, the line saying where events go)``, or ``(False, why none are written)``."""
  try:
    events.import_tensorboardx()
  except ImportError:
    return False, 'tensorboard: off (tensorboardX is not installed: pip install "jaxpe[train]")'
  return True, f"tensorboard: {logdir} (view: tensorboard --logdir {logdir}; pip install tensorboard)"


class RunLog:
  """A run's reports, opened for the loop: the console (``pacing.Progress`` from step ``initial``
  of ``total``), ``<workdir>/metrics.jsonl`` (appended) and the TensorBoard writer. Process 0
  writes the files; other processes write only messages. Use as a context manager (closes all).
  ``sync`` makes what is logged durable; the loop calls it before each checkpoint, so a checkpoint
  never covers a step whose record or events could still be lost (kill -9, power loss).
  """

  def __init__(self, workdir: Path, *, total: int, initial: int, primary: bool, progress: bool):
    self.workdir, self.primary, self.progress = workdir, primary, progress
    self.bar = pacing.Progress(total, initial, enabled=progress)
    self.metrics = (workdir / "metrics.jsonl").open("a") if primary else open(os.devnull, "w")
    self.tensorboard, self.tensorboard_line, self._events_on, self._texts = None, "", False, []
    self._purge_step = initial + 1  # events of a resumed run's lost steps (after its checkpoint) are hidden
    if primary:
      self._events_on, self.tensorboard_line = _open_tensorboard(workdir / TENSORBOARD_DIR)

  def _writer(self) -> events.EventFile | None:
    """The TensorBoard event file, opened (with the start texts) at the first logged step; None when
    events are off (no tensorboardX, or the folder cannot be written: said in one line). It is made
    only when a step is logged, so a rerun that trains nothing adds no empty event file."""
    if self.tensorboard is None and self._events_on:
      self._events_on = False
      try:
        self.tensorboard = events.EventFile(self.workdir / TENSORBOARD_DIR, purge_step=self._purge_step)
      except OSError as e:
        self.bar.write(f"tensorboard: off (cannot write {self.workdir / TENSORBOARD_DIR}: {e})")
        return None
      for tag, text in self._texts:
        self.tensorboard.add_text(tag, text, 0)
    return self.tensorboard

  def sync(self) -> None:
    """Makes every record and event logged so far durable (process 0): ``metrics.jsonl`` and the
    event file flushed and ``fsync``-ed. The loop calls it before each checkpoint, so no datum a
    checkpoint covers is lost by a kill -9 (or a power loss) after it."""
    if not self.primary:
      return
    self.metrics.flush()
    os.fsync(self.metrics.fileno())
    if self.tensorboard is not None:
      self.tensorboard.flush()

  def __enter__(self) -> RunLog:
    return self

  def __exit__(self, *exc) -> None:
    self.bar.close()  # the bar ends its line before any error
    with contextlib.suppress(OSError):  # a signal's checkpoint follows; a gone workdir is the error
      self.sync()  # (the files are still open: their fsync cannot fail on a deleted folder)
    self.metrics.close()
    if self.tensorboard is not None:
      self.tensorboard.close()

  def start(self, info: dict, config_json: str) -> None:
    """Says what the run starts with (``run_info``): on the console when ``progress``, as
    TensorBoard text (with the config) on process 0."""
    lines = [*start_lines(info), self.tensorboard_line] if self.primary else start_lines(info)
    if self.progress:
      for line in lines:
        self.bar.write(line)
    if self.primary:  # written with the first step's events
      self._texts = [
        ("run/start", "\n\n".join(lines)),
        ("run/config", "    " + config_json.replace("\n", "\n    ")),
      ]

  def write(self, text: str) -> None:
    """A message line on the console (every process, whatever ``progress``)."""
    self.bar.write(text)

  def append(self, record: dict[str, Any]) -> None:
    """Writes ``record`` to ``metrics.jsonl`` and TensorBoard (no check, no flush)."""
    self.metrics.write(run_files.json_text(record) + "\n")  # a non-finite number as null
    writer = self._writer() if self.primary else None
    if writer is not None:
      for tag, value in tensorboard_scalars(record).items():
        writer.add_scalar(tag, value, record["step"])

  def step(self, record: dict[str, Any]) -> None:
    """Logs a step's record: checks the workdir is still there (``run_guard.check_workdir_intact``,
    process 0), appends and flushes the record, and updates the console.

    Raises:
      run_guard.WorkdirGoneError: the workdir was deleted, moved or replaced; nothing is written.
    """
    if self.primary:
      run_guard.check_workdir_intact(self.workdir, self.metrics, record["step"])
    self.append(record)
    self.metrics.flush()
    self.bar.update(record["step"], **console_figures(record))


def write_summary(workdir: Path, summary: dict[str, Any]) -> None:
  """Writes ``summary`` to ``<workdir>/summary.json`` (atomically; NaN and +-inf, at any depth,
  become null: ``run_files.json_text``, so the file is strict JSON)."""
  run_files.write_atomic(workdir / "summary.json", run_files.json_text(summary, indent=2))
