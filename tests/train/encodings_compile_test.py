"""An encoding's train step compiled for TPU v5e-8 on this CPU-only host over a mesh with data, FSDP
and tensor parallelism at once (2 x 2 x 2): ``benchmarks/encodings_compile.py``'s row, whose whole
matrix (every encoding x data / fsdp / tensor / 2x2x2 x xla / auto) is recorded in
``benchmarks/results/encodings_compile.json`` and docs/accelerator.md. One row here (one layer: a compile of
seconds): RoPE with attention sinks on ``auto`` (the splash / flash kernel with per-head sink logits,
heads split over the tensor axis, the state over fsdp x tensor).

Needs libtpu; without it the module is skipped with the reason. Reference: the AdamW state's bytes
(float32 parameters, mu and nu: 12 bytes a parameter, ``memory_floor_bytes``' count), which the
per-device arguments hold at least an eighth of and, split over fsdp x tensor, less than the whole.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("libtpu") is None:
  pytest.skip(
    'libtpu is not installed (pip install "jax[tpu]==<the installed jax>")', allow_module_level=True
  )


@pytest.fixture(autouse=True)
def _libtpu_env(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # xdist workers each load libtpu


def _bench():
  spec = importlib.util.spec_from_file_location(
    "encodings_compile", ROOT / "benchmarks" / "encodings_compile.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules.setdefault("encodings_compile", module)
  spec.loader.exec_module(module)
  return module


def test_sinks_train_step_compiles_on_v5e_8_with_data_fsdp_and_tensor_parallelism():
  from jaxpe.train import config as config_lib
  from jaxpe.train.cli import resolve_config
  from jaxpe.train.memory_check import memory_floor_bytes

  bench = _bench()
  row = bench.run_row("sinks", "2x2x2", "auto", extra=("model.num_layers=1",))  # one layer: a faster compile
  assert "error" not in row, row["error"]
  assert row["fits"] and row["capacity"] == 16 * 2**30
  assert any("tpu_custom_call" in c for c in row["calls"]), row["calls"]  # the fused kernel, not xla
  params, _ = memory_floor_bytes(config_lib.load_config(resolve_config("tiny"), row["overrides"]))
  assert 12 * params / 8 <= row["arguments"] < 12 * params, (row["arguments"], params)
