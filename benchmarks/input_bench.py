"""How long the train loop waits for its next batch, against the step time (issue 46: with grain
workers, input time per step under 5% of the step time on the default run).

  python benchmarks/input_bench.py [--config default] [--steps 40] [--tokens PATH]
      [--workdir runs/input_bench] [--out benchmarks/results/input_bench_default.json] [key=value ...]

Runs the config (the built-in ``default``: the run ``jaxpe-train`` makes) for ``--steps`` steps of
its schedule (``stop_at``; ``max_seconds=null``, no evaluation before the end, no sample) on two
inputs, each with ``data.loader=grain`` (``data.grain_workers`` prefetching threads) and, as the
reference in the same process, the default ``numpy`` loader (each batch made when the step asks):

* ``text``: the built-in corpus (the standard library's sources, byte windows);
* ``tokens_first_fit``: a token file packed with ``data.packing=first_fit``: ``--tokens PATH`` (with
  its ``model.vocab_size`` given as an override), or by default the same standard-library files as
  a ``uint16`` token file of their bytes with an end-of-document id 256 after each file
  (``model.vocab_size=257``: the default model's step, the packing's own work).

Per run it reads ``metrics.jsonl``: ``data_seconds`` (the loop's wait for the step's batch: made, or
taken from grain's prefetch, and placed on the devices) and ``step_seconds``, the first step
(compilation, grain's first batch) excluded, and reports the share ``sum(data) / sum(step)``
(the goal: under 0.05 with grain), the median per-step share and the median seconds of each.
The record is written to ``--out`` (JSON) after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax
import numpy as np

from jaxpe.train import data, run_files, trainer
from jaxpe.train.cli import resolve_config
from jaxpe.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.05
"""The input wait's share of the step time that grain must stay under (issue 46)."""


def stdlib_token_file(out: Path, max_bytes: int) -> Path:
  """``out/tokens.bin``: the standard library's ``.py`` files (``data.stdlib_files``, in order, up
  to ``max_bytes`` bytes), each file's bytes as ``uint16`` ids followed by the end-of-document id
  256, with the sidecar ``tokens.bin.json`` (``dtype``, ``vocab_size`` 257, ``eot_token`` 256)."""
  path = out / "tokens.bin"
  if path.is_file():
    return path
  out.mkdir(parents=True, exist_ok=True)
  parts, total = [], 0
  for f in data.stdlib_files():
    raw = np.frombuffer(f.read_bytes(), np.uint8)
    parts += [raw.astype("<u2"), np.array([256], "<u2")]
    total += raw.size
    if total >= max_bytes:
      break
  np.concatenate(parts).tofile(path)
  meta = {"dtype": "uint16", "vocab_size": 257, "eot_token": 256}
  (out / "tokens.bin.json").write_text(json.dumps(meta) + "\n")
  return path


def wait_figures(workdir: Path) -> dict:
  """The input wait against the step time in a run's ``metrics.jsonl`` (first step excluded)."""
  records = run_files.read_metrics(workdir / "metrics.jsonl")[1:]
  wait = [r["data_seconds"] for r in records]
  step = [r["step_seconds"] for r in records]
  return {
    "steps_timed": len(records),
    "wait_share": sum(wait) / sum(step),
    "median_wait_share": statistics.median(w / s for w, s in zip(wait, step, strict=True)),
    "median_wait_seconds": statistics.median(wait),
    "max_wait_seconds": max(wait),
    "median_step_seconds": statistics.median(step),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="default", help="a YAML config or a built-in name (default, tiny)")
  parser.add_argument("--steps", type=int, default=40, help="steps of each run (stop_at)")
  parser.add_argument("--tokens", type=Path, default=None, help="a token file (else the stdlib's bytes)")
  parser.add_argument("--workdir", type=Path, default=Path("runs/input_bench"))
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/input_bench_default.json")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  base = load_config(resolve_config(args.config), list(args.overrides))
  tokens = args.tokens or stdlib_token_file(args.workdir / "stdlib_tokens", base.data.max_bytes)
  inputs = {
    "text": [],
    "tokens_first_fit": [f"data.tokens={tokens}", "data.packing=first_fit"]
    + ([] if args.tokens else ["model.vocab_size=257"]),
  }
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
  record = {
    "benchmark": "input_bench",
    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    "commit": commit.stdout.strip(),
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "machine": {"processor": platform.machine(), "cores": os.cpu_count(), "load_average": os.getloadavg()},
    "jax": jax.__version__,
    "goal_wait_share": GOAL,
    "runs": {},
  }
  for name, extra in inputs.items():
    for loader in ("grain", "numpy"):
      workdir = args.workdir / f"{name}_{loader}"
      cfg = load_config(
        resolve_config(args.config),
        [
          f"workdir={workdir}",
          f"stop_at={args.steps}",
          "max_seconds=null",
          "sample_len=0",
          "eval_every=100000",
          "checkpoint_every=100000",
          f"data.loader={loader}",
          *extra,
          *args.overrides,
        ],
      )
      trainer.train(cfg, progress=False)
      figures = {"grain_workers": cfg.data.grain_workers if loader == "grain" else 0, **wait_figures(workdir)}
      if loader == "grain":
        figures["goal_met"] = figures["wait_share"] < GOAL
      record["runs"][f"{name}_{loader}"] = figures
      record["machine"]["devices"] = [str(d) for d in jax.devices()]
      print(f"{name} {loader}", json.dumps(figures), flush=True)
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(record, indent=1) + "\n")
  record["machine"]["load_average_end"] = os.getloadavg()
  args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
