"""bfloat16 parameters against float32 on the default run (issue 46): the same config, seed and
batches, ``model.param_dtype`` float32 then bfloat16 (float32 master weights and optimizer state),
then float32 again with another seed (the seed-to-seed spread the difference is read against).

  python benchmarks/param_dtype_bench.py [--config default] [--steps 550] [--stop-at N]
      [--reference-seed 1] [--runs DTYPE:SEED ...] [--report-only] [--tolerance 0.05]
      [--workdir runs/param_dtype] [--out benchmarks/results/param_dtype_default.json] [key=value ...]

Each run is a ``jaxpe.train.trainer.train`` of the config (the built-in ``default``: the run
``jaxpe-train`` makes) in its own workdir ``WORKDIR/DTYPE_seedSEED``, with ``max_seconds=null`` (the
schedule is never fitted to the clock, so every run has the same ``--steps``-step schedule) and no
sample; rerunning resumes, so an interrupted benchmark continues. ``--stop-at`` stops every run at
that step of the same schedule; ``--runs`` makes only those runs (e.g. one per process on a shared
machine); ``--report-only`` trains nothing and reports the workdirs as they are (runs stopped or
still running: the comparison is then at the steps all runs reached).

The record (printed, and written to ``--out`` as JSON after each run) is read from each run's
``metrics.jsonl``: the held-out bits per byte at every evaluation (the config's ``eval_every``, and
the last step), the mean training loss (nats) over each 50-step window, the step time, tokens/s and
the parameters' bytes; then the differences bfloat16 - float32 (seed 0) and float32 seed
``--reference-seed`` - seed 0 at the evaluation steps and windows all runs reached. The goal (issue
46): bfloat16's held-out bits per byte within ``--tolerance`` (default 0.05 bits/byte, the tests'
figure) of float32's at 550 steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax
from flax import nnx

from jaxpe.model.decoder import Decoder
from jaxpe.train import run_files, trainer
from jaxpe.train.cli import resolve_config
from jaxpe.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 50
"""Steps per training-loss window in the record."""


def num_params(model_cfg) -> int:
  """The model's parameter count (shapes only, nothing computed)."""
  model = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def run_record(workdir: Path, params: int, dtype: str) -> dict:
  """One run's figures from its ``metrics.jsonl``."""
  records = run_files.read_metrics(workdir / "metrics.jsonl")
  evals = {r["step"]: r["eval_bits_per_byte"] for r in records if "eval_bits_per_byte" in r}
  windows: dict[int, list[float]] = {}
  for r in records:
    windows.setdefault(-(-r["step"] // WINDOW) * WINDOW, []).append(r["loss"])
  full = {k: sum(v) / len(v) for k, v in sorted(windows.items()) if len(v) == WINDOW}
  return {
    "steps": records[-1]["step"] if records else 0,
    "eval_bits_per_byte": {str(k): v for k, v in sorted(evals.items())},
    f"train_loss_mean_per_{WINDOW}_steps": {str(k): v for k, v in full.items()},
    "final_train_loss": records[-1]["loss"] if records else None,
    "param_bytes": params * (2 if dtype == "bfloat16" else 4),
    "tokens_per_second": records[-1]["tokens_per_second"] if records else None,
    "median_step_seconds": statistics.median(r["step_seconds"] for r in records[1:]) if records[1:] else None,
  }


def differences(a: dict, b: dict) -> dict:
  """``b - a`` at the evaluation steps and loss windows both runs reached."""
  key = f"train_loss_mean_per_{WINDOW}_steps"
  evals = {
    s: b["eval_bits_per_byte"][s] - v
    for s, v in a["eval_bits_per_byte"].items()
    if s in b["eval_bits_per_byte"]
  }
  losses = {s: b[key][s] - v for s, v in a[key].items() if s in b[key]}
  return {"eval_bits_per_byte": evals, key: losses}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="default", help="a YAML config or a built-in name (default, tiny)")
  parser.add_argument("--steps", type=int, default=550, help="the schedule's length (num_steps)")
  parser.add_argument("--stop-at", type=int, default=None, help="stop every run at this step of the schedule")
  parser.add_argument(
    "--reference-seed", type=int, default=1, help="float32 with this seed: the seed-to-seed spread; -1: none"
  )
  parser.add_argument("--runs", nargs="+", default=None, help="DTYPE:SEED runs to make (default: all three)")
  parser.add_argument("--report-only", action="store_true", help="train nothing: report the workdirs")
  parser.add_argument("--tolerance", type=float, default=0.05, help="held-out bits/byte (the stated goal)")
  parser.add_argument("--workdir", default="runs/param_dtype")
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/param_dtype_default.json")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
  record = {
    "benchmark": "param_dtype_bench",
    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    "commit": commit.stdout.strip(),
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "machine": {"processor": platform.machine()},  # devices: after the first run (it sets their count)
    "jax": jax.__version__,
    "tolerance_bits_per_byte": args.tolerance,
    "runs": {},
  }
  runs = [("float32", 0), ("bfloat16", 0)] + (
    [("float32", args.reference_seed)] if args.reference_seed >= 0 else []
  )
  if args.runs is not None:
    runs = [(r.split(":")[0], int(r.split(":")[1])) for r in args.runs]
  for dtype, seed in runs:
    name = f"{dtype}_seed{seed}"
    workdir = Path(args.workdir) / name
    cfg = load_config(
      resolve_config(args.config),
      [
        f"workdir={workdir}",
        f"seed={seed}",
        f"num_steps={args.steps}",
        f"stop_at={'null' if args.stop_at is None else args.stop_at}",
        "max_seconds=null",
        "sample_len=0",
        f"model.param_dtype={dtype}",
        *args.overrides,
      ],
    )
    if not args.report_only:
      trainer.train(cfg, progress=False)
      record["machine"]["devices"] = [str(d) for d in jax.devices()]
    record["runs"][name] = run_record(workdir, num_params(cfg.model), dtype)
    print(name, json.dumps(record["runs"][name]), flush=True)
    done = record["runs"]
    if "float32_seed0" in done and "bfloat16_seed0" in done:
      d = record["bfloat16_minus_float32"] = differences(done["float32_seed0"], done["bfloat16_seed0"])
      if d["eval_bits_per_byte"]:
        last = max(d["eval_bits_per_byte"], key=int)
        d["at_step"] = int(last)
        d["within_tolerance"] = abs(d["eval_bits_per_byte"][last]) <= args.tolerance
        d["complete"] = int(last) == args.steps
    ref = done.get(f"float32_seed{args.reference_seed}")
    if ref is not None and "float32_seed0" in done and args.reference_seed != 0:
      record["float32_seed_spread"] = differences(done["float32_seed0"], ref)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
  for key in ("bfloat16_minus_float32", "float32_seed_spread"):
    if key in record:
      print(key, json.dumps(record[key]))


if __name__ == "__main__":
  main()
