"""Precision of ALiBi's emulation term under a model of accelerator matmuls.

  python benchmarks/kernel_precision.py [--contexts 2048 8192 65536] [--queries 8] [--keys 2048]

16 heads (the paper's slopes), H = 64. For each context and form (lean; exact augmented; rotated
order k = 1, 2, 3 at max phase 0.1) it builds the extra q/k dims as the backends do
(``jaxpe.emulation.bf16_exact.alibi_term_dims``) and evaluates ``q . k / sqrt(H)`` with
``bf16_exact.float32_accumulated_dot``: inputs read as float32 (the ``xla`` path at precision
HIGHEST), bf16 (TPU default precision, bf16 kernels) or TF32 (NVIDIA default for float32), products
rounded to float32 and summed in a float32 accumulator in dim order. Printed: the largest deviation
from float64 ALiBi over ``--queries`` query positions (always the last) x ``--keys`` keys
``j <= i`` (strided, plus the 64 nearest) for every head, for the bf16-exact representation and
for the float32 dims read the same way (what the kernels would get without it); then the same with
64 N(0, 1) content dims in the sum, placed before the emulation dims (the fused kernels' order) and
after them (the old order): the deviation beyond the content's own float64 dot. The lean form is
compared modulo its per-row constant (against ``m (j - j0)``, ``j0`` the keys' centre). Goals: lean
and exact forms <= 1e-2 logits, lean no worse than exact (per head); rotated forms <= 2x their
float32 deviation (per head).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxpe.emulation import bf16_exact
from jaxpe.ops import alibi

FORMS = (("lean", 1), ("exact", 1), ("rotated", 1), ("rotated", 2), ("rotated", 3))
HEAD_DIM = 64


def reference(form, qpos, kpos, slopes):
  """``[T, S, N]`` float64 bias the form's dims should sum to (lean: ALiBi plus ``m (i - j0)``)."""
  if form == "lean":
    j0 = (kpos.min() + kpos.max()) // 2
    return np.broadcast_to(
      slopes[None, None, :] * (kpos[None, :, None] - j0), (len(qpos), len(kpos), len(slopes))
    )
  return -slopes[None, None, :] * (qpos[:, None, None] - kpos[None, :, None])


def deviations(form, order, ctx, representation, fmts, qpos, kpos, slopes, content=None):
  """``({fmt: [N]} max |emulated - ALiBi| over the sampled pairs ``j <= i``, E)``.

  ``content``: None, or ``"first"`` / ``"last"``: 64 N(0, 1) content dims summed before / after the
  emulation dims, their float64 dot (inputs read as ``fmt``) subtracted.
  """
  q, k = bf16_exact.alibi_term_dims(
    form,
    qpos,
    kpos,
    slopes=slopes,
    head_dim=HEAD_DIM,
    max_len=ctx,
    order=order,
    representation=representation,
  )
  ref = reference(form, qpos, kpos, slopes)
  visible = (kpos[None, :] <= qpos[:, None])[:, :, None]
  rng = np.random.default_rng(0)
  qc = rng.normal(size=(len(qpos), len(slopes), HEAD_DIM))
  kc = rng.normal(size=(len(kpos), HEAD_DIM))
  out = {}
  for fmt in fmts:
    qq, kk, base = q, k, 0.0
    if content is not None:
      qq = np.concatenate([qc, q] if content == "first" else [q, qc], axis=-1)
      kk = np.concatenate([kc, k] if content == "first" else [k, kc], axis=-1)
      base = np.einsum("tnh,sh->tsn", bf16_exact.round_mantissa(qc, fmt), bf16_exact.round_mantissa(kc, fmt))
    scores = (bf16_exact.float32_accumulated_dot(qq, kk, fmt).astype(np.float64) - base) / np.sqrt(HEAD_DIM)
    out[fmt] = np.where(visible, np.abs(scores - ref), 0.0).max(axis=(0, 1))
  return out, q.shape[-1]


def sample_positions(ctx, queries, keys):
  qpos = np.unique(np.linspace(ctx // queries, ctx - 1, queries).astype(int))
  stride = max(1, ctx // keys)
  kpos = np.unique(
    np.concatenate([np.arange(0, ctx, stride), *[np.arange(max(i - 63, 0), i + 1) for i in qpos]])
  )
  return qpos, kpos


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 65536])
  parser.add_argument("--queries", type=int, default=8)
  parser.add_argument("--keys", type=int, default=2048)
  args = parser.parse_args()
  slopes = alibi.alibi_slopes_f64(16)
  print(
    "| context | form | dims xla (float32) | dims kernels (bf16-exact) | float32 (xla, HIGHEST) | "
    "bf16-exact, bf16 in | bf16-exact, TF32 in | float32 dims, bf16 in | float32 dims, TF32 in | "
    "+ content first, bf16 / TF32 | + content last, bf16 / TF32 | goal met |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for ctx in args.contexts:
    t0 = time.perf_counter()
    qpos, kpos = sample_positions(ctx, args.queries, args.keys)
    lean_split = None
    for form, order in FORMS:
      plain, e32 = deviations(
        form, order, ctx, "float32", ("float32", "bfloat16", "tf32"), qpos, kpos, slopes
      )
      fmts = ("bfloat16", "tf32")
      split, e16 = deviations(form, order, ctx, "bf16_exact", fmts, qpos, kpos, slopes)
      first, _ = deviations(form, order, ctx, "bf16_exact", fmts, qpos, kpos, slopes, content="first")
      last, _ = deviations(form, order, ctx, "bf16_exact", fmts, qpos, kpos, slopes, content="last")
      f32 = plain["float32"]
      if form in ("lean", "exact"):
        ok = all(split[f].max() <= 1e-2 and first[f].max() <= 1e-2 for f in fmts)
        name = "lean" if form == "lean" else "exact (augmented)"
        note = "yes" if ok else "NO"
      else:
        ok = all(np.all(split[f] <= 2 * f32) for f in fmts)
        ratio = max(float(np.max(split[f] / f32)) for f in fmts)
        name = f"rotated k={order}"
        note = ("yes" if ok else "NO") + f" ({ratio:.2f}x float32)"
      if form == "lean":
        lean_split = split
      if form == "exact":
        worse = [f for f in fmts if np.any(lean_split[f] > split[f])]
        print(f"<!-- lean vs exact per head at {ctx}: lean worse on {worse or 'no'} dtype models -->")
      cells = [
        f"{x.max():.3g}" for x in (f32, split["bfloat16"], split["tf32"], plain["bfloat16"], plain["tf32"])
      ]
      cells += [f"{d['bfloat16'].max():.3g} / {d['tf32'].max():.3g}" for d in (first, last)]
      print(f"| {ctx} | {name} | {e32} | {e16} | " + " | ".join(cells) + f" | {note} |", flush=True)
    print(f"<!-- context {ctx}: {len(qpos)} queries x {len(kpos)} keys, {time.perf_counter() - t0:.0f} s -->")


if __name__ == "__main__":
  main()
