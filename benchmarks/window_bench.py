"""Sliding-window attention: block skipping on the CPU, as ratios in one run (issue 47).

  python benchmarks/window_bench.py [--length 16384] [--window 1024] [--short 2048] [--heads 4]
                                    [--head-dim 64] [--repeats 3] [--out benchmarks/results/window.json]

Causal self-attention, B 1, N heads (K = N), head dim H, float32, forward and forward + backward
(``jax.grad`` of a sum), median wall time of ``--repeats`` runs after a compile-and-warm-up run:

* ``loops``: the XLA loops (``blockwise_attention`` with explicit blocks of 512, which never runs the
  CPU kernel), windowed ``local_window_size=(window - 1, 0)`` at T = ``--length``;
* ``kernel``: the C++ CPU kernel (``cpu_flash_attention``), the same window;
* each path's full causal attention at T = ``--short`` (the issue's reference point) and at
  T = ``--length`` (what the window saves);
* transformers' sliding-window attention on CPU: torch SDPA with the bool mask of
  ``transformers.masking_utils.sliding_window_causal_mask_function(window)`` at T = ``--length``
  (forward; the mask is ``[T, T]``), and torch SDPA ``is_causal`` at T = ``--short``.

The issue's goal, "T 16k with a 1k window within 1.5x of full attention at T 2k", compares 8x the
tokens at about the same keys per query (a causal 2k row sees 1k keys on average): the work is
8x, so the ratio printed against it is per query token (time / T), where 1.0 means the windowed
row costs what a full causal 2k row costs; the raw ratio is printed beside it. The windowed path
against its own full causal attention at T 16k shows the skipping (about window / (T / 2) of the
pairs: 1/8 here).
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
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import AttentionMask, blockwise, cpu_flash

ROOT = Path(__file__).resolve().parent.parent


def _timed(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _path(name: str, window: int | None):
  opts = {} if window is None else {"local_window_size": (window - 1, 0)}
  scale = 0.125

  def attend(q, k, v):
    if name == "loops":
      return blockwise.blockwise_attention(
        q, k, v, scale=scale, mask=AttentionMask(), block_q=512, block_k=512, **opts
      )
    return cpu_flash.cpu_flash_attention(q, k, v, scale=scale, causal=True, **opts)

  forward = jax.jit(attend)
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2)))
  return forward, grad


def _inputs(length: int, heads: int, dim: int):
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal((1, length, heads, dim)), jnp.float32) for _ in range(3))


def _torch(length: int, window: int | None, heads: int, dim: int, repeats: int) -> float:
  import torch
  from transformers.masking_utils import sliding_window_causal_mask_function

  torch.manual_seed(0)
  q, k, v = (torch.randn(1, heads, length, dim) for _ in range(3))
  mask = None
  if window is not None:
    fn = sliding_window_causal_mask_function(window)
    idx = torch.arange(length)
    mask = fn(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), idx[:, None], idx[None, :])
    mask = mask[None, None]

  def run():
    with torch.no_grad():
      if mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125)
      return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)

  run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--length", type=int, default=16384)
  parser.add_argument("--window", type=int, default=1024)
  parser.add_argument("--short", type=int, default=2048)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--skip-full-long", action="store_true", help="leave out full causal attention at --length"
  )
  parser.add_argument("--out", type=Path, default=None, help="write the record (JSON) here")
  args = parser.parse_args(argv)
  long_in = _inputs(args.length, args.heads, args.head_dim)
  short_in = _inputs(args.short, args.heads, args.head_dim)
  rows = {}
  for name in ("loops", "kernel"):
    windowed = _path(name, args.window)
    full = _path(name, None)
    for kind, i in (("forward", 0), ("forward+backward", 1)):
      row = {
        "window": _timed(windowed[i], long_in, args.repeats),
        "full_short": _timed(full[i], short_in, args.repeats),
      }
      if not args.skip_full_long:
        row["full_long"] = _timed(full[i], long_in, args.repeats)
      row["raw_ratio"] = row["window"] / row["full_short"]
      row["per_token_ratio"] = row["raw_ratio"] * args.short / args.length
      if "full_long" in row:
        row["vs_full_long"] = row["window"] / row["full_long"]
      rows[f"{name} {kind}"] = row
      print(f"{name:6s} {kind:16s} " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
  torch_row = {
    "window": _torch(args.length, args.window, args.heads, args.head_dim, args.repeats),
    "full_short": _torch(args.short, None, args.heads, args.head_dim, args.repeats),
  }
  rows["torch sdpa forward"] = torch_row
  print("torch  forward          " + "  ".join(f"{k} {v:.4g}" for k, v in torch_row.items()), flush=True)
  for name in ("loops", "kernel"):
    ratio = rows[f"{name} forward"]["window"] / torch_row["window"]
    rows[f"{name} forward"]["vs_torch_window"] = ratio
    print(f"{name} forward windowed / torch SDPA windowed: {ratio:.3g}")
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
  record = {
    "benchmark": "window_bench",
    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    "commit": commit.stdout.strip(),
    "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
    "jax": jax.__version__,
    "times_s": rows,
  }
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
  return record


if __name__ == "__main__":
  main()
