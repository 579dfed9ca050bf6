"""Smoke test of the benchmark suite (``benchmarks/run.py``): its smallest case (the ceilings of
``--quick``) writes a record, the history plots, and the README block is rewritten from the record."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_run():
  spec = importlib.util.spec_from_file_location("benchmarks_run", ROOT / "benchmarks" / "run.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_quick_smallest_case_records_plots_and_rewrites_readme(tmp_path):
  run = _load_run()
  readme = tmp_path / "README.md"
  readme.write_text(f"# x\n\n## Measured\n\nbefore\n\n{run.BEGIN}\nstale table\n{run.END}\n\nafter\n")
  results = tmp_path / "results"
  record = run.main(
    [
      "--quick",
      "--only",
      "ceiling",
      "--results-dir",
      str(results),
      "--plot",
      "--update-readme",
      "--readme",
      str(readme),
    ]
  )
  saved = [json.loads(p.read_text()) for p in results.glob("*.json")]
  assert saved == [json.loads(json.dumps(record))]
  assert record["quick"] and record["versions"]["jax"] and record["machine"]["cores"]
  names = [r["name"] for r in record["rows"]]
  assert names == ["matmul 1024^3 float32", "elementwise x*2+1 float32"]
  assert all(r["value"] > 0 for r in record["rows"])
  assert (results / "history.png").stat().st_size > 0
  text = readme.read_text()
  assert (
    "stale table" not in text
    and text.startswith("# x\n\n## Measured\n\nbefore\n\n")
    and text.endswith("after\n")
  )
  assert f"at commit `{record['commit']}`" in text
  assert text.count(run.BEGIN) == 1 and text.count(run.END) == 1
  assert "| ceiling | matmul 1024^3 float32 |" in text


def test_goal_met_reads_the_goal_on_the_ratio():
  run = _load_run()
  assert run.goal_met({"goal": ">= 0.6", "ratio": 0.61}) is True
  assert run.goal_met({"goal": ">= 0.6", "ratio": 0.59}) is False
  assert run.goal_met({"goal": "<= 1.15", "ratio": 1.2}) is False
  assert run.goal_met({"ratio": 3.0}) is None


def test_readme_has_the_generated_block():
  run = _load_run()
  text = (ROOT / "docs" / "results.md").read_text()  # the README's measurements live there (issue 48)
  assert text.count(run.BEGIN) == 1 and text.index(run.BEGIN) < text.index(run.END)


def test_records_go_outside_the_checkout_by_default(monkeypatch, tmp_path):
  run = _load_run()
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert run.default_results_dir() == tmp_path / "jaxpe" / "benchmarks"
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert ROOT not in run.default_results_dir().parents


def test_decoder_matmuls_count_the_model_flops():
  """The ceiling's matmuls of a train step: 6 FLOPs per token per kernel parameter (the parameters
  of a Decoder, embedding included: tied logits) plus causal attention, 6 L D (T + 1) per
  token (q k^T and p v over T (T + 1) / 2 pairs, forward and backward)."""
  import sys

  import jax
  from flax import nnx

  sys.path.insert(0, str(ROOT / "benchmarks"))
  import ceilings

  from jaxpe.model.config import ModelConfig
  from jaxpe.model.decoder import Decoder

  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=16, mlp_dim=48)
  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # shapes only
  kernels = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim >= 2)
  assert kernels == cfg.vocab_size * 32 + 2 * (4 * 32 * 32 + 2 * 32 * 48)  # V D + L (4 D^2 + 2 D F)
  batch, seq = 3, 16
  tokens = batch * seq
  expected = 6 * kernels * tokens + 6 * cfg.num_layers * cfg.d_model * (seq + 1) * tokens
  matmuls = ceilings.decoder_matmuls(cfg, batch, seq)
  assert abs(ceilings.useful_flops(matmuls) - expected) <= 1e-9 * expected
  forward = ceilings.decoder_matmuls(cfg, batch, seq, backward=False)
  assert abs(3 * ceilings.useful_flops(forward) - expected) <= 1e-9 * expected


def _load_check():
  import sys

  sys.path.insert(0, str(ROOT / "benchmarks"))
  spec = importlib.util.spec_from_file_location(
    "accelerator_check", ROOT / "benchmarks" / "accelerator_check.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_accelerator_check_smoke_attention_parts(tmp_path, capsys):
  """``accelerator_check.py --smoke``, parts a-c (backends x encodings vs xla, the emulation's
  measured logit deviation, attention time and memory) on CPU: a record with rows per part, the
  markdown printed, and the time budget kept (items past a part's deadline are skipped, said so)."""
  check = _load_check()
  record = check.main(["--smoke", "--parts", "a", "b", "c", "--budget", "40", "--results-dir", str(tmp_path)])
  saved = [json.loads(p.read_text()) for p in tmp_path.glob("accelerator-*.json")]
  assert len(saved) == 1 and saved[0]["parts"].keys() == {"a", "b", "c"}
  for part in ("a", "b", "c"):
    result = record["parts"][part]
    assert "error" not in result, result.get("traceback")
    assert result["rows"], result
  a = record["parts"]["a"]["rows"][0]
  assert a["backend"] == "xla" and 0 < a["max |d out|"] < 0.05  # bf16 inputs against float32 HIGHEST
  b = record["parts"]["b"]["rows"][0]
  assert b["backend"] == "xla" and b["pairs"] > 0 and b["measured max |d logit|"] <= b["resolution"]
  assert any(r["attention"] == "RoPE" and r["ms"] > 0 for r in record["parts"]["c"]["rows"])
  out = capsys.readouterr().out
  assert (
    "### a. backend x encoding vs xla" in out
    and "| dtype | encoding | form | backend | max \\|d out\\| |" in out
  )


def test_accelerator_check_smoke_train_and_bloom_parts(tmp_path):
  """``--smoke`` parts d (jaxpe's trainer step, model FLOP/s; no MFU off H100/H200) and e (a tiny
  BLOOM built from a BloomConfig, imported, logits against transformers at float32 HIGHEST)."""
  check = _load_check()
  record = check.main(["--smoke", "--parts", "d", "e", "--budget", "120", "--no-record"])
  d, e = record["parts"]["d"], record["parts"]["e"]
  assert "error" not in d and "error" not in e, (d.get("traceback"), e.get("traceback"))
  assert d["rows"] and d["rows"][0]["model TFLOP/s"] > 0 and d["rows"][0]["MFU"].startswith("-")
  forward = [r for r in e["rows"] if r["what"].startswith("forward")]
  assert forward and forward[0]["max |d logits|"] < 1e-4 * max(1.0, forward[0]["max |logits|"])


def test_accelerator_check_budget_skips_with_a_reason(tmp_path):
  check = _load_check()
  """Past the budget a part is skipped with the reason; in --smoke it still runs its first item."""
  record = check.main(["--parts", "a", "b", "--budget", "0.5", "--no-record"])
  assert record["parts"]["b"]["rows"] == [] and "no time left" in record["parts"]["b"]["skipped"][0]
  record = check.main(["--smoke", "--parts", "b", "--budget", "0.5", "--no-record"])
  assert len(record["parts"]["b"]["rows"]) == 1 and "part deadline" in record["parts"]["b"]["skipped"][0]


@pytest.mark.skipif(
  not os.path.isdir("/proc/self"), reason="needs /proc: a directory no file can be created in"
)
def test_accelerator_check_unwritable_results_dir_fails_before_any_part(monkeypatch):
  """A results dir that exists but takes no file fails at the start, not after a part has run."""
  check = _load_check()
  ran = []
  monkeypatch.setattr(check.accelerator_parts, "part_b", lambda *a: ran.append("b"))
  with pytest.raises(OSError):
    check.main(["--smoke", "--parts", "b", "--budget", "5", "--results-dir", "/proc"])
  assert ran == []


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf"])
def test_accelerator_check_refuses_a_budget_that_is_not_positive(budget, capsys):
  """``--budget 0`` ran the default 40 / 450 s and a negative one ran with no time; both are refused."""
  check = _load_check()
  with pytest.raises(SystemExit) as err:
    check.main(["--smoke", "--parts", "b", "--budget", budget, "--no-record"])
  assert err.value.code == 2 and "--budget must be a number of seconds > 0" in capsys.readouterr().err


def test_xla_cpu_flags_compiles_per_configuration_and_counts_the_thunks():
  """``benchmarks/xla_cpu_flags.py``: a configuration's ``compiler_options`` reach XLA per
  compilation (YNN off leaves plain ``dot`` thunks and no ``__ynn_fusion``), its result matches a
  float64 numpy product to float32 rounding, and its ``XLA_FLAGS`` spelling is the flags' own."""
  import sys

  import jax
  import numpy as np

  sys.path.insert(0, str(ROOT / "benchmarks"))
  import xla_cpu_flags

  assert xla_cpu_flags.xla_flags(xla_cpu_flags.CONFIGS["onednn_dot"]) == (
    "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"
  )
  assert (
    xla_cpu_flags.xla_flags(xla_cpu_flags.CONFIGS["ynn_off"]) == "--xla_cpu_experimental_ynn_fusion_type="
  )
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((64, 32), np.float32), rng.standard_normal((32, 48), np.float32)
  lowered = jax.jit(lambda x, w: jax.numpy.tanh(x @ w)).lower(x, w)
  compiled = xla_cpu_flags.compile_all(lowered, ["default", "ynn_off"])
  off = xla_cpu_flags.hlo_summary(compiled["ynn_off"].as_text())
  assert "__ynn_fusion" not in off and off.get("dot") == 1, off
  expected = np.tanh(x.astype(np.float64) @ w.astype(np.float64))
  for c in compiled.values():
    np.testing.assert_allclose(np.asarray(c(x, w)), expected, rtol=1e-5, atol=1e-6)
