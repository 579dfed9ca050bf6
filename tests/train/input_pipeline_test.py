"""The grain input pipeline (``data.loader=grain``, issue 46): the default loader's batches bit for bit,
each process's rows disjoint, its iterator state saved with each checkpoint and resumed exactly."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpe.train import checkpoint, data, input_pipeline, packing, sharding, trainer
from jaxpe.train.config import load_config

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _make(corpus, strategy=None):
  if strategy is None:
    return lambda *, step, rows: data.train_batch(
      corpus.train, step=step, seed=3, batch_size=8, seq_len=16, rows=rows
    )
  packed = packing.make_train_batch(corpus, strategy, 16)
  return lambda *, step, rows: packed(step=step, seed=3, batch_size=8, seq_len=16, rows=rows)


@pytest.mark.parametrize("strategy", [None, "first_fit"])
def test_grain_gives_the_default_batches_per_process_and_resumes_from_its_state(text_file, strategy):
  corpus = data.load_corpus(text_file, max_bytes=30_000, eval_fraction=0.1)
  make = _make(corpus, strategy)
  halves = (slice(0, 4), slice(4, 8))  # two processes' rows of the global batch
  pipes = [input_pipeline.GrainBatches(make, rows, state=None, start=0, workers=2) for rows in halves]
  for step in range(5):
    got = [p.next(step) for p in pipes]
    np.testing.assert_array_equal(
      np.concatenate(got), make(step=step, rows=slice(None))
    )  # the default loader's
  state = pipes[0].state()
  assert state["next_index"] == 5
  again = input_pipeline.GrainBatches(
    make, halves[0], state=json.loads(json.dumps(state)), start=5, workers=1
  )
  np.testing.assert_array_equal(again.next(5), pipes[0].next(5))
  with pytest.raises(ValueError, match="not at the checkpoint's step 6"):
    input_pipeline.GrainBatches(make, halves[0], state=state, start=6, workers=1)
  with pytest.raises(RuntimeError, match="at step 6, the run at 5"):
    again.next(5)


def _cfg(tmp_path, text_file, workdir, *extra):
  return load_config(
    None,
    [
      f"workdir={tmp_path / workdir}",
      f"data.path={text_file}",
      "seq_len=16",
      "batch_size=8",
      "num_steps=6",
      "warmup_steps=2",
      "eval_every=6",
      "eval_batches=1",
      "checkpoint_every=2",
      "keep_checkpoints=2",
      "sample_len=0",
      "model.d_model=32",
      "model.num_layers=1",
      "model.num_heads=4",
      "model.max_len=32",
      *extra,
    ],
  )


def _params(cfg):
  mesh = sharding.make_mesh((-1, 1))
  _, state, shardings = trainer.create_state(cfg, mesh)
  mngr = checkpoint.manager(Path(cfg.workdir) / "checkpoints")
  restored, meta = checkpoint.restore_latest(mngr, checkpoint.abstract_with_shardings(state, shardings))
  mngr.close()
  return jax.tree.map(np.asarray, restored), meta


def test_a_grain_run_resumes_as_the_default_loader_runs(tmp_path, text_file):
  default = _cfg(tmp_path, text_file, "numpy")
  trainer.train(default, progress=False)
  trainer.train(_cfg(tmp_path, text_file, "grain", "data.loader=grain", "stop_at=3"), progress=False)
  states = sorted(p.name for p in (tmp_path / "grain" / "data_state").iterdir())
  assert states == ["2.process0.json", "3.process0.json"]  # the kept checkpoints' (2 and 3)
  assert json.loads((tmp_path / "grain" / "data_state" / "3.process0.json").read_text()) == {"next_index": 3}
  resumed = _cfg(tmp_path, text_file, "grain", "data.loader=grain")
  trainer.train(resumed, progress=False)
  (a, _), (b, meta) = _params(default), _params(resumed)
  assert meta["step"] == 6
  jax.tree.map(np.testing.assert_array_equal, a, b)  # the same batches, resumed from the grain state
  # the kept checkpoints' states (4, 6), and at most one older (pruned at the next save)
  names = {p.name for p in (tmp_path / "grain" / "data_state").iterdir()}
  assert (
    {"4.process0.json", "6.process0.json"}
    <= names
    <= {"3.process0.json", "4.process0.json", "6.process0.json"}
  )


def test_two_processes_read_disjoint_rows_and_train_as_one_process(tmp_path, text_file):
  run = [f"data.path={text_file}", "seq_len=16", "batch_size=8", "num_steps=2", "warmup_steps=1"]
  run += ["eval_every=100", "eval_batches=1", "checkpoint_every=100", "sample_len=0", "model.d_model=16"]
  run += ["model.num_layers=1", "model.num_heads=2", "model.max_len=16"]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  specs = [
    {
      "port": port,
      "process_id": i,
      "overrides": [*run, f"workdir={tmp_path / 'two'}", "mesh_shape=[4, 1, 1]", "data.loader=grain"],
      "dump": str(tmp_path / f"p{i}.npz"),
    }
    for i in range(2)
  ]
  worker = str(Path(__file__).with_name("grain_two_process_worker.py"))
  procs = [
    subprocess.Popen(
      [sys.executable, worker, json.dumps(spec)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for spec in specs
  ]
  one = load_config(None, [*run, f"workdir={tmp_path / 'one'}", "mesh_shape=[-1, 1, 1]"])
  trainer.train(one, progress=False)  # one process, the default loader
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
  dumps = [dict(np.load(tmp_path / f"p{i}.npz")) for i in range(2)]
  (a0, a1), (b0, b1) = dumps[0]["rows"], dumps[1]["rows"]
  assert sorted([(a0, a1), (b0, b1)]) == [(0, 4), (4, 8)]  # disjoint, together the global batch
  corpus = data.load_corpus(text_file, max_bytes=one.data.max_bytes, eval_fraction=one.data.eval_fraction)
  for d in dumps:
    for step in (0, 1):
      want = data.train_batch(corpus.train, step=step, seed=0, batch_size=8, seq_len=16)[slice(*d["rows"])]
      np.testing.assert_array_equal(d[f"step{step}"], want)
  losses = [
    [json.loads(line)["loss"] for line in (tmp_path / w / "metrics.jsonl").read_text().splitlines()]
    for w in ("one", "two")
  ]
  np.testing.assert_allclose(losses[1], losses[0], rtol=0, atol=1e-5)


def test_a_grain_run_killed_inside_a_save_resumes_bit_identically(tmp_path, text_file):
  args = [f"data.path={text_file}", "seq_len=16", "batch_size=8", "num_steps=8", "warmup_steps=1"]
  args += ["eval_every=100", "eval_batches=1", "sample_len=0", "model.d_model=16", "model.num_layers=1"]
  args += ["model.num_heads=2", "model.max_len=16", "data.loader=grain", "checkpoint_every=1"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  train_py = str(Path(__file__).resolve().parents[2] / "train" / "train.py")

  def start(workdir, *extra):  # train/train.py, as the fault tests run it (one device)
    cmd = [sys.executable, train_py, f"workdir={workdir}", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  reference = start(tmp_path / "ref", *args[:-2], "checkpoint_every=8")  # uninterrupted, the default loader
  run = tmp_path / "run"
  proc = start(run, *args)
  ckpts, metrics = run / "checkpoints", run / "metrics.jsonl"

  def steps_done():
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0

  while not (steps_done() >= 3 and any(".orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir())):
    assert proc.poll() is None, proc.communicate()
  proc.kill()  # SIGKILL inside a checkpoint save
  proc.wait()
  resumed = start(run, *args)
  for p in (resumed, reference):
    assert p.wait(timeout=600) == 0, p.communicate()[1][-3000:]
  (a, _), (b, meta) = (_params(load_config(None, [f"workdir={w}", *args])) for w in (tmp_path / "ref", run))
  assert meta["step"] == 8
  jax.tree.map(np.testing.assert_array_equal, a, b)
