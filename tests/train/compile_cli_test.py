"""``jaxpe-compile`` (``jaxpe.train.compile_cli``, ``jaxpe.train.aot``, ``jaxpe.train.targets``):
the run's real train step and generation compiled for a TPU target on this CPU-only host.

Needs libtpu (the test extra installs it); without it the compiling tests are skipped with the
reason, and the command's own refusal (the missing compiler named) is tested instead. Issue 45:
nothing told a user whether a config fits a chip before this command.

References: the float32 logits of a step's micro-batch (``B/devices x T x V x 4`` bytes, each with its
gradient) and the state's bytes (parameters from ``memory_check.memory_floor_bytes``' own count, with
AdamW's two moments) are closed forms the compiler's sizes must exceed.
"""

from __future__ import annotations

import importlib.util
import json
import re

import jax
import pytest

from jaxpe.train import compile_cli, targets
from jaxpe.train import config as config_lib
from jaxpe.train.cli import resolve_config
from jaxpe.train.memory_check import memory_floor_bytes

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
  not HAS_LIBTPU, reason='libtpu is not installed (pip install "jax[tpu]==<the installed jax>")'
)
GiB = 2**30


@pytest.fixture(autouse=True)
def _libtpu_env(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # xdist workers each load libtpu


def _run(argv, capsys):
  with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 steps
    code = compile_cli.main(argv)
  out = capsys.readouterr()
  return code, out.out, out.err


def _gib(text: str, label: str) -> float:
  """The size after ``label`` in the report, in GiB."""
  value, unit = re.search(rf"{label}\s+-?([\d,.]+) (GiB|MiB)", text).groups()
  return float(value.replace(",", "")) / (1 if unit == "GiB" else 1024)


@needs_libtpu
def test_refuses_a_tiny_model_with_a_huge_batch_on_v5e_8_naming_the_sizes(capsys):
  args = ["batch_size=65536", "seq_len=2048", "model.max_len=2048"]
  code, out, err = _run(["--config", "tiny", "--target", "v5e-8", "--no-generate", *args], capsys)
  assert code == 1, err
  assert "DOES NOT FIT" in out
  needed = _gib(out, "needed")
  # each device's 8192 rows x 2048 positions x 256 byte ids of float32 logits: 16 GiB, and their gradient
  assert needed >= 2 * 65536 // 8 * 2048 * 256 * 4 / GiB
  assert re.search(r"does not fit v5e-8: train step needs [\d,.]+ GiB per device of 15\.75 GiB", err)


@needs_libtpu
def test_the_default_config_fits_a_small_tpu_target(capsys, tmp_path):
  """The built-in default config (one layer and short sequences, so the compile takes seconds) on
  v5e-4: train step and generation compile, fit, and hold at least the state's bytes."""
  overrides = ["model.num_layers=1", "seq_len=64", "batch_size=8", "sample_len=8"]
  code, out, err = _run(["--target", "v5e-4", "--json", str(tmp_path / "r.json"), *overrides], capsys)
  assert code == 0, err
  assert "mesh (data, fsdp, tensor, context): [4, 1, 1, 1] over 4 devices" in out
  assert out.count(": fits") == 2 and "DOES NOT FIT" not in out
  report = json.loads((tmp_path / "r.json").read_text())
  step, gen = report["programs"]
  assert (step["name"], gen["name"]) == ("train step", "generate")
  cfg = config_lib.load_config(resolve_config("default"), overrides)
  params, _ = memory_floor_bytes(cfg)
  # the data-parallel state is replicated: float32 parameters and AdamW's mu and nu on every device
  assert step["arguments"] >= 12 * params
  assert step["aliased"] >= 12 * params  # the donated state is updated in place
  assert gen["arguments"] >= 4 * params  # generation reads the float32 parameters
  assert step["capacity"] == 16 * GiB and step["fits"] and gen["fits"]
  assert step["model_flops"] > 0 and 0 < step["mfu"] <= 1


@needs_libtpu
@pytest.mark.parametrize("name", sorted(n for n, t in targets.TARGETS.items() if t.spec.platform == "tpu"))
def test_every_tpu_target_builds_its_compile_only_devices(name):
  t = targets.TARGETS[name]
  devices = targets.compile_devices(t)
  per_chip = 2 if t.chip in ("v4", "v5p") and len(devices) == 2 * t.chips else 1  # two TensorCores
  assert len(devices) == per_chip * t.chips
  assert {d.platform for d in devices} == {"tpu"}
  assert targets.device_memory(t, devices) * len(devices) == t.spec.hbm_bytes * t.chips
  hosts = {d.process_index for d in devices}
  assert len(hosts) >= t.chips // 4  # several hosts' worth: the devices of every host of the slice


def test_a_missing_compiler_is_named_with_the_pip_command(capsys, monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda n, *a: None if n in ("libtpu", "jax_cuda12_plugin") else real(n, *a)
  )
  code, _, err = _run(["--config", "tiny", "--target", "v6e-8"], capsys)
  assert code == 2 and 'pip install "jax[tpu]==' in err and "libtpu" in err
  code, _, err = _run(["--config", "tiny", "--target", "h100"], capsys)
  assert code == 2 and 'pip install "jaxpe[gpu-compile]"' in err


def test_an_unknown_target_is_refused_naming_the_known_ones(capsys):
  code, _, err = _run(["--config", "tiny", "--target", "v9-8"], capsys)
  assert code == 2 and "--target must be one of" in err and "v5e-8" in err and "h100" in err


def test_help_names_the_targets_and_the_extras(capsys):
  with pytest.raises(SystemExit):
    compile_cli.main(["--help"])
  text = capsys.readouterr().out
  for word in ("v5e-8", "v6e-4", "v5p-8", "v4-8", "h100", "h200", "a100", "gpu-compile", "jax[tpu]"):
    assert word in text
