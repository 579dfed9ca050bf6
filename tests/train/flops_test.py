"""Model FLOPs and the MFU peak (``jaxpe.train.flops``): the per-token count against
``benchmarks/ceilings.py``'s independent sum over a step's matmuls, the peak table by device kind,
and the CPU ceiling's measurement."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import jax
import pytest

from jaxpe.model.config import ModelConfig
from jaxpe.train import flops

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as tests/benchmarks_test.py
ceilings = importlib.import_module("ceilings")


@pytest.mark.parametrize(
  "fields, seq",
  [
    ({}, 256),
    ({"d_model": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2, "vocab_size": 300}, 64),
    ({"d_model": 48, "num_heads": 3, "head_dim": 8, "mlp_dim": 100, "num_layers": 3}, 7),
    ({"pos_encoding": "rope_alibi", "use_bias": True, "rope_alibi_in_projection": True}, 128),
    # issue 48, kind 6d: every encoding's matmuls (FIRE's MLP, CoPE's q @ pos_emb, rope_alibi's 2k dims)
    ({"pos_encoding": "fire"}, 256),
    ({"pos_encoding": "fire", "fire_mlp_width": 16, "num_heads": 8}, 33),
    ({"pos_encoding": "cope"}, 128),
    ({"pos_encoding": "cope", "cope_npos_max": 40}, 64),
    ({"pos_encoding": "rope_alibi", "rope_alibi_order": 2}, 128),
  ],
)
def test_flops_per_token_match_the_benchmarks_matmul_count(fields, seq):
  cfg = ModelConfig(**fields)
  batch = 3
  expected = ceilings.useful_flops(ceilings.decoder_matmuls(cfg, batch, seq)) / (batch * seq)
  assert flops.train_flops_per_token(cfg, seq) == pytest.approx(expected, rel=1e-12)
  with pytest.raises(ValueError, match="seq_len"):
    flops.train_flops_per_token(cfg, 0)


def _device(platform, kind):
  return types.SimpleNamespace(platform=platform, device_kind=kind)


def test_the_peak_of_known_accelerators_and_none_for_others():
  cfg = ModelConfig()
  peak, source = flops.peak_flops([_device("gpu", "NVIDIA H200")] * 2, cfg, 64, processes=2)
  assert peak == 4 * 989e12 and "4 x NVIDIA H200's bfloat16 peak, 3,956 TFLOP/s" == source
  assert flops.peak_flops([_device("tpu", "TPU v5 lite")], cfg, 64)[0] == 197e12
  assert flops.peak_flops([_device("tpu", "TPU v5p")], cfg, 64)[0] == 459e12
  assert flops.peak_flops([_device("gpu", "Some GPU")], cfg, 64) == (
    None,
    "no peak known for 'Some GPU' (model FLOP/s only)",
  )


def test_the_cpu_ceiling_is_measured_on_the_devices():
  devices = jax.devices("cpu")[:2]
  peak, source = flops.peak_flops(devices, ModelConfig(d_model=32, num_heads=4), 64)
  assert 1e7 < peak < 1e14 and source.startswith("the float32 matmul ceiling measured on 2 CPU devices")
  with pytest.raises(ValueError, match="rows, d and f"):
    flops.measure_cpu_ceiling(devices, 0, 4, 4)


def test_fires_mlp_is_counted_per_causal_pair():
  # An independent reading of FIRE's MLP (arXiv 2310.04418): Linear(1, F) and Linear(F, N) on each of
  # the T (T + 1) / 2 causal pairs of a sequence, forward and backward (x 3), per token.
  cfg, seq = ModelConfig(pos_encoding="fire"), 256
  base = flops.train_flops_per_token(cfg.model_copy(update={"pos_encoding": "rope"}), seq)
  f, n = cfg.fire_mlp_width, cfg.num_heads
  mlp = 3 * cfg.num_layers * 2 * (f + f * n) * seq * (seq + 1) / 2 / seq
  assert flops.train_flops_per_token(cfg, seq) == pytest.approx(base + mlp, rel=1e-12)
  assert mlp / base == pytest.approx(0.0865, abs=1e-4)  # +8.6 % at the default model and T = 256
