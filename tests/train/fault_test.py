"""Fault injection: the trainer run as a subprocess (train/train.py) is killed, signalled, made to
diverge, given damaged checkpoints and unwritable directories; no work may be lost and every
failure must be one clear message. The reference for "nothing lost" is an uninterrupted run of the
same command: the final parameters and optimizer state must be bit-identical."""

import ctypes
import importlib.util
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pydantic
import pytest

from jaxpe.train import checkpoint, data, loop, run_checks, run_files, run_guard, sharding, trainer
from jaxpe.train import state as state_lib
from jaxpe.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "train" / "train.py")
FAST = [
  "seq_len=32",
  "batch_size=8",
  "warmup_steps=2",
  "eval_every=1000",
  "eval_batches=1",
  "sample_len=0",
  "model.d_model=32",
  "model.num_layers=2",
  "model.num_heads=4",
  "model.max_len=32",
]


pytestmark = pytest.mark.usefixtures("standard_promotion")


def _args(workdir, text_file, *extra):
  return _last_wins(
    [
      "--config",
      str(ROOT / "configs" / "tiny.yaml"),
      f"workdir={workdir}",
      f"data.path={text_file}",
      *FAST,
      *extra,
    ]
  )


def _last_wins(args):
  """``args`` with each ``key=value`` override given once, the last one (the command lines refuse repeats)."""
  key = lambda a: a.split("=")[0] if "=" in a and not a.startswith("-") else None  # noqa: E731
  return [a for i, a in enumerate(args) if key(a) is None or key(a) not in map(key, args[i + 1 :])]


def _start(workdir, text_file, *extra, preexec_fn=None):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  return subprocess.Popen(
    [sys.executable, TRAIN, *_args(workdir, text_file, *extra)],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    preexec_fn=preexec_fn,
  )


def _finish(proc, timeout=600):
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def _last_step(workdir) -> int:
  path = Path(workdir) / "metrics.jsonl"
  lines = path.read_text().splitlines() if path.is_file() else []
  return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def _wait_for(proc, condition, timeout=600):
  end = time.time() + timeout
  while not condition():
    assert proc.poll() is None, f"trainer ended early: {proc.communicate()}"
    assert time.time() < end, "timed out waiting for the trainer"
    time.sleep(0.002)


def _state(workdir, text_file, *extra):
  """The newest checkpoint of ``workdir`` as numpy arrays (restored into this process's mesh)."""
  cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), _args(workdir, text_file, *extra)[2:])
  _, state, shardings = trainer.create_state(cfg, sharding.make_mesh((-1, 1)))
  with checkpoint.manager(Path(workdir) / "checkpoints") as mngr:
    restored, meta = checkpoint.restore_latest(mngr, checkpoint.abstract_with_shardings(state, shardings))
  return jax.tree.map(np.asarray, restored), meta


def _assert_identical(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(x, y)


def test_kill_term_and_double_interrupt_lose_nothing_and_a_second_trainer_is_refused(tmp_path, text_file):
  steps = ["num_steps=16", "checkpoint_every=4"]
  reference = _start(tmp_path / "ref", text_file, *steps)
  run = tmp_path / "run"
  rng = random.Random(0)

  # SIGKILL inside a checkpoint save (every step saves here), at a random step.
  proc = _start(run, text_file, *steps, "checkpoint_every=1")
  kill_after = rng.randint(2, 6)
  ckpts = run / "checkpoints"
  _wait_for(
    proc,
    lambda: _last_step(run) >= kill_after and any(".orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir()),
  )
  proc.kill()
  proc.wait()
  assert (run / "lock").read_text().split()[0] == str(proc.pid)  # a stale lock left by a dead process

  # SIGTERM: the step finishes, a checkpoint of that step is written, status 128 + 15. Meanwhile a
  # second trainer on the same workdir is refused, naming the holder.
  proc = _start(run, text_file, *steps)
  _wait_for(proc, lambda: _last_step(run) >= 9)
  cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), _args(run, text_file, *steps)[2:])
  with pytest.raises(run_guard.WorkdirInUseError, match=rf"in use by pid {proc.pid} on host \S+"):
    trainer.train(cfg, progress=False)
  proc.send_signal(signal.SIGTERM)
  code, _, err = _finish(proc)
  stopped = _last_step(run)
  assert code == 128 + signal.SIGTERM, err
  assert f"stopped by SIGTERM at step {stopped}; checkpoint saved" in err and "Traceback" not in err
  with checkpoint.manager(ckpts) as mngr:
    assert mngr.latest_step() == stopped

  # Two Ctrl-Cs: the second exits at once with 128 + 2, whatever the first was doing.
  proc = _start(run, text_file, *steps)
  _wait_for(proc, lambda: _last_step(run) > stopped)
  proc.send_signal(signal.SIGINT)
  proc.send_signal(signal.SIGINT)
  assert _finish(proc)[0] == 128 + signal.SIGINT

  code, _, err = _finish(_start(run, text_file, *steps))
  assert code == 0, err
  assert _finish(reference)[0] == 0
  _assert_identical(_state(run, text_file, *steps)[0], _state(tmp_path / "ref", text_file, *steps)[0])
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 17))


def test_nonfinite_step_stops_the_run_and_no_nonfinite_state_is_saved(tmp_path, text_file):
  # lr 1e30 after a warmup step of lr 0: step 2's update (or step 3's loss) is not finite.
  run = tmp_path / "run"
  code, out, err = _finish(
    _start(run, text_file, "num_steps=12", "checkpoint_every=1", "keep_checkpoints=2", "learning_rate=1e30")
  )
  assert code == 1, (out, err)
  assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("train.py: error: non-finite")
  records = run_files.read_metrics(run / "metrics.jsonl")  # strict JSON: a non-finite number is null
  bad = records[-1]["step"]
  assert (
    records[-1]["skipped"]
    and not np.isfinite([records[-1][k] for k in ("loss", "grad_norm", "param_norm")]).all()
  )
  assert f"non-finite training step {bad}" in err and f"last good checkpoint is step {bad - 1}" in err
  with checkpoint.manager(run / "checkpoints") as mngr:
    assert mngr.all_steps() == list(range(max(1, bad - 2), bad))  # the last finite ones; none of `bad`
  state, meta = _state(run, text_file)
  assert meta["step"] == bad - 1
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.inexact))


def _drop_dac_override():
  # Root ignores permission bits; without CAP_DAC_OVERRIDE in its bounding set it obeys them.
  if os.geteuid() == 0:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
      prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP


def _small_files():
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))  # a "full disk" for files > 60 kB


def test_unwritable_or_full_checkpoint_directory_fails_at_once_with_one_message(tmp_path, text_file):
  locked = tmp_path / "locked"
  (locked / "checkpoints").mkdir(parents=True)
  (locked / "checkpoints").chmod(0o555)
  t0 = time.time()
  denied = _start(locked, text_file, "num_steps=4", preexec_fn=_drop_dac_override)
  full = _start(tmp_path / "full", text_file, "num_steps=4", "checkpoint_every=2", preexec_fn=_small_files)
  (code, _, err), (code_full, _, err_full) = _finish(denied), _finish(full)
  assert time.time() - t0 < 150  # was a 300 s hang (orbax's barrier timeout); seconds when idle
  assert code == 2 and err.strip().splitlines() == [
    f"train.py: error: cannot write checkpoints to {str((locked / 'checkpoints').absolute())!r}: Permission denied"
  ]
  # The write fails inside orbax/tensorstore, mid-save: one line after the progress bar, no traceback.
  last = err_full.strip().splitlines()[-1]
  assert code_full == 2 and "Traceback" not in err_full, err_full
  assert (
    last
    == f"train.py: error: could not write checkpoint step 2 to {str((tmp_path / 'full' / 'checkpoints').absolute())!r}: File too large (errno 27)"
  )
  assert not (tmp_path / "full" / "checkpoints" / "2").exists()


def test_a_failed_background_checkpoint_write_names_its_step_in_one_line(tmp_path, text_file):
  background = _start(
    tmp_path / "bg",
    text_file,
    "num_steps=4",
    "checkpoint_every=2",
    "async_checkpoints=true",
    preexec_fn=_small_files,
  )
  code_bg, _, err_bg = _finish(background)
  # Written in the background, the failure of step 2 surfaces at the save of step 4: it names step 2
  # (was step 4) and comes alone (was 318 lines of 'Event loop is closed' tracebacks before it).
  assert code_bg == 2 and "Traceback" not in err_bg and "Event loop" not in err_bg, err_bg
  assert err_bg.strip().splitlines()[-1] == (
    f"train.py: error: could not write checkpoint step 2 to {str((tmp_path / 'bg' / 'checkpoints').absolute())!r} "
    "(in the background): File too large (errno 27); step 4 was not saved"
  ), err_bg
  assert not (tmp_path / "bg" / "checkpoints" / "2").exists()


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
  state = {"w": jax.numpy.ones((256, 256), jax.numpy.float32)}  # 256 KiB
  monkeypatch.setattr(
    checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30, 2**17)
  )
  with checkpoint.manager(tmp_path / "ck") as mngr:
    with pytest.raises(
      checkpoint.CheckpointError, match=r"step 7 .* needs 0.2 MiB and only 0.1 MiB are free"
    ):
      checkpoint.save(mngr, 7, state, {"step": 7})
    assert mngr.all_steps() == []


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, text_file):
  """A finished 4-step in-process run with checkpoints at steps 2 and 4."""
  run = tmp_path_factory.mktemp("saved") / "run"
  with jax.numpy_dtype_promotion("standard"):
    trainer.train(_cfg(run, text_file), progress=False)
  return run


def _cfg(run, text_file, *extra):
  return load_config(
    str(ROOT / "configs" / "tiny.yaml"),
    _args(run, text_file, "num_steps=4", "checkpoint_every=2", *extra)[2:],
  )


def _damage(step_dir: Path, kind: str) -> None:
  data_files = sorted(step_dir.glob("state/ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
  if kind == "truncated array":
    os.truncate(data_files[-1], data_files[-1].stat().st_size // 3)
  elif kind == "random array":
    data_files[-1].write_bytes(np.random.default_rng(0).bytes(data_files[-1].stat().st_size))
  elif kind == "empty step":
    shutil.rmtree(step_dir)
    step_dir.mkdir()
  elif kind == "corrupt tree metadata":
    (step_dir / "state" / "_METADATA").write_text("{not json")
  elif kind == "corrupt step metadata":
    (step_dir / "meta" / "metadata").write_text("[1, 2")


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory):
  """Steps 2 and 4 of a small state (the value of each leaf is its step), written by ``checkpoint.save``."""
  directory = tmp_path_factory.mktemp("small") / "checkpoints"
  rng = np.random.default_rng(0)
  base = {"w": rng.normal(size=(128, 64)).astype(np.float32), "count": np.int32(0)}
  with checkpoint.manager(directory) as mngr:
    for step in (2, 4):
      checkpoint.save(
        mngr, step, jax.tree.map(lambda x, s=step: jax.numpy.asarray(x + s), base), {"step": step}
      )
  return directory, base


def _restore_small(directory, base, **kw):
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=_one), base
  )
  with checkpoint.manager(directory) as mngr:
    return checkpoint.restore_latest(mngr, abstract, **kw)


_one = jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.mark.parametrize(
  "kind", ["truncated array", "random array", "empty step", "corrupt tree metadata", "corrupt step metadata"]
)
def test_damaged_newest_checkpoint_is_named_moved_aside_and_the_previous_one_restored(
  tmp_path, small_checkpoints, kind, caplog
):
  source, base = small_checkpoints
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  _damage(directory / "4", kind)
  state, meta = _restore_small(directory, base)
  assert meta["step"] == 2
  np.testing.assert_array_equal(state["w"], base["w"] + 2)
  assert f"checkpoint step 4 in {directory.absolute()} is damaged" in caplog.text
  assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["2"]
  assert (tmp_path / "checkpoints.damaged" / "4").is_dir()  # kept, not deleted


def test_a_checkpoint_with_nonfinite_values_counts_as_damaged(tmp_path, small_checkpoints, caplog):
  # Written by a version that saved diverged states: the trainer's check skips it.
  source, base = small_checkpoints
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  with checkpoint.manager(directory) as mngr:
    nan = {"w": jax.numpy.full((128, 64), jax.numpy.nan), "count": jax.numpy.int32(6)}
    checkpoint.save(mngr, 6, nan, {"step": 6})
  _, meta = _restore_small(directory, base, check_state=state_lib.nonfinite_reason)
  assert meta["step"] == 4 and "step 6 in" in caplog.text and "holds non-finite values" in caplog.text


def test_no_intact_checkpoint_is_an_error_naming_each_step(tmp_path, small_checkpoints):
  source, base = small_checkpoints
  directory = tmp_path / "checkpoints"
  shutil.copytree(source, directory)
  _damage(directory / "4", "empty step")
  _damage(directory / "2", "truncated array")
  with pytest.raises(
    checkpoint.CheckpointError, match=r"no intact checkpoint .*step 4: unreadable .*step 2: unreadable"
  ):
    _restore_small(directory, base)
  assert not (tmp_path / "checkpoints.damaged").exists()


_READ_ONLY = """
import sys
from jaxpe import study
from jaxpe.train.config import load_config
params = study.trained_params(load_config(sys.argv[1], sys.argv[2:]))
print(len(params), "arrays")
"""


def test_a_read_only_checkpoint_directory_is_read_without_writing(tmp_path, saved_run, text_file):
  # Was "cannot write checkpoints to ...: Permission denied": the write probe ran for reads too.
  run = tmp_path / "run"
  shutil.copytree(saved_run, run)
  subprocess.run(["chmod", "-R", "a-w", str(run)], check=True)
  before = sorted((str(p), p.stat().st_mtime_ns) for p in run.rglob("*"))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  args = _args(run, text_file, "num_steps=4", "checkpoint_every=2")
  proc = subprocess.run(
    [sys.executable, "-c", _READ_ONLY, *args[1:]],
    env=env,
    capture_output=True,
    text=True,
    preexec_fn=_drop_dac_override,
    timeout=600,
  )
  assert proc.returncode == 0 and proc.stdout.endswith(" arrays\n") and proc.stderr == "", proc.stderr
  assert sorted((str(p), p.stat().st_mtime_ns) for p in run.rglob("*")) == before
  subprocess.run(["chmod", "-R", "u+w", str(run)], check=True)


def test_resume_after_damage_redoes_the_lost_steps_identically(tmp_path, saved_run, text_file):
  run = tmp_path / "run"
  shutil.copytree(saved_run, run)
  _damage(run / "checkpoints" / "4", "truncated array")
  result = trainer.train(_cfg(run, text_file), progress=False)
  assert result.step == 4
  _assert_identical(_state(run, text_file)[0], _state(saved_run, text_file)[0])


def test_config_json_damaged_or_missing_cannot_hide_a_changed_run(tmp_path, saved_run, text_file, caplog):
  run = tmp_path / "run"
  shutil.copytree(saved_run, run)
  (run / "config.json").unlink()
  for change in ("seed=1", "model.d_model=64"):
    with pytest.raises(ValueError, match=rf"{change.split('=')[0]}: .*saved in the checkpoint of step 4"):
      trainer.train(_cfg(run, text_file, change), progress=False)
  assert not (run / "config.json").exists()  # written only after a successful restore

  (run / "config.json").write_text('{"seed": ')
  result = trainer.train(_cfg(run, text_file, "num_steps=5"), progress=False)
  assert result.step == 5 and f"ignoring {run / 'config.json'}: it is not a valid JSON object" in caplog.text
  assert json.loads((run / "config.json").read_text())["num_steps"] == 5


def test_a_resume_on_changed_data_is_refused_unless_allowed(tmp_path, saved_run, text_file, caplog):
  # Issue 17: the checkpoint carries the data fingerprint (bytes used, not the path); a resume on
  # other bytes under the same path (e.g. 50 KB prepended) continued on another batch stream.
  run = tmp_path / "run"
  shutil.copytree(saved_run, run)
  cfg = _cfg(run, text_file)
  corpus = data.load_corpus(text_file, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction)
  meta_file = run / "checkpoints" / "4" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  assert meta["data_fingerprint"] == data.fingerprint(corpus)  # it travels
  other = data.fingerprint(data.Corpus(corpus.train[7:], corpus.eval, 1))
  meta_file.write_text(json.dumps({**meta, "data_fingerprint": other}))  # as if trained on other bytes
  config_json = (run / "config.json").read_text()
  with pytest.raises(ValueError) as refused:
    trainer.train(cfg, progress=False)
  message = str(refused.value)
  assert "\n" not in message and message.startswith(f"cannot resume {str(run)!r} on changed data: data ")
  assert (
    f"now gives {corpus.train.size} training + {corpus.eval.size} held-out bytes from 1 file(s)" in message
  )
  assert f"the checkpoint of step 4 was trained on {corpus.train.size - 7} training" in message
  assert "set data.allow_changed=true to continue on the new data" in message
  assert (run / "config.json").read_text() == config_json  # nothing rewritten
  result = trainer.train(_cfg(run, text_file, "data.allow_changed=true"), progress=False)
  assert result.step == 4 and "resuming on changed data (data.allow_changed=true)" in caplog.text


def test_metrics_lines_that_do_not_parse_are_skipped_with_a_warning(tmp_path, caplog):
  # Each bad line is a kind of damage: torn, not a record, bytes that are not UTF-8 (these stopped
  # the run with "'utf-8' codec can't decode"), records without a numeric loss or an integer step
  # (KeyError / TypeError when the loss curve is plotted).
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(
    b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n\n[3]\n\xff\xfe{"step": 2, "loss": 1.0}\n{"step": 2}\n'
    b'{"step": 2, "loss": "x"}\n{"step": true, "loss": 1.0}\n{"step": 2, "loss": 1.0, "tokens_per_second": null}\n'
    b'{"step": 3, "loss": 1.0}\n{"step": 4, "loss": 0.5}\n'
  )
  kept = run_files.truncate_metrics(path, 3)
  # a null number is a non-finite one (strict JSON, run_files.json_text): read as NaN, not damage
  assert [r["step"] for r in kept] == [1, 2, 3] and math.isnan(kept[1]["tokens_per_second"])
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
  assert f"{path} line 2 is not a metrics record" in caplog.text
  assert (
    all(f"line {n} is not" in caplog.text for n in (4, 5, 6, 7, 8)) and "line 9 is not" not in caplog.text
  )


@pytest.mark.parametrize(
  "content", [b"\xf4\x8f\xff\x00garbage", b"", b"[]", b"null", b'"config"', b"3", b'{"seed": ']
)
def test_config_json_that_is_not_a_json_object_is_ignored_with_a_warning(tmp_path, content, caplog):
  # Random bytes stopped the run with "'utf-8' codec can't decode byte 0xf4" (no file named);
  # '[]' with an AttributeError traceback.
  path = tmp_path / "config.json"
  path.write_bytes(content)
  assert run_files.read_saved_config(path) is None
  assert f"ignoring {path}: it is not a valid JSON object" in caplog.text


def test_a_saved_config_that_is_not_a_mapping_is_refused_naming_its_source(tmp_path, text_file):
  cfg = _cfg(tmp_path, text_file)
  for saved in ([1, 2], "[1, 2]", None):
    with pytest.raises(ValueError, match=r"config saved in the checkpoint of step 4 is not a mapping"):
      run_checks.check_resume_config(saved, cfg, source="the checkpoint of step 4")


def test_skip_nonfinite_skips_bad_batches_up_to_its_limit_across_resumes(tmp_path, text_file, monkeypatch):
  # Batches whose first token is 255 (never in the ASCII corpus) get a NaN loss; steps 3 and 5 have them.
  real_batch, real_loss = data.train_batch, loop.next_token_loss_sum

  def train_batch(tokens, *, step, **kw):
    batch = real_batch(tokens, step=step, **kw)
    if step in (2, 4):
      batch = batch.copy()
      batch[0, 0] = 255
    return batch

  def loss(model, batch):
    total, weight = real_loss(model, batch)
    return jax.numpy.where(batch[0, 0] == 255, jax.numpy.nan, total), weight

  monkeypatch.setattr(data, "train_batch", train_batch)
  monkeypatch.setattr(loop, "next_token_loss_sum", loss)
  run = tmp_path / "run"
  cfg = _cfg(run, text_file, "num_steps=6", "skip_nonfinite=1")
  with pytest.raises(
    run_guard.NonFiniteError, match=r"step 5 \(2 non-finite steps, skip_nonfinite=1\).*step 4"
  ):
    trainer.train(cfg, progress=False)
  _, meta = _state(run, text_file, "num_steps=6")
  assert meta["step"] == 4 and meta["skipped_steps"] == 1
  trainer.train(_cfg(run, text_file, "num_steps=6", "skip_nonfinite=2"), progress=False)
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if r.get("skipped")] == [3, 5] and records[-1]["step"] == 6
  state, _ = _state(run, text_file, "num_steps=6")
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.inexact))


def _cli():
  spec = importlib.util.spec_from_file_location("train_cli", TRAIN)
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  return cli


def test_command_line_user_errors_are_one_line_and_status_2(tmp_path, capsys):
  cli = _cli()
  dup = tmp_path / "dup.yaml"
  dup.write_text("seq_len: 32\nseq_len: 64\n")
  cases = [
    # options and key=value in any order; the run then stops on the missing data, in one line
    (
      ["num_steps=3", "--data", str(tmp_path / "nope"), f"workdir={tmp_path / 'w'}"],
      r"data path '.*nope' does not exist",
    ),
    (["--config", str(dup)], rf"config file '{dup}' line 2 column 1: duplicate key 'seq_len'"),
    (["--config", str(tmp_path / "none.yaml")], r"config file '.*none.yaml' does not exist"),
    (["learning_rate=.inf"], r"learning_rate: Input should be a finite number \(got inf\)"),
    (
      ["model.vocab_size=100", "seed=x"],
      r"model.vocab_size \(100\) must be >= 256|seed: Input should be a valid integer",
    ),
    (["model.d_model=10"], r"d_model \(10\) must be divisible by num_heads"),
  ]
  for argv, message in cases:
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
  with pytest.raises(pydantic.ValidationError):
    cli.main(["--debug", "learning_rate=.inf"])


def test_command_line_reports_a_corpus_of_one_repeated_byte(tmp_path, monkeypatch, capsys):
  # Its unigram entropy is 0: the finished run crashed in the summary line (ZeroDivisionError, exit 1).
  cli = _cli()
  corpus = tmp_path / "a.txt"
  corpus.write_text("a" * 4000)
  unigram = data.unigram_bits_per_byte(np.frombuffer(corpus.read_bytes(), np.uint8))
  assert unigram == 0.0 and np.copysign(1.0, unigram) == 1.0  # not -0.0 ("-0.000" in the log)
  result = trainer.TrainResult(4, 0.1, 0.2, unigram, 1.0, 1.0, "", 4)
  monkeypatch.setattr(trainer, "train", lambda c, **kw: result)
  assert cli.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--data", str(corpus)]) == 0
  out = capsys.readouterr().out
  assert "unigram bits/byte: 0.000" in out and "ratio" not in out
