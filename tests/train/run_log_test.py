"""What a run reports: the start lines (data, parameters, devices, mesh), one record per step in
metrics.jsonl and the same scalars as TensorBoard events, and summary.json saying whether the
schedule completed and why the run stopped."""

import importlib.util
import json
import math
import os
import re
import signal
import struct
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.decoder import Decoder
from jaxpe.train import data, optimizer, run_files, run_guard, run_log, trainer
from jaxpe.train.config import load_config

pytestmark = pytest.mark.usefixtures("standard_promotion")

OLD_KEYS = {"step", "loss", "grad_norm", "tokens_per_second"}
NEW_KEYS = {
  "train_bits_per_byte",
  "learning_rate",
  "step_seconds",
  "data_seconds",
  "model_flops_per_second",
  "mfu",
}


def _cfg(workdir, text_file, *extra):
  return load_config(
    None,
    [
      f"workdir={workdir}",
      f"data.path={text_file}",
      "seq_len=32",
      "batch_size=8",
      "num_steps=6",
      "warmup_steps=2",
      "learning_rate=1e-2",
      "eval_every=3",
      "eval_batches=1",
      "checkpoint_every=3",
      "sample_len=0",
      "model.d_model=32",
      "model.num_layers=1",
      "model.num_heads=4",
      "model.max_len=32",
      *extra,
    ],
  )


def _records(run: Path) -> list[dict]:
  return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summary_peak(run: Path) -> float:
  return json.loads((run / "summary.json").read_text())["run"]["mfu_peak"]["flops_per_second"]


def _summary(run: Path) -> dict:
  return json.loads((run / "summary.json").read_text())


def _events(logdir: Path):
  """Every event in the TFRecord files under ``logdir`` (tensorboardX's protobuf, read back)."""
  from tensorboardX.proto import event_pb2

  events = []
  for path in sorted(logdir.glob("events.out.tfevents.*")):
    raw = path.read_bytes()
    i = 0
    while i < len(raw):
      (length,) = struct.unpack("<Q", raw[i : i + 8])
      events.append(event_pb2.Event.FromString(raw[i + 12 : i + 12 + length]))
      i += 12 + length + 4  # length, its CRC, the record, its CRC
  return events


def test_a_run_logs_its_start_every_step_and_whether_its_schedule_completed(tmp_path, text_file, capsys):
  run = tmp_path / "run"
  cfg = _cfg(run, text_file, "stop_at=3")
  first = trainer.train(cfg, progress=True)
  out = capsys.readouterr().out

  # Start: data (files and bytes per side), parameters, devices, mesh shape and axis names.
  corpus = data.load_corpus(text_file, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction)
  params = nnx.state(nnx.eval_shape(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)  # shapes
  num_params = sum(x.size for x in jax.tree.leaves(params))
  assert f"  training: {corpus.train.size:,} bytes from 1 file" in out and "  held-out: " in out
  assert f"model: {num_params:,} parameters\n" in out
  assert "devices: 8 x cpu (cpu), 1 process\n" in out
  assert (
    "mesh: data 8 x fsdp 1 x tensor 1 x context 1 (shape (8, 1, 1, 1), axis names ('data', 'fsdp', 'tensor', "
    "'context'))\n" in out
  )
  has_tensorboard = importlib.util.find_spec("tensorboardX") is not None
  logdir = run / "tensorboard"
  view = f"tensorboard: {logdir} (view: tensorboard --logdir {logdir}; pip install tensorboard)\n"
  assert (view if has_tensorboard else "tensorboard: off (") in out
  # Per logged step (a line on a non-terminal): loss in bits/byte, learning rate, step time, tokens/s.
  assert re.search(
    r"^step 1/6 loss \d\.\d{3} bits/byte lr 0\.00e\+00 time \d+\.\d{3} s/step tok/s 0 mfu 0\.0%$", out, re.M
  ), out

  # metrics.jsonl: the old keys and the new ones; the rate is the schedule's at the update count.
  records = _records(run)
  assert [r["step"] for r in records] == [1, 2, 3]
  assert all(OLD_KEYS | NEW_KEYS <= set(r) for r in records)
  schedule = optimizer.learning_rate_schedule(1e-2, num_steps=6, warmup_steps=2, min_lr_ratio=0.1)
  assert [r["learning_rate"] for r in records] == pytest.approx([float(schedule(n)) for n in range(3)])
  assert [r["learning_rate"] for r in records] == pytest.approx([0.0, 5e-3, 1e-2])
  # MFU (issue 37 item 10): model FLOP/s = tokens/s x the model's training FLOPs per token (the
  # count of benchmarks/ceilings.py, an independent sum over the step's matmuls), over the peak.
  sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as tests/benchmarks_test.py
  ceilings = importlib.import_module("ceilings")

  per_token = ceilings.useful_flops(ceilings.decoder_matmuls(cfg.model, 1, cfg.seq_len)) / cfg.seq_len
  for r in records:
    assert r["model_flops_per_second"] == pytest.approx(r["tokens_per_second"] * per_token, rel=1e-9)
    assert r["mfu"] == pytest.approx(r["model_flops_per_second"] / summary_peak(run), rel=1e-9)
  for r in records:
    assert r["train_bits_per_byte"] == pytest.approx(r["loss"] / math.log(2))
    assert r["step_seconds"] > 0 and 0 <= r["data_seconds"] < 60
  assert records[1]["tokens_per_second"] > 0 and "eval_bits_per_byte" in records[2]

  # summary.json: stopped at stop_at, not complete; what the run started with.
  summary = _summary(run)
  assert (summary["step"], summary["num_steps"], summary["completed"], summary["stop_reason"]) == (
    3,
    6,
    False,
    "stop_at",
  )
  assert (first.completed, first.stop_reason) == (False, "stop_at")
  fingerprint = data.fingerprint(corpus)
  assert summary["run"] == {
    "num_params": num_params,
    "devices": {"count": 8, "platform": "cpu", "kind": "cpu", "processes": 1},
    "mesh": {"data": 8, "fsdp": 1, "tensor": 1, "context": 1},
    "data": {
      "path": corpus.where,
      "train_bytes": corpus.train.size,
      "eval_bytes": corpus.eval.size,
      "train_files": 1,
      "held_files": 1,
      "sha256": fingerprint["sha256"],
    },
    "mfu_peak": summary["run"]["mfu_peak"],  # checked below
  }
  peak = summary["run"]["mfu_peak"]
  assert peak["flops_per_second"] > 1e8 and peak["source"].startswith(
    "the float32 matmul ceiling measured on 8 CPU"
  )
  assert f"mfu: model FLOP/s against {peak['source']}\n" in out

  # Rerun at its stop_at: nothing to train, the summary kept.
  capsys.readouterr()
  trainer.train(cfg, progress=True)
  assert "is at stop_at=3 (step 3 of 6); nothing to train (raise or drop stop_at" in capsys.readouterr().out
  assert _summary(run) == summary

  # Resumed to the end: complete.
  done = trainer.train(_cfg(run, text_file), progress=False)
  summary = _summary(run)
  assert (done.step, done.completed, done.stop_reason) == (6, True, "schedule_done")
  assert (summary["step"], summary["completed"], summary["stop_reason"]) == (6, True, "schedule_done")
  records = _records(run)
  assert [r["step"] for r in records] == list(range(1, 7))
  # The units: train_loss in nats/token (named so), train_bits_per_byte the same in bits/byte.
  assert summary["train_bits_per_byte"] == pytest.approx(summary["train_loss"] / math.log(2))
  assert summary["train_bits_per_byte"] == pytest.approx(records[-1]["train_bits_per_byte"])

  # Rerun once finished (issue 37 item 8): says so, trains nothing, keeps summary.json (main said
  # "resumed" and rewrote it: wall_seconds 410 -> 12.8) and adds no empty event file (item 7).
  summary_bytes = (run / "summary.json").read_bytes()
  capsys.readouterr()
  again = trainer.train(_cfg(run, text_file), progress=True)
  out = capsys.readouterr().out
  assert f"the run in {run} is finished: its schedule of 6 steps is complete; nothing to train" in out, out
  assert "resumed" not in out
  assert (run / "summary.json").read_bytes() == summary_bytes
  assert (again.step, again.wall_seconds, again.sample) == (6, summary["wall_seconds"], summary["sample"])
  assert [r["step"] for r in _records(run)] == list(range(1, 7))

  if not has_tensorboard:
    assert not (run / "tensorboard").exists()
    return
  # TensorBoard: the same scalars for every step, in one event file per process that ran.
  events = _events(run / "tensorboard")
  assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
  scalars: dict[str, dict[int, float]] = {}
  texts = set()
  for event in events:
    for value in event.summary.value:
      if value.HasField("simple_value"):
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
      else:
        texts.add(value.tag)
  assert {"run/start/text_summary", "run/config/text_summary"} <= texts
  for tag, key in [
    ("train/bits_per_byte", "train_bits_per_byte"),
    ("train/loss_nats_per_token", "loss"),
    ("train/learning_rate", "learning_rate"),
    ("train/step_seconds", "step_seconds"),
    ("train/tokens_per_second", "tokens_per_second"),
    ("train/grad_norm", "grad_norm"),
  ]:
    assert scalars[tag] == pytest.approx({r["step"]: r[key] for r in records}, rel=1e-6), tag
  assert scalars["eval/bits_per_byte"] == pytest.approx(
    {r["step"]: r["eval_bits_per_byte"] for r in records if "eval_bits_per_byte" in r}, rel=1e-6
  )
  assert sorted(scalars["eval/bits_per_byte"]) == [3, 6]


def test_summary_says_why_a_run_stopped_and_a_missing_tensorboardx_is_one_line(
  tmp_path, text_file, monkeypatch, capsys
):
  # max_seconds runs out after the first step; without tensorboardX no events are written.
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as when not installed
  slow = tmp_path / "slow"
  result = trainer.train(_cfg(slow, text_file, "max_seconds=0.001"), progress=True)
  out = capsys.readouterr().out
  assert out.count('tensorboard: off (tensorboardX is not installed: pip install "jaxpe[train]")\n') == 1
  assert not (slow / "tensorboard").exists()
  summary = _summary(slow)
  assert (result.step, result.completed, result.stop_reason) == (1, False, "max_seconds")
  assert (summary["step"], summary["completed"], summary["stop_reason"]) == (1, False, "max_seconds")

  # A signal during step 2: the run saves step 2, and summary.json says so (valid JSON: no eval yet).
  real = data.train_batch

  def terminate_during_step_2(tokens, *, step, **kw):
    if step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(tokens, step=step, **kw)

  monkeypatch.setattr(data, "train_batch", terminate_during_step_2)
  stopped = tmp_path / "stopped"
  with pytest.raises(run_guard.TrainingInterrupted, match="stopped by SIGTERM at step 2"):
    trainer.train(_cfg(stopped, text_file), progress=False)
  summary = _summary(stopped)
  assert (summary["step"], summary["completed"], summary["stop_reason"]) == (2, False, "signal")
  assert summary["eval_bits_per_byte"] is None and summary["run"]["num_params"] > 0


def test_tensorboard_scalars_and_console_figures_name_their_units():
  record = {
    "step": 4,
    "loss": 1.0,
    "grad_norm": 0.5,
    "tokens_per_second": 1234.0,
    "train_bits_per_byte": 1 / math.log(2),
    "learning_rate": 3e-3,
    "step_seconds": 0.25,
    "skipped": True,
    "eval_bits_per_byte": 2.0,
  }
  assert run_log.tensorboard_scalars(record) == {
    "train/loss_nats_per_token": 1.0,
    "train/grad_norm": 0.5,
    "train/tokens_per_second": 1234.0,
    "train/bits_per_byte": 1 / math.log(2),
    "train/learning_rate": 3e-3,
    "train/step_seconds": 0.25,
    "eval/bits_per_byte": 2.0,
  }
  assert run_log.console_figures(record) == {
    "loss": "1.443 bits/byte",
    "lr": "3.00e-03",
    "time": "0.250 s/step",
    "tok/s": "1,234",
  }
  assert set(run_log.STOP_REASONS) == {"schedule_done", "stop_at", "max_seconds", "signal"}
  np.testing.assert_allclose(record["train_bits_per_byte"], data.bits_per_byte(record["loss"]))


@pytest.mark.parametrize("unit", ["token", "answer"])
def test_bits_of_token_and_task_runs_are_named_by_their_unit(tmp_path, unit):
  # A token file's bits are per token, a task's per answer: no key or label says byte (issue 46).
  record = {"step": 4, "loss": 1.0, f"train_bits_per_{unit}": 1 / math.log(2), "learning_rate": 3e-3}
  record |= {"step_seconds": 0.25, "tokens_per_second": 1234.0, f"eval_bits_per_{unit}": 2.0}
  scalars = run_log.tensorboard_scalars(record)
  assert scalars[f"train/bits_per_{unit}"] == pytest.approx(1 / math.log(2))
  assert scalars[f"eval/bits_per_{unit}"] == 2.0 and not any("byte" in tag for tag in scalars)
  assert run_log.console_figures(record)["loss"] == f"1.443 bits/{unit}"
  result = run_log.TrainResult(
    step=4, train_loss=1.0, eval_bits_per_byte=2.0, unigram_bits_per_byte=6.0, tokens_per_second=1.0,
    wall_seconds=1.0, sample="", train_bits_per_byte=1.5, unit=unit,
  )  # fmt: skip
  run_log.write_summary(tmp_path, run_log.summary_dict(result))
  saved = _summary(tmp_path)
  assert (saved["unit"], saved[f"eval_bits_per_{unit}"], saved[f"unigram_bits_per_{unit}"]) == (
    unit,
    2.0,
    6.0,
  )
  assert saved[f"train_bits_per_{unit}"] == 1.5 and not any("per_byte" in k for k in saved)
  assert run_log.read_summary(tmp_path) == result
  (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
  assert run_files.read_metrics(tmp_path / "metrics.jsonl") == [record]
  import matplotlib.axes  # the plot's axis names the unit

  labels, real = [], matplotlib.axes.Axes.set_ylabel
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(
      matplotlib.axes.Axes, "set_ylabel", lambda ax, text, **kw: labels.append(text) or real(ax, text)
    )
    run_files.plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png", 6.0, unit=unit)
  assert labels == [f"bits per {unit}"] and (tmp_path / "loss.png").stat().st_size > 0
