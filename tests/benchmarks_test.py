"""Smoke test of the benchmark suite (``benchmarks/run.py``): its smallest case (the ceilings of
``--quick``) writes a record, the history plots, and the README block is rewritten from the record."""

import importlib.util
import json
from pathlib import Path

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
  text = (ROOT / "README.md").read_text()
  assert text.count(run.BEGIN) == 1 and text.index(run.BEGIN) < text.index(run.END)
