"""bfloat16 parameters against float32 on the default run (issue 46): the same config, seed and
batches, ``model.param_dtype`` float32 then bfloat16 (float32 master weights and optimizer state),
then float32 again with another seed (the seed-to-seed spread the difference is read against).

  python benchmarks/param_dtype_bench.py [--config default] [--steps 550] [--stop-at N]
      [--reference-seed 1] [--runs DTYPE:SEED ...] [--tolerance 0.05] [--workdir runs/param_dtype]
      [--out benchmarks/results/param_dtype_default.json] [key=value ...]

Each run is a ``jaxpe.train.trainer.train`` of the config (the built-in ``default``: the run
``jaxpe-train`` makes) in its own workdir, with ``max_seconds=null`` (the schedule is never fitted
to the clock, so every run has the same ``--steps``-step schedule) and no sample; rerunning resumes,
so an interrupted benchmark continues. ``--stop-at`` stops every run at that step of the same
schedule (a partial comparison, at equal steps).

Prints and writes to ``--out`` (JSON, after each run), per run: the held-out bits per byte at every
evaluation (the config's ``eval_every``, and the last step), the mean training loss (nats) over each
50-step window, the final training loss, the parameters' bytes and tokens/s; then the differences.
The goal (issue 46): bfloat16's final held-out bits per byte within ``--tolerance`` (default 0.05
bits/byte, the tests' figure) of float32's at 550 steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import jax

from jaxpe.train import run_files, trainer
from jaxpe.train.cli import resolve_config
from jaxpe.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 50
"""Steps per training-loss window in the record."""


def run_record(workdir: Path, result, dtype: str) -> dict:
  """One run's figures from its ``TrainResult`` and ``metrics.jsonl``."""
  records = run_files.read_metrics(workdir / "metrics.jsonl")
  evals = {r["step"]: r["eval_bits_per_byte"] for r in records if "eval_bits_per_byte" in r}
  windows = {}
  for r in records:
    end = -(-r["step"] // WINDOW) * WINDOW
    windows.setdefault(end, []).append(r["loss"])
  steps_s = sorted(r["step_seconds"] for r in records[1:])
  return {
    "steps": result.step,
    "schedule_steps": result.num_steps,
    "eval_bits_per_byte": {str(k): v for k, v in sorted(evals.items())},
    f"train_loss_mean_per_{WINDOW}_steps": {str(k): sum(v) / len(v) for k, v in sorted(windows.items())},
    "final_train_loss": result.train_loss,
    "final_eval_bits_per_byte": result.eval_bits_per_byte,
    "param_bytes": result.run["num_params"] * (2 if dtype == "bfloat16" else 4),
    "tokens_per_second": result.tokens_per_second,
    "median_step_seconds": steps_s[len(steps_s) // 2] if steps_s else None,
    "wall_seconds": result.wall_seconds,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="default", help="a YAML config or a built-in name (default, tiny)")
  parser.add_argument("--steps", type=int, default=550, help="the schedule's length (num_steps)")
  parser.add_argument("--stop-at", type=int, default=None, help="stop every run at this step of the schedule")
  parser.add_argument(
    "--reference-seed", type=int, default=1, help="float32 with this seed: the seed-to-seed spread; -1: none"
  )
  parser.add_argument(
    "--runs",
    nargs="+",
    default=None,
    help="DTYPE:SEED runs to make (default: float32:0 bfloat16:0 float32:REFERENCE_SEED); finished ones are read",
  )
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
  if args.runs is not None:  # e.g. one run per process on a shared machine; a later full call reads them all
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
    result = trainer.train(cfg, progress=False)
    record["machine"]["devices"] = [str(d) for d in jax.devices()]
    record["runs"][name] = run_record(workdir, result, dtype)
    print(name, json.dumps(record["runs"][name]), flush=True)
    runs_done = record["runs"]
    if "float32_seed0" in runs_done and "bfloat16_seed0" in runs_done:
      f32, bf16 = runs_done["float32_seed0"], runs_done["bfloat16_seed0"]
      d_eval = bf16["final_eval_bits_per_byte"] - f32["final_eval_bits_per_byte"]
      record["bfloat16_minus_float32"] = {
        "eval_bits_per_byte": d_eval,
        "final_train_loss": bf16["final_train_loss"] - f32["final_train_loss"],
        "within_tolerance": abs(d_eval) <= args.tolerance,
      }
    ref = runs_done.get(f"float32_seed{args.reference_seed}")
    if ref is not None and "float32_seed0" in runs_done:
      record["float32_seed_spread"] = {
        "eval_bits_per_byte": ref["final_eval_bits_per_byte"]
        - runs_done["float32_seed0"]["final_eval_bits_per_byte"],
        "final_train_loss": ref["final_train_loss"] - runs_done["float32_seed0"]["final_train_loss"],
      }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
  for key in ("bfloat16_minus_float32", "float32_seed_spread"):
    if key in record:
      print(key, json.dumps(record[key]))


if __name__ == "__main__":
  main()
