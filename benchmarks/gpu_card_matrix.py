"""The GPU attention compile matrix for one card, from a CPU host with jax's CUDA plugin: backend x
head dim x dtype x ALiBi (none, native on ``flash`` / emulated elsewhere, the emulation's precise
dims: ``rope_alibi``) x forward / gradient, each compiled for a deviceless ``--chip`` (XLA:GPU,
Triton and ptxas, the card's shared-memory limit included; ``lowering_check.gpu_compile_row`` at
B 2 x T 256 x N 4 x K 2). Writes ``--json`` (rows: pass / fail, per-device temporaries in MiB, the
error) and prints a markdown table (docs/accelerator.md, "GPU cards").

  JAX_PLATFORMS=cpu PYTHONPATH=$PWD <venv with jax[cuda12]>/bin/python benchmarks/gpu_card_matrix.py \\
    --chip a100 --json benchmarks/results/gpu_compile_a100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lowering_check as lc  # noqa: E402

ENCODINGS = ("none", "alibi", "rope_alibi")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def table(rows: list[dict]) -> list[str]:
  """Markdown: one line per backend x dtype x encoding, one column per H, cells ``forward / gradient``
  MiB of temporaries (``cuDNN``/``Triton`` noted for ``auto``), or why it did not compile."""
  dims = sorted({r["head_dim"] for r in rows})
  chip = rows[0]["chip"]
  out = [
    f"| backend | dtype | encoding | {' | '.join(f'H {d}' for d in dims)} |",
    "| --- | --- | --- |" + " --- |" * len(dims),
  ]
  keys = list(dict.fromkeys((r["backend"], r["dtype"], r["encoding"]) for r in rows))
  for key in keys:
    cells = []
    for d in dims:
      got = {
        r["program"]: r for r in rows if (r["backend"], r["dtype"], r["encoding"], r["head_dim"]) == (*key, d)
      }
      if len(got) < 2:
        cell = "not run"
      elif all(r["compiled"] for r in got.values()):
        cell = " / ".join(f"{got[p]['temp_mib']:.2f}" for p in ("forward", "gradient"))
        if key[0] == "auto":
          cell += " (cuDNN)" if "cudnn_fmha" in got["forward"]["kernels"] else " (Triton)"
      else:
        err = next(r["error"] for r in got.values() if not r["compiled"])
        cell = (
          "refused: H > 128 on sm_80" if "up to 128 on compute capability" in err else "FAIL: " + err[:60]
        )
      cells.append(cell)
    out.append(f"| {' | '.join(key)} | {' | '.join(cells)} |")
  return [f"Compiled for {chip}: MiB of temporaries, forward / gradient.", "", *out]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chip", default="a100", choices=("h100", "h200", "a100"))
  parser.add_argument("--backends", default="flash,pallas_gpu,cudnn,auto")
  parser.add_argument("--dims", default=",".join(map(str, lc.HEAD_DIMS)))
  parser.add_argument("--dtypes", default="bfloat16,float32")
  parser.add_argument("--encodings", default=",".join(ENCODINGS))
  parser.add_argument("--json", type=Path, required=True)
  parser.add_argument("--table-only", action="store_true", help="print the table of --json's rows")
  args = parser.parse_args(argv)
  if args.table_only:
    data = json.loads(args.json.read_text())
    print("\n".join(table(data["rows"] if isinstance(data, dict) else data)))
    return 0
  if not lc.gpu_plugin_installed():
    print('jax\'s CUDA plugin is not installed: pip install "jaxpe[gpu-compile]"')
    return 2
  rows = []
  print(f"| backend | dtype | encoding | H | forward ({args.chip}) | gradient ({args.chip}) |")
  print("| --- | --- | --- | --- | --- | --- |")
  for backend in args.backends.split(","):
    for dtype in args.dtypes.split(","):
      for enc in args.encodings.split(","):
        for dim in map(int, args.dims.split(",")):
          cells = []
          for grad in (False, True):
            start = time.time()
            got = lc.gpu_compile_row(backend, enc, dim, grad=grad, chip=args.chip, dtype=DTYPES[dtype])
            ok = isinstance(got, lc.Compiled)
            row = dict(
              chip=args.chip, backend=backend, dtype=dtype, encoding=enc, head_dim=dim,
              program="gradient" if grad else "forward", compiled=ok,
              kernels=sorted(lc.call_kinds(got)) if ok else None,
              temp_mib=round(got.temp / 2**20, 2) if ok else None,
              error=None if ok else lc.describe(got)[:300], seconds=round(time.time() - start, 1),
            )  # fmt: skip
            rows.append(row)
            cells.append(f"ok, {row['temp_mib']:.2f} MiB" if ok else "FAIL: " + row["error"][:80])
          print(f"| {backend} | {dtype} | {enc} | {dim} | {' | '.join(cells)} |", flush=True)
          args.json.write_text(json.dumps(rows, indent=1) + "\n")
  print("\n".join(table(rows)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
