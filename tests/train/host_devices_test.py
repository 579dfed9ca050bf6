"""``TrainConfig.cpu_devices`` (``jaxpe.train.host_devices``): one XLA device per core on a CPU host.

The count rule against hand-worked cases, each decision of ``apply`` (what it sets and when it sets
nothing), and the command line in fresh processes: the devices it made, the environment winning, and a
run resumed on another split."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpe.train import host_devices
from jaxpe.train.config import DistributedConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "train" / "train.py")


@pytest.mark.parametrize(
  "batch, accum, mesh, num_cores, expected",
  [
    (32, 1, (-1, 1, 1, 1), 2, 2),
    (32, 1, (-1, 1, 1, 1), 1, 1),
    (7, 1, (-1, 1, 1, 1), 2, 1),  # a prime batch: no split divides it
    (12, 1, (-1, 1, 1, 1), 8, 6),  # the largest divisor of 12 that is <= 8
    (32, 4, (-1, 1, 1, 1), 3, 2),  # micro-batch 8 rows: 3 does not divide it, 2 does
    (30, 1, (-1, 1, 1, 1), 16, 15),
    (32, 1, (2, 1, 1, 1), 8, 2),  # a mesh of fixed sizes: the devices it names, whatever the cores
    (32, 1, (2, 1, 1, 4), 2, 8),
    (32, 1, (1, 1, 1, 1), 8, 1),
    (32, 1, (-1, 2, 1, 1), 8, 8),  # a -1 with another axis fixed: the cores in multiples of it
    (32, 1, (-1, 2, 1, 1), 3, 2),
    (32, 1, (1, 1, 1, -1), 8, 8),  # context: seq_len 256 divides by 2 x 8
    (32, 1, (1, -1, 2, 1), 2, 2),  # --help's example (was 1 device: "1 devices do not divide by 2")
    (32, 1, (1, -1, 2, 1), 1, 2),  # fewer cores than the fixed sizes name: the fewest devices that fit
    (32, 1, (1, -1, 2, 1), 5, 4),  # 4 heads: tensor 2 x fsdp 2
    (32, 1, (1, 1, -1, 1), 8, 4),  # tensor over 4 heads: at most 4
  ],
)
def test_auto_count(batch, accum, mesh, num_cores, expected):
  cfg = TrainConfig(batch_size=batch, grad_accum_steps=accum, mesh_shape=mesh)
  assert host_devices.auto_count(cfg, num_cores) == expected


def _documented_mesh_commands() -> list[list[str]]:
  """The single-host ``jaxpe-train ... mesh_shape=...`` command lines of ``--help``, README.md and
  docs/*.md (multi-process lines, with ``distributed.`` keys or continued over lines, excluded)."""
  from jaxpe.train import cli

  texts = [cli.__doc__, (ROOT / "README.md").read_text()]
  texts += [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
  commands = []
  for line in "\n".join(texts).splitlines():
    line = line.split("  #")[0].strip().strip("`")
    if line.startswith("jaxpe-train ") and "mesh_shape=" in line and "distributed." not in line:
      if not line.endswith("\\"):
        commands.append(shlex.split(line)[1:])
  return commands


def test_the_documented_mesh_examples_are_found():
  commands = _documented_mesh_commands()
  assert any("mesh_shape=[1,-1,2]" in c for c in commands), commands  # --help's and scaling.md's
  assert len(commands) >= 4, commands


@pytest.mark.parametrize("num_cores", [1, 2, 4])
@pytest.mark.parametrize("argv", _documented_mesh_commands(), ids=" ".join)
def test_every_documented_mesh_example_fits_the_devices_auto_makes(argv, num_cores):
  """Each documented mesh example, on a CPU host of 1, 2 or 4 cores: the count ``cpu_devices=auto``
  makes passes the mesh check (on main, ``[1, -1, 2]`` got 1 device: "1 devices do not divide by 2")."""
  from jaxpe.train import cli, config

  args = [a for a in argv if "=" in a and not a.startswith("--")]
  name = argv[argv.index("--config") + 1] if "--config" in argv else "default"
  cfg = config.load_config(cli.resolve_config(name), args)
  count = host_devices.auto_count(cfg, num_cores)
  assert host_devices._mesh_error(cfg, count) is None


@pytest.fixture
def fresh(monkeypatch):
  """``apply`` as in a process whose backend has not started, on 4 cores; ``jax.config.update``
  recorded, not run."""
  calls = []
  monkeypatch.setattr(host_devices, "_backend_started", lambda: False)
  monkeypatch.setattr(host_devices, "cores", lambda: 4)
  monkeypatch.setattr(host_devices.jax.config, "update", lambda *a: calls.append(a))
  for name in (
    "XLA_FLAGS",
    "JAX_NUM_CPU_DEVICES",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
  ):
    monkeypatch.delenv(name, raising=False)
  return calls


def test_apply_sets_the_auto_count(fresh):
  assert host_devices.apply(TrainConfig(batch_size=32)) == 4
  assert host_devices.apply(TrainConfig(batch_size=6)) == 3
  assert fresh == [("jax_num_cpu_devices", 4), ("jax_num_cpu_devices", 3)]


@pytest.mark.parametrize(
  "env, cfg",
  [
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=1"}, {}),
    ({"JAX_NUM_CPU_DEVICES": "1"}, {}),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, {}),
    (
      {},
      {"distributed": DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1)},
    ),
    ({}, {"batch_size": 5}),  # no split of 4 cores divides 5 rows
    ({}, {"mesh_shape": (1, 1, 1, 1)}),
    ({}, {"cpu_devices": 1}),
  ],
)
def test_auto_sets_nothing_where_the_environment_or_config_chose(fresh, monkeypatch, env, cfg):
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  assert host_devices.apply(TrainConfig(**cfg)) in (None, 1)
  assert fresh in ([], [("jax_num_cpu_devices", 1)])


def test_an_explicit_count_overrides_the_environment(fresh, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  assert host_devices.apply(TrainConfig(cpu_devices=3, batch_size=6, mesh_shape=(3, 1, 1))) == 3
  assert fresh == [("jax_num_cpu_devices", 3)]


def test_after_the_backend_started_only_the_count_it_has_passes():
  import jax

  have = len(jax.devices("cpu"))  # the tests' backend has started (conftest: 8 fake devices)
  assert host_devices.apply(TrainConfig(cpu_devices=have, batch_size=have)) is None
  assert host_devices.apply(TrainConfig()) is None  # auto keeps what a library caller has
  with pytest.raises(
    ValueError, match=rf"cpu_devices={have + 1} cannot apply: .* started with {have} devices"
  ):
    host_devices.apply(TrainConfig(cpu_devices=have + 1))


def test_a_multi_process_run_compares_the_count_with_this_process_s_devices(monkeypatch):
  """``jax.devices`` lists every process's devices once a multi-process backend started (2 processes
  of 8 CPU devices: 16); ``cpu_devices`` is one process's split, so trainer.train's second ``apply``
  after jaxpe-train's first compares it with the local devices, not refuses 8 against 16."""
  import jax

  local = jax.local_devices(backend="cpu")
  monkeypatch.setattr(jax, "devices", lambda backend=None: local * 2)
  assert host_devices.apply(TrainConfig(cpu_devices=len(local))) is None
  with pytest.raises(ValueError, match=rf"started with {len(local)} devices"):
    host_devices.apply(TrainConfig(cpu_devices=2 * len(local)))


@pytest.mark.parametrize(
  "fields, mesh_words",
  [
    ({"batch_size": 12}, r"grad_accum_steps \(12\) must be divisible"),  # the default mesh's data axis
    ({"batch_size": 16, "grad_accum_steps": 4}, r"grad_accum_steps \(4\) must be divisible"),  # micro-batch
    ({"mesh_shape": (2, 1, 1, 1), "batch_size": 16}, r"does not fit 8 devices"),  # a fixed mesh
    ({"mesh_shape": (1, 1, -1, 1), "batch_size": 16}, r"num_heads \(4\) must be divisible"),  # tensor
    ({"mesh_shape": (1, 1, 1, -1), "batch_size": 16, "seq_len": 24}, r"seq_len \(24\) must be divisible"),
  ],
)
def test_an_explicit_count_the_run_cannot_use_is_named(fields, mesh_words):
  """An explicit ``cpu_devices`` whose devices the mesh or batch cannot use is refused naming
  ``cpu_devices`` (and carrying the mesh check's words), not as a bare mesh_shape problem; a count
  that fits, and ``auto``, pass. The tests' backend has 8 CPU devices (conftest)."""
  import jax

  from jaxpe.model.config import ModelConfig

  have = len(jax.devices("cpu"))
  assert have == 8
  model = ModelConfig(d_model=32, num_heads=4, num_layers=1, max_len=64)
  cfg = TrainConfig(model=model, cpu_devices=have, **fields)
  with pytest.raises(
    ValueError, match=rf"^cpu_devices={have} does not fit .*{mesh_words}.*cpu_devices=auto$"
  ):
    host_devices.check_fits(cfg)
  # auto fits where jaxpe-train chose the count; a count left by the environment is named too.
  with pytest.raises(
    ValueError, match=rf"^cpu_devices=auto left {have} CPU devices .*{mesh_words}.*set cpu_devices to"
  ):
    host_devices.check_fits(cfg.model_copy(update={"cpu_devices": "auto"}))
  host_devices.check_fits(TrainConfig(model=model, cpu_devices=have, batch_size=16))


@pytest.mark.parametrize(
  "fields, mesh_words",
  [
    ({"mesh_shape": (1, 1, 8, 1), "batch_size": 16}, r"^num_heads \(4\) must be divisible"),  # 8 heads
    ({"mesh_shape": (8, 1, 1, 1), "batch_size": 12}, r"^batch_size / grad_accum_steps \(12\) must"),
    ({"mesh_shape": (-1, 1, 8, 1), "batch_size": 16}, r"^num_heads \(4\) must be divisible"),
  ],
)
def test_a_mesh_no_count_fits_is_named_as_the_mesh_not_cpu_devices(fields, mesh_words):
  """A mesh that fails on every count (its fixed sizes alone do not divide the heads or the
  micro-batch) is the mesh check's own error: naming ``cpu_devices`` would send the user to a count
  that cannot help. The tests' backend has 8 CPU devices (conftest)."""
  from jaxpe.model.config import ModelConfig

  model = ModelConfig(d_model=32, num_heads=4, num_layers=1, max_len=64)
  with pytest.raises(ValueError, match=mesh_words):
    host_devices.check_fits(TrainConfig(model=model, cpu_devices=8, **fields))


def test_the_refusal_lists_the_counts_that_fit(monkeypatch):
  from jaxpe.model.config import ModelConfig

  monkeypatch.setattr(host_devices, "cores", lambda: 8)
  model = ModelConfig(d_model=32, num_heads=4, num_layers=1, max_len=64)
  cfg = TrainConfig(model=model, cpu_devices=8, batch_size=12)  # the default mesh, 8 devices
  with pytest.raises(ValueError, match=r"micro-batch \(12 rows\) fit: 1, 2, 3, 4, 6; or cpu_devices=auto$"):
    host_devices.check_fits(cfg)
  with pytest.raises(ValueError, match=r"fixed mesh_shape \[2, 1, 1, 1\] names: 2; or cpu_devices=auto$"):
    host_devices.check_fits(cfg.model_copy(update={"mesh_shape": (2, 1, 1, 1)}))


def test_a_multi_process_refusal_counts_per_process(monkeypatch):
  """With several processes the mesh holds every process's devices: the counts listed are per
  process, and a fixed mesh the processes cannot share equally is named as the mesh."""
  import jax

  from jaxpe.model.config import ModelConfig

  monkeypatch.setattr(host_devices, "cores", lambda: 4)
  monkeypatch.setattr(jax, "process_count", lambda: 2)  # the tests' 8 devices as 2 processes x 4
  model = ModelConfig(d_model=32, num_heads=4, num_layers=1, max_len=64)
  cfg = TrainConfig(model=model, cpu_devices=4, batch_size=12)
  with pytest.raises(
    ValueError,
    match=r"^cpu_devices=4 does not fit .*a count per process \(2 processes\) up to 4 .*fit: 1, 2, 3;",
  ):
    host_devices.check_fits(cfg)
  with pytest.raises(ValueError, match=r"names: 1; or cpu_devices=auto$"):
    host_devices.check_fits(cfg.model_copy(update={"mesh_shape": (2, 1, 1, 1)}))
  with pytest.raises(ValueError, match=r"^mesh_shape \[3, 1, 1, 1\] does not fit 8 devices"):
    host_devices.check_fits(cfg.model_copy(update={"mesh_shape": (3, 1, 1, 1)}))
  # 8 processes of one device each: no per-process count makes 12 rows divide by 8 x c, so the
  # batch, not cpu_devices, is what to change
  monkeypatch.setattr(jax, "process_count", lambda: 8)
  with pytest.raises(ValueError, match=r"^batch_size / grad_accum_steps \(12\) must be divisible"):
    host_devices.check_fits(cfg.model_copy(update={"cpu_devices": 1}))


def _env():
  """This process's environment without its device settings (``JAX_*``, ``XLA_FLAGS``), so the
  subprocess picks its own devices; the session's compilation cache (``JAX_*CACHE*``, set by
  tests/conftest.py) stays, so it loads the programs the session has compiled."""
  return {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS")) or "CACHE" in k}


def _train(workdir, *args, xla_flags=None):
  env = _env()
  env["JAX_PLATFORMS"] = "cpu"
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  argv = [sys.executable, TRAIN, "--config", "tiny", f"workdir={workdir}", "sample_len=0", "eval_every=1000"]
  proc = subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return int(re.search(r"devices: (\d+) x cpu", proc.stdout)[1])


def test_the_command_line_splits_the_cores_and_resumes_on_another_split(tmp_path):
  cfg = TrainConfig(batch_size=8)  # tiny's batch
  expected = host_devices.auto_count(cfg, host_devices.cores())
  assert _train(tmp_path / "a", "num_steps=2", "batch_size=8") == expected
  # a run saved on 1 device (the user's XLA_FLAGS count) resumes on 2: a mesh of fixed sizes gets its
  # devices on any host (it failed on one CPU device before), and the step count goes on
  run = tmp_path / "c"
  one = "--xla_force_host_platform_device_count=1"
  assert _train(run, "num_steps=4", "stop_at=2", "batch_size=8", xla_flags=one) == 1
  assert _train(run, "num_steps=4", "batch_size=8", "mesh_shape=[2,1,1]") == 2
  summary = json.loads((run / "summary.json").read_text())
  assert (summary["step"], summary["run"]["devices"]["count"]) == (4, 2)


def test_the_command_line_names_an_explicit_count_the_batch_cannot_use(tmp_path):
  env = _env()
  argv = [sys.executable, TRAIN, "--config", "tiny", f"workdir={tmp_path / 'run'}", "batch_size=8"]
  proc = subprocess.run([*argv, "cpu_devices=3"], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "cpu_devices=3 does not fit" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_memory_check_counts_the_state_once_per_cpu_device_that_replicates_it(monkeypatch):
  """The CPU devices of a split share the host's memory and each holds a replica of the state: a run
  whose state fits once but not twice is refused on 2 devices of the default mesh (naming
  cpu_devices=1), not OOM-killed, and passes on 1 device or with the state split over fsdp."""
  import jax

  from jaxpe.train import memory_check

  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  params = int(0.6 * ram) // memory_check.STATE_BYTES_PER_PARAM
  monkeypatch.setattr(
    memory_check, "memory_floor_bytes", lambda cfg: (params, params * memory_check.STATE_BYTES_PER_PARAM)
  )
  cpus = jax.devices("cpu")[:2]
  memory_check.check_fits_memory(TrainConfig(), cpus[:1])
  memory_check.check_fits_memory(TrainConfig(mesh_shape=(1, -1, 1, 1)), cpus)
  with pytest.raises(ValueError, match=r"held 2 times: .*\(cpu_devices=1 keeps one\)"):
    memory_check.check_fits_memory(TrainConfig(), cpus)


def test_the_library_trainer_refuses_an_explicit_count_it_cannot_have(tmp_path):
  """``trainer.train`` (a library caller, the study) applies an explicit ``cpu_devices`` as the command
  line does: here JAX already started with other devices, so it refuses before any work instead of
  training on devices the config did not ask for; ``auto`` keeps what the caller has."""
  import jax

  from jaxpe.train import trainer

  have = len(jax.devices("cpu"))
  cfg = TrainConfig(workdir=str(tmp_path / "run"), cpu_devices=have + 1, num_steps=1, sample_len=0)
  with pytest.raises(ValueError, match=rf"cpu_devices={have + 1} cannot apply"):
    trainer.train(cfg, progress=False)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value, applied", [("2", [2]), ("auto", [])])
def test_the_study_applies_an_explicit_count_before_jax_starts(monkeypatch, tmp_path, value, applied):
  """``jaxpe-study train.cpu_devices=N`` splits the host before its memory check starts JAX (its
  ``trainer.train`` would otherwise refuse the count); ``auto`` leaves the study on the devices it has."""
  from jaxpe.study import cli as study_cli

  calls = []

  def apply(cfg, *, auto=True):  # records what the real apply would set
    if auto or cfg.cpu_devices != "auto":
      calls.append(cfg.cpu_devices)

  monkeypatch.setattr(host_devices, "apply", apply)
  monkeypatch.setattr(study_cli.memory_check, "check_fits_memory", lambda cfg: calls.append("memory"))

  def stop(study):
    raise study_cli.StudyInterrupted("stopped")

  monkeypatch.setattr(study_cli, "run_study", stop)
  assert study_cli.main(["--quick", f"workdir={tmp_path}", f"train.cpu_devices={value}"]) == 1
  assert calls[: len(applied) + 1] == [*applied, "memory"]


def test_the_study_names_its_own_key_for_a_count_the_batch_cannot_use(tmp_path, capsys):
  """``jaxpe-study`` refuses an explicit count its batch cannot use under the key the user typed
  (``train.cpu_devices``), before any model trains or anything is written."""
  from jaxpe.study import cli as study_cli

  have = 8  # the tests' CPU devices (conftest), which apply accepts as the explicit count
  argv = ["--quick", f"workdir={tmp_path / 'study'}", f"train.cpu_devices={have}", "train.batch_size=12"]
  assert study_cli.main(argv) != 0
  err = capsys.readouterr().err
  assert f"train.cpu_devices={have} does not fit" in err and err.rstrip().endswith(
    "or train.cpu_devices=auto"
  )
  assert not (tmp_path / "study").exists()


@pytest.mark.parametrize(
  "files, expected",
  [
    (
      {"cpu.max": "100000 100000\n"},
      1,
    ),  # docker --cpus=1 on a host of more cores: 1 device, not one per core
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
    ({"cpu.max": "max 100000\n"}, None),  # no limit: the affinity mask
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
  ],
)
def test_cores_respects_a_cgroup_cpu_limit(monkeypatch, tmp_path, files, expected):
  """A container's CPU quota caps the cores ``auto`` splits into: the affinity mask there lists every
  host core, and 16 devices on 2 CPUs of time run the tiny step ~2.7x slower than 2 devices."""
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  monkeypatch.setattr(host_devices, "_CGROUP", tmp_path)
  monkeypatch.setattr(host_devices.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
  assert host_devices.cores() == (64 if expected is None else expected)
