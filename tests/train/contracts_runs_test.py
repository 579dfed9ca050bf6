"""Runs that are one run (issue 17): the processes of a multi-process run agree on the config, the
data and the workdir or refuse within seconds; distributed settings that cannot form a job are
refused before anything starts; a signal to one process stops all; a resume on changed data is
refused. Two-process cases run ``train/train.py`` twice on 127.0.0.1 (1 fake CPU device each), each
under a hang guard that kills its process group."""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpe.train import data, loop, run_guard, sharding
from jaxpe.train.config import DistributedConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "train" / "train.py")
HANG_GUARD_S = 240  # generous: only against hangs; a refusal takes seconds


pytestmark = pytest.mark.usefixtures("standard_promotion")


# --- distributed settings that cannot form a job: refused before jax.distributed starts --------

BAD_DISTRIBUTED = [
  # (settings, regex of the one-line message)
  ({"num_processes": 2, "process_id": 1}, r"needs distributed\.coordinator_address"),
  ({"num_processes": 2}, r"needs distributed\.coordinator_address .* and distributed\.process_id"),
  (
    {"coordinator_address": "127.0.0.1:1234"},
    r"needs distributed\.num_processes .* and distributed\.process_id",
  ),
  ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2}, r"needs distributed\.process_id"),
  (
    {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2},
    r"process_id \(2\) must be in 0\.\.1 \(distributed\.num_processes=2\)",
  ),
  (
    {"coordinator_address": "127.0.0.1", "num_processes": 2, "process_id": 0},
    r"coordinator_address must be host:port.*'127\.0\.0\.1'",
  ),
  (
    {"coordinator_address": "host:99999", "num_processes": 2, "process_id": 0},
    r"coordinator_address must be host:port \(port 1-65535\)",
  ),
  (
    {"coordinator_address": ":80", "num_processes": 2, "process_id": 0},
    r"coordinator_address must be host:port",
  ),
  ({"enabled": False, "num_processes": 2}, r"distributed\.enabled=false contradicts"),
  ({"enabled": True, "num_processes": 2, "process_id": 0}, r"needs distributed\.coordinator_address"),
]


@pytest.mark.parametrize(
  "settings, message", BAD_DISTRIBUTED, ids=[json.dumps(s) for s, _ in BAD_DISTRIBUTED]
)
def test_distributed_settings_that_cannot_form_a_job_are_refused_at_once(settings, message, monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(ValueError, match=message):
    sharding.initialize_distributed(DistributedConfig(**settings))
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
  "env, message",
  [
    ({"JAX_NUM_PROCESSES": "two"}, r"JAX_NUM_PROCESSES='two' is not an integer"),
    # int() reads non-ASCII digits and underscores: '\u0662' (Arabic-Indic 2) was a 2-process job
    ({"JAX_NUM_PROCESSES": "\u0662", "JAX_PROCESS_ID": "0"}, r"JAX_NUM_PROCESSES='\u0662' is not an integer"),
    ({"JAX_NUM_PROCESSES": "1_0", "JAX_PROCESS_ID": "0"}, r"JAX_NUM_PROCESSES='1_0' is not an integer"),
    (
      {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:\u00b2", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
      r"coordinator_address must be host:port",  # '²'.isdigit(), then int('²'): a raw 'invalid literal'
    ),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, r"needs distributed\.coordinator_address"),
    (
      {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_PROCESS_ID": "0"},
      r"needs distributed\.num_processes",
    ),
  ],
)
def test_distributed_settings_from_the_environment_are_checked_alike(env, message, monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=message):
    sharding.initialize_distributed(DistributedConfig())


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("initialization_timeout", 0, "greater than 0"),
    ("initialization_timeout", -5, "greater than 0"),
    ("initialization_timeout", 10**9, "less than or equal to 86400"),
    ("initialization_timeout", "soon", "valid integer"),
    ("num_processes", 0, "greater than 0"),
    ("process_id", -1, "greater than or equal to 0"),
    ("distributed.cpu_collectives", "nccl", "'gloo' or 'mpi'"),
    ("distributed.coordinator_address", "[1, 2]", "valid string"),
    ("data.allow_changed", "maybe", "valid boolean"),
    ("data.allow_changed", "[]", "valid boolean"),
  ],
)
def test_run_config_values_out_of_range_are_refused(key, value, message):
  with pytest.raises(ValueError, match=message):
    load_config(
      None, [f"{key}={value}" if key.startswith(("data.", "distributed.")) else f"distributed.{key}={value}"]
    )


# --- the data fingerprint -------------------------------------------------------------------


def _fp(path, **kw):
  kw = {"max_bytes": 10**6, "eval_fraction": 0.1, **kw}
  return data.fingerprint(data.load_corpus(str(path), **kw))


def test_data_fingerprint_changes_with_the_bytes_and_files_not_with_the_path(tmp_path):
  text = b"".join(b"line %d of some text\n" % i for i in range(400))
  one = tmp_path / "a" / "corpus.txt"
  one.parent.mkdir()
  one.write_bytes(text)
  base = _fp(one)
  assert base["sha256"] == _fp(one)["sha256"] and base["files"] == 1
  assert base["train_bytes"] + base["eval_bytes"] == len(text)
  # Reference: the SHA-256 of what the definition says, computed independently here.
  cut = int(len(text) * 0.9)
  h = hashlib.sha256()  # per side: the count of files read, then each one's relative path and bytes read
  for n in (cut, len(text) - cut):
    h.update((1).to_bytes(8, "little") + b"corpus.txt\0" + n.to_bytes(8, "little"))
  for side in (text[:cut], text[cut:]):
    h.update(len(side).to_bytes(8, "little") + side)
  assert base["sha256"] == h.hexdigest()
  moved = tmp_path / "b" / "corpus.txt"  # the same bytes under another path (another mount point)
  moved.parent.mkdir()
  moved.write_bytes(text)
  assert _fp(moved)["sha256"] == base["sha256"]
  one.write_bytes(b"x" * 50_000 + text)  # prepended text
  assert _fp(one)["sha256"] != base["sha256"]
  one.write_bytes(text[:-1] + b"?")  # one byte changed (held out side)
  assert _fp(one)["sha256"] != base["sha256"]
  one.write_bytes(text)
  assert _fp(one, max_bytes=len(text) - 1)["sha256"] != base["sha256"]  # fewer bytes used
  # A directory: adding a file changes the file list (and the bytes).
  (tmp_path / "b" / "more.txt").write_bytes(text)
  two = _fp(tmp_path / "b")
  (tmp_path / "b" / "third.md").write_bytes(b"# notes\n" * 100)
  assert _fp(tmp_path / "b")["sha256"] != two["sha256"] and _fp(tmp_path / "b")["files"] == 3


# --- signals: a stop requested by any process stops all, each keeping its own signal -----------


@pytest.mark.parametrize(
  "mine, gathered, stops, signum, origin",
  [
    (None, [0, 0], False, None, None),
    (None, [0, signal.SIGTERM], True, signal.SIGTERM, 1),
    (signal.SIGINT, [signal.SIGINT, signal.SIGTERM], True, signal.SIGINT, None),  # keeps its own
    (signal.SIGTERM, [0, 0], False, signal.SIGTERM, None),  # arrived during the gather: next check
    (None, [signal.SIGINT, signal.SIGTERM], True, signal.SIGINT, 0),
  ],
)
def test_agree_on_stop_never_loses_or_overwrites_a_signal(monkeypatch, mine, gathered, stops, signum, origin):
  stop = run_guard.StopRequest()
  stop.signum = mine
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(loop.multihost_utils, "process_allgather", lambda x: np.asarray(gathered, np.int32))
  assert loop.agree_on_stop(stop) is stops
  assert stop.signum == signum and stop.from_process == origin


# --- two processes that do not agree ------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


FAST = [
  "seq_len=16",
  "batch_size=4",
  "num_steps=4",
  "eval_batches=1",
  "sample_len=0",
  "model.d_model=16",
  "model.num_layers=1",
  "model.num_heads=2",
  "model.max_len=16",
  "distributed.num_processes=2",
  # generous for a loaded 2-core machine, where the two processes may reach the coordinator far
  # apart; only a run that fails to form waits it out (issue 39)
  "distributed.initialization_timeout=60",
]


def _last_wins(args):
  """``args`` with each ``key=value`` override given once, the last one (the command lines refuse repeats)."""
  key = lambda a: a.split("=")[0] if "=" in a and not a.startswith("-") else None  # noqa: E731
  return [a for i, a in enumerate(args) if key(a) is None or key(a) not in map(key, args[i + 1 :])]


def _run_processes(argvs, while_running=None):
  """Starts ``train.py`` once per argv (1 CPU device each), calls ``while_running(procs)`` if
  given, and returns ``(status, stderr)`` of each; a process group still alive after HANG_GUARD_S
  seconds is killed and the test fails."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(name, None)
  procs = [
    subprocess.Popen(
      [sys.executable, TRAIN, "--config", str(ROOT / "configs" / "tiny.yaml"), *_last_wins(argv)],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
      start_new_session=True,
    )
    for argv in argvs
  ]
  results = []
  try:
    if while_running is not None:
      while_running(procs)
    for p in procs:
      _, err = p.communicate(timeout=HANG_GUARD_S)
      results.append((p.returncode, err))
  except subprocess.TimeoutExpired:
    pytest.fail(f"a process hung past {HANG_GUARD_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  return results


def _errors(results):
  return [err.strip().splitlines()[-1] if err.strip() else "" for _, err in results]


@pytest.mark.parametrize(
  "differs, message",
  [
    (
      [[], ["seed=1", "num_steps=5"]],
      r"the processes of this run disagree on num_steps, seed \(process [01] has num_steps=[45], seed=[01]; "
      r"processes \[[01]\] differ\): start every process with the same config",
    ),
    ([[], ["workdir={tmp}/other"]], r"workdir '.*' is not shared: process\(es\) \[1\] do not see the file"),
  ],
  ids=["seed-and-num_steps", "workdir-not-shared"],
)
def test_two_processes_that_disagree_refuse_at_once_naming_the_key(tmp_path, text_file, differs, message):
  port = _free_port()
  argvs = [
    [
      *FAST,
      f"data.path={text_file}",
      f"workdir={tmp_path / 'run'}",
      f"distributed.coordinator_address=127.0.0.1:{port}",
      f"distributed.process_id={i}",
      *(d.format(tmp=tmp_path) for d in differs[i]),
    ]
    for i in range(2)
  ]
  results = _run_processes(argvs)
  for (status, err), line in zip(results, _errors(results)):
    assert status == 2 and line.startswith("train.py: error: "), err[-2000:]
    assert re.search(message, line), line
  assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "config.json").exists()


def test_a_second_process_0_or_a_missing_peer_fail_in_seconds(tmp_path, text_file):
  # A second process with process_id=0 finds the coordinator's port taken (here held by the test,
  # as the first process 0's coordinator service holds it) and is refused at once; a process 0
  # whose peer never comes gives up after distributed.initialization_timeout seconds (3 here),
  # naming what is missing, instead of JAX's abort blaming "another task" after 300 s.
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    free = _free_port()
    argvs = [
      [
        *FAST,
        "distributed.initialization_timeout=3",
        f"data.path={text_file}",
        f"workdir={tmp_path / name}",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.process_id=0",
      ]
      for name, port in (("a", busy), ("b", free))
    ]
    results = _run_processes(argvs)
  lines = _errors(results)
  assert [s for s, _ in results] == [2, 2], results
  assert re.search(
    rf"train.py: error: distributed.coordinator_address '127.0.0.1:{busy}': port {busy} is already in use "
    r"\(another process with distributed\.process_id=0",
    lines[0],
  ), lines
  assert re.search(
    rf"train.py: error: process 0 of 2 could not form the job with the coordinator 127\.0\.0\.1:{free} within "
    r"distributed\.initialization_timeout=3 s: start all 2 processes",
    lines[1],
  ), lines


def test_a_signal_to_one_process_stops_both_after_the_same_step(tmp_path, text_file):
  # Issue 17: _agree_on_stop overwrote stop.signum with the gathered value, so a SIGTERM arriving
  # during the gather was lost ("stopping after this step", then both trained to the end).
  port, run = _free_port(), tmp_path / "run"
  argvs = [
    [
      *FAST,
      "num_steps=100000",
      "checkpoint_every=100000",
      f"data.path={text_file}",
      f"workdir={run}",
      f"distributed.coordinator_address=127.0.0.1:{port}",
      f"distributed.process_id={i}",
    ]
    for i in range(2)
  ]

  def signal_process_1(procs):
    end = time.monotonic() + HANG_GUARD_S
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
      assert all(p.poll() is None for p in procs) and time.monotonic() < end, "the run did not start"
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)

  results = _run_processes(argvs, while_running=signal_process_1)
  lines = _errors(results)
  assert [s for s, _ in results] == [143, 143], results
  last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
  assert lines[0] == (
    f"train.py: stopped by SIGTERM (received by process 1) at step {last}; checkpoint saved in "
    f"{run / 'checkpoints'}: rerun the same command to resume"
  )
  assert lines[1].startswith(f"train.py: stopped by SIGTERM at step {last};")
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(last)]


_LATE_PEER = """
import runpy, sys, time
import jax
from jaxpe.train import run_checks
check = run_checks.check_shared_workdir
def late(workdir):
  try:
    check(workdir)
  except ValueError:
    if jax.process_index() == 1:
      time.sleep(3)  # a loaded machine: process 1 reports its refusal seconds after process 0
    raise
run_checks.check_shared_workdir = late
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_peer_that_reports_a_refusal_late_is_not_aborted_by_process_0_leaving(tmp_path, text_file):
  # main (issue 39): process 0 exited at once and took the coordination service with it; process 1,
  # 3 s behind, died of JAX's fatal "coordination service" error (SIGABRT, a gRPC report) instead of
  # printing its line. Now all processes of a refusal leave the job together (run_guard.JobRefused).
  wrapper = tmp_path / "late_peer.py"
  wrapper.write_text(_LATE_PEER)
  port = _free_port()
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(name, None)
  procs = [
    subprocess.Popen(
      [sys.executable, str(wrapper), TRAIN, "--config", str(ROOT / "configs" / "tiny.yaml")]
      + _last_wins(
        [
          *FAST,
          f"data.path={text_file}",
          f"workdir={tmp_path / ('run' if i == 0 else 'other')}",
          f"distributed.coordinator_address=127.0.0.1:{port}",
          f"distributed.process_id={i}",
        ]
      ),
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
      start_new_session=True,
    )
    for i in range(2)
  ]
  try:
    results = [(p.communicate(timeout=HANG_GUARD_S)[1], p.returncode) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  for err, status in results:
    line = err.strip().splitlines()[-1] if err.strip() else ""
    assert status == 2 and re.search(r"train.py: error: workdir '.*' is not shared", line), (
      status,
      err[-2000:],
    )
