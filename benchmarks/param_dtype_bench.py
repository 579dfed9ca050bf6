"""bfloat16 parameters against float32 on the default run (issue 46): the same config, seed and
batches, ``model.param_dtype`` float32 then bfloat16 (float32 master weights and optimizer state).

  python benchmarks/param_dtype_bench.py [--config tiny] [--steps 550] [--workdir runs/param_dtype] [key=value ...]

Prints, per dtype, the final training loss (nats), the held-out bits per byte, the parameters' bytes
and tokens/s, then the differences; the goal (issue 46) is bfloat16 within the stated tolerance of
float32's held-out bits per byte at 550 steps. Each run is a ``jaxpe.train.trainer.train`` in its own
workdir (rerunning resumes, so an interrupted benchmark continues).
"""

from __future__ import annotations

import argparse
import json

from jaxpe.train import trainer
from jaxpe.train.cli import resolve_config
from jaxpe.train.config import load_config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
    "--config", default=None, help="a YAML config or a built-in name (tiny); default: defaults"
  )
  parser.add_argument("--steps", type=int, default=550)
  parser.add_argument("--workdir", default="runs/param_dtype")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  out = {}
  for dtype in ("float32", "bfloat16"):
    cfg = load_config(
      None if args.config is None else resolve_config(args.config),
      [
        f"workdir={args.workdir}/{dtype}",
        f"num_steps={args.steps}",
        f"eval_every={args.steps}",
        f"checkpoint_every={args.steps}",
        "sample_len=0",
        f"model.param_dtype={dtype}",
        *args.overrides,
      ],
    )
    r = trainer.train(cfg, progress=False)
    params = r.run["num_params"] * (2 if dtype == "bfloat16" else 4)
    out[dtype] = {
      "train_loss": r.train_loss,
      "eval_bits_per_byte": r.eval_bits_per_byte,
      "param_bytes": params,
      "tokens_per_second": r.tokens_per_second,
    }
    print(dtype, json.dumps(out[dtype]), flush=True)
  d_eval = out["bfloat16"]["eval_bits_per_byte"] - out["float32"]["eval_bits_per_byte"]
  d_loss = out["bfloat16"]["train_loss"] - out["float32"]["train_loss"]
  print(
    f"bfloat16 - float32 after {args.steps} steps: held-out {d_eval:+.4f} bits/byte, train loss {d_loss:+.4f} nats"
  )


if __name__ == "__main__":
  main()
