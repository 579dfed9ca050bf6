"""The files a run writes (issue 39, kinds 10 and 12): every datum a checkpoint covers is on disk
before it (a kill -9 just after a checkpoint loses no metrics record and no TensorBoard event), and
every JSON file is strict JSON (RFC 8259: no bare ``NaN`` / ``Infinity`` tokens; non-finite numbers
are ``null``), read back by the trainer and the study as NaN."""

import ast
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpe.train import run_files, run_log

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "train" / "train.py")


def _strict(text: str):
  """``text`` parsed by a strict JSON parser: Python's, refusing the NaN / Infinity tokens."""

  def refuse(token):
    raise ValueError(f"not JSON: {token}")

  return json.loads(text, parse_constant=refuse)


def _events(logdir: Path) -> dict[str, dict[int, float]]:
  """tag -> {step: value} of every scalar in the event files under ``logdir`` (TFRecord framing
  read by hand, tensorboardX's protobuf)."""
  from tensorboardX.proto import event_pb2

  out: dict[str, dict[int, float]] = {}
  for path in sorted(logdir.glob("events.out.tfevents.*")):
    raw, i = path.read_bytes(), 0
    while i + 12 <= len(raw):
      (length,) = struct.unpack("<Q", raw[i : i + 8])
      if i + 12 + length + 4 > len(raw):
        break  # a record cut by the kill
      event = event_pb2.Event.FromString(raw[i + 12 : i + 12 + length])
      for value in event.summary.value:
        if value.HasField("simple_value"):
          out.setdefault(value.tag, {})[event.step] = value.simple_value
      i += 12 + length + 4
  return out


# --- kind 12: strict JSON -------------------------------------------------------------------------


def test_json_text_writes_non_finite_numbers_as_null_at_any_depth():
  value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2, math.nan), "e": "NaN", "f": None}
  assert _strict(run_files.json_text(value)) == {
    "a": None,
    "b": [1.5, None, {"c": None}],
    "d": [2, None],
    "e": "NaN",
    "f": None,
  }
  back = run_files.nan_for_null(_strict(run_files.json_text({"x": [math.nan, 1.0]})))
  assert math.isnan(back["x"][0]) and back["x"][1] == 1.0


def test_metrics_and_summary_with_non_finite_numbers_are_strict_json_and_read_back_as_nan(tmp_path):
  with run_log.RunLog(tmp_path, total=3, initial=0, primary=True, progress=False) as log:
    log.append({"step": 1, "loss": 2.0, "grad_norm": 1.0})
    log.append({"step": 2, "loss": math.nan, "grad_norm": math.inf, "param_norm": -math.inf, "skipped": True})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [_strict(line)["loss"] for line in lines] == [2.0, None]
  records = run_files.read_metrics(tmp_path / "metrics.jsonl")  # the trainer's resume reads these
  assert [r["step"] for r in records] == [1, 2]
  assert (
    math.isnan(records[1]["loss"]) and math.isnan(records[1]["grad_norm"]) and records[1]["skipped"] is True
  )

  # A file of an older run, with Python's bare NaN tokens: read, and rewritten strict on resume.
  old = tmp_path / "old.jsonl"
  old.write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": 1.0}\n')
  kept = run_files.truncate_metrics(old, 1)
  assert len(kept) == 1 and math.isnan(kept[0]["loss"])
  assert _strict(old.read_text()) == {"step": 1, "loss": None}

  result = run_log.TrainResult(
    2, math.nan, math.inf, 5.0, 1.0, 3.0, "def ", run={"mfu_peak": {"flops": -math.inf}}
  )
  run_log.write_summary(tmp_path, result.__dict__)
  saved = _strict((tmp_path / "summary.json").read_text())
  assert (saved["train_loss"], saved["eval_bits_per_byte"], saved["run"]) == (
    None,
    None,
    {"mfu_peak": {"flops": None}},
  )
  summary = run_log.read_summary(tmp_path)
  assert summary.step == 2 and math.isnan(summary.train_loss) and math.isnan(summary.eval_bits_per_byte)


def _json_dumps_calls(path: Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Attribute)
      and node.func.attr in ("dumps", "dump")
    ):
      if isinstance(node.func.value, ast.Name) and node.func.value.id == "json":
        yield node


def test_every_json_writer_in_jaxpe_is_strict():
  """Every ``json.dump(s)`` in the package refuses NaN / Infinity (``allow_nan=False``): the run's
  files go through ``run_files.json_text`` (non-finite numbers as null), the rest hold only finite
  config values (an error, not a bare NaN token, if one ever were not)."""
  calls = [(p, c) for p in sorted((ROOT / "jaxpe").rglob("*.py")) for c in _json_dumps_calls(p)]
  assert len(calls) >= 4  # json_text, the BLOOM export's config, config_keys, the config hashes
  loose = [
    f"{p.relative_to(ROOT)}:{c.lineno}"
    for p, c in calls
    if not any(
      k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False
      for k in c.keywords
    )
  ]
  assert not loose, f"json.dumps without allow_nan=False (use jaxpe.train.run_files.json_text): {loose}"


# --- kind 10: nothing a checkpoint covers is lost by a kill -9 just after it ----------------------


def test_kill_9_just_after_a_checkpoint_loses_no_metrics_record_and_no_tensorboard_event(tmp_path, text_file):
  pytest.importorskip("tensorboardX")
  run = tmp_path / "run"
  args = [
    *("--config", str(ROOT / "configs" / "tiny.yaml")),
    *(f"workdir={run}", f"data.path={text_file}", "seq_len=32", "batch_size=8", "warmup_steps=2"),
    *("eval_every=1000", "eval_batches=1", "sample_len=0", "num_steps=400", "checkpoint_every=6"),
    *("model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_len=32"),
  ]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
    [sys.executable, TRAIN, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
  )
  ckpts, end = run / "checkpoints", time.time() + 300
  try:
    while not (ckpts.is_dir() and any(p.name.isdigit() and int(p.name) >= 12 for p in ckpts.iterdir())):
      assert proc.poll() is None, f"trainer ended early: {proc.communicate()[1][-3000:]}"
      assert time.time() < end, "timed out waiting for the checkpoint of step 12"
      time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)  # right after the checkpoint appears: before the next one
  finally:
    proc.kill()
    proc.communicate()
  saved = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
  assert saved >= 12
  steps = [
    _strict(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.endswith("}")
  ]
  assert steps[:saved] == list(range(1, saved + 1))
  scalars = _events(run / "tensorboard")
  for tag in ("train/loss_nats_per_token", "train/bits_per_byte", "train/learning_rate"):
    missing = sorted(set(range(1, saved + 1)) - set(scalars.get(tag, {})))
    assert not missing, f"{tag}: steps {missing} of the checkpoint of step {saved} are not in TensorBoard"
