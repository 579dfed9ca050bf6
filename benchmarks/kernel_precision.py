"""Precision of ALiBi's emulation term under a model of accelerator matmuls.

  python benchmarks/kernel_precision.py [--contexts 2048 8192 65536] [--queries 8] [--keys 2048]

16 heads (the paper's slopes), H = 64. For each context and form (exact augmented; rotated order
k = 1, 2, 3 at max phase 0.1) it builds the extra q/k dims as the backends do
(``jaxpe.bf16_exact.alibi_term_dims``) and evaluates ``q . k / sqrt(H)`` with
``jaxpe.bf16_exact.float32_accumulated_dot``: inputs read as float32 (the ``xla`` path at precision
HIGHEST), bf16 (TPU default precision, bf16 kernels) or TF32 (NVIDIA default for float32), products
rounded to float32 and summed in a float32 accumulator in dim order. Printed: the largest deviation
from float64 ALiBi over ``--queries`` query positions (always the last) x ``--keys`` keys
``j <= i`` (strided, plus the 64 nearest) for every head, for the bf16-exact representation and
for the float32 dims read the same way (what the kernels would get without it), and the goal:
exact form <= 1e-2 logits; rotated forms <= 2x their float32 deviation (per head).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxpe.emulation import bf16_exact
from jaxpe.ops import alibi

FORMS = (("exact", 1), ("rotated", 1), ("rotated", 2), ("rotated", 3))


def deviations(form, order, ctx, representation, fmts, qpos, kpos, slopes):
  """``{fmt: [N]}`` max |emulated - ALiBi| over the sampled pairs ``j <= i``."""
  q, k = bf16_exact.alibi_term_dims(
    form, qpos, kpos, slopes=slopes, head_dim=64, max_len=ctx, order=order, representation=representation
  )
  ref = -slopes[None, None, :] * (qpos[:, None, None] - kpos[None, :, None])
  visible = (kpos[None, :] <= qpos[:, None])[:, :, None]
  out = {}
  for fmt in fmts:
    scores = bf16_exact.float32_accumulated_dot(q, k, fmt).astype(np.float64) / 8.0
    out[fmt] = np.where(visible, np.abs(scores - ref), 0.0).max(axis=(0, 1))
  return out, q.shape[-1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 65536])
  parser.add_argument("--queries", type=int, default=8)
  parser.add_argument("--keys", type=int, default=2048)
  args = parser.parse_args()
  slopes = alibi.alibi_slopes_f64(16)
  print(
    "| context | form | dims xla (float32) | dims kernels (bf16-exact) | float32 (xla, HIGHEST) | "
    "bf16-exact, bf16 in | bf16-exact, TF32 in | float32 dims, bf16 in | float32 dims, TF32 in | goal met |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for ctx in args.contexts:
    t0 = time.perf_counter()
    qpos = np.unique(np.linspace(ctx // args.queries, ctx - 1, args.queries).astype(int))
    stride = max(1, ctx // args.keys)
    kpos = np.unique(
      np.concatenate([np.arange(0, ctx, stride), *[np.arange(max(i - 63, 0), i + 1) for i in qpos]])
    )
    for form, order in FORMS:
      plain, e32 = deviations(
        form, order, ctx, "float32", ("float32", "bfloat16", "tf32"), qpos, kpos, slopes
      )
      split, e16 = deviations(form, order, ctx, "bf16_exact", ("bfloat16", "tf32"), qpos, kpos, slopes)
      f32 = plain["float32"]
      if form == "exact":
        ok = all(split[f].max() <= 1e-2 for f in split)
        name = "exact (augmented)"
      else:
        ok = all(np.all(split[f] <= 2 * f32) for f in split)
        name = f"rotated k={order}"
      ratio = max(float(np.max(split[f] / f32)) for f in split)
      note = "yes" if ok else "NO"
      if form != "exact":
        note += f" ({ratio:.2f}x float32)"
      cells = [
        f"{x.max():.3g}" for x in (f32, split["bfloat16"], split["tf32"], plain["bfloat16"], plain["tf32"])
      ]
      print(f"| {ctx} | {name} | {e32} | {e16} | " + " | ".join(cells) + f" | {note} |", flush=True)
    print(f"<!-- context {ctx}: {len(qpos)} queries x {len(kpos)} keys, {time.perf_counter() - t0:.0f} s -->")


if __name__ == "__main__":
  main()
