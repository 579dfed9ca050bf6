r"""Every encoding's train step compiled for a TPU v5e-8 from this host (deviceless; libtpu), sharded
three ways: data, FSDP and tensor parallel. Issue 45's "the train step of every encoding compiled on
a v5e-8 mesh (data, fsdp, tensor parallel)".

  python benchmarks/encodings_compile.py                        # the whole matrix (minutes: nice it)
  python benchmarks/encodings_compile.py --encodings alibi t5 --meshes tensor --impls auto
  python benchmarks/encodings_compile.py --table                # the markdown table of the saved run

Each row is ``jaxpe.train.aot.compile_run`` (the train step ``jaxpe-train`` runs: the model, AdamW,
the state's and the batch's shardings over ``mesh_shape``; no generation) of the built-in ``tiny``
config (L 2, D 64, N 4, T 64, global batch 16, float32) with ``model.pos_encoding`` set, ``sinks``
standing for ``rope`` with ``model.attention_sinks=true``; per device: HBM needed (arguments +
outputs - aliased + temporaries + code: ``memory_analysis``), the temporaries, and the custom calls
(kernels) the program holds. ``--impls``: ``xla`` (the config's default backend), ``auto`` (on a
TPU: splash, or jaxpe's flash where splash cannot run the encoding; ``xla`` for the encodings with a
learned bias: t5, kerple, fire, cope) and ``flash`` (jaxpe's kernel, for the encodings it runs). Meshes (data, fsdp, tensor,
context) over the 8 chips: ``MESHES``. A compile the compiler refuses is a row with its error.
Written to ``benchmarks/results/encodings_compile.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

OUT = HERE / "results" / "encodings_compile.json"
TARGET = "v5e-8"
MESHES = {"data": "[8,1,1,1]", "fsdp": "[1,8,1,1]", "tensor": "[2,1,4,1]", "2x2x2": "[2,2,2,1]"}
"""Mesh name -> ``mesh_shape`` (data, fsdp, tensor, context): all 8 chips on one axis, tensor 4 (N 4
heads, one per chip) with data 2, and 2 x 2 x 2."""
ENCODINGS = (
  *("none", "learned", "sinusoidal", "rope", "xpos", "alibi", "rope_alibi"),
  *("t5", "kerple_log", "kerple_power", "fire", "cope", "sinks"),
)
"""``model.config.POS_ENCODINGS`` and ``sinks`` (RoPE with attention sinks)."""
IMPLS = ("xla", "auto", "flash")
"""``model.attn_implementation`` of the rows; the default run: ``xla`` and ``auto``."""


def overrides(encoding: str, mesh: str, impl: str) -> list[str]:
  """``jaxpe-compile --config tiny`` overrides of one row."""
  enc = ["model.pos_encoding=rope", "model.attention_sinks=true"] if encoding == "sinks" else []
  enc = enc or [f"model.pos_encoding={encoding}"]
  return [*enc, f"mesh_shape={MESHES[mesh]}", f"model.attn_implementation={impl}"]


def run_row(encoding: str, mesh: str, impl: str, extra: tuple[str, ...] = ()) -> dict:
  """Compiles one row; returns it (``error``: the refusal, its first line). ``extra``: more overrides."""
  import jax  # noqa: PLC0415

  from jaxpe.train import aot  # noqa: PLC0415
  from jaxpe.train import config as config_lib  # noqa: PLC0415
  from jaxpe.train.cli import resolve_config  # noqa: PLC0415

  args = [*overrides(encoding, mesh, impl), *extra]
  row = {"encoding": encoding, "mesh": mesh, "mesh_shape": MESHES[mesh], "impl": impl, "overrides": args}
  start = time.time()
  try:
    cfg = config_lib.load_config(resolve_config("tiny"), args)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 steps
      (step,) = aot.compile_run(cfg, TARGET, generation=False)
    row.update(
      needed=step.needed,
      arguments=step.arguments,
      outputs=step.outputs,
      aliased=step.aliased,
      temporaries=step.temporaries,
      code=step.code,
      capacity=step.capacity,
      fits=step.fits,
      flops=step.flops,
      calls=[c for c in step.calls if "tpu_custom_call" in c or "Sharding" not in c],
    )
  except Exception as err:  # noqa: BLE001  (a refusal is a row)
    row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:400]}"
  row["seconds"] = round(time.time() - start, 1)
  return row


def table(rows: list[dict]) -> str:
  """Markdown: one line per encoding and backend, per-device MiB needed (temporaries) per mesh."""
  meshes = [m for m in MESHES if any(r["mesh"] == m for r in rows)]
  lines = [
    "| encoding | attn | " + " | ".join(f"{m} {MESHES[m]}" for m in meshes) + " | kernels |",
    "| --- | --- | " + " | ".join("---" for _ in meshes) + " | --- |",
  ]
  keyed = {(r["encoding"], r["impl"], r["mesh"]): r for r in rows}
  for enc in ENCODINGS:
    for impl in IMPLS:
      cells, kernels = [], set()
      for m in meshes:
        r = keyed.get((enc, impl, m))
        if r is None:
          cells.append("-")
        elif "error" in r:
          cells.append(f"**refused**: {r['error'][:80]}")
        else:
          cells.append(f"{r['needed'] / 2**20:.2f} ({r['temporaries'] / 2**20:.2f})")
          kernels.update("Mosaic" for c in r["calls"] if "tpu_custom_call" in c)
      if any(c != "-" for c in cells):
        lines.append(f"| {enc} | {impl} | " + " | ".join(cells) + f" | {', '.join(sorted(kernels)) or '-'} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--encodings", nargs="*", default=list(ENCODINGS), choices=ENCODINGS)
  parser.add_argument("--meshes", nargs="*", default=list(MESHES), choices=list(MESHES))
  parser.add_argument("--impls", nargs="*", default=["xla", "auto"], choices=IMPLS)
  parser.add_argument("--out", default=str(OUT), help="JSON file (default: %(default)s)")
  parser.add_argument("--table", action="store_true", help="print the saved rows as markdown and exit")
  parser.add_argument(
    "--merge", action="store_true", help="keep --out's other rows (same encoding, mesh, impl: replaced)"
  )
  args = parser.parse_args(argv)
  if args.table:
    print(table(json.loads(Path(args.out).read_text())["rows"]))
    return 0
  import jax  # noqa: PLC0415

  jax.config.update("jax_platforms", "cpu")  # the chips are compile-only devices
  rows = []
  for impl in args.impls:
    for mesh in args.meshes:
      for enc in args.encodings:
        row = run_row(enc, mesh, impl)
        rows.append(row)
        what = row.get("error") or f"{row['needed'] / 2**20:.2f} MiB needed per device"
        print(f"{enc:13s} {impl:5s} {mesh:7s} {row['seconds']:6.1f} s  {what}", flush=True)
  failed = [r for r in rows if "error" in r]
  if args.merge and Path(args.out).exists():
    key = lambda r: (r["encoding"], r["mesh"], r["impl"])  # noqa: E731
    new = {key(r) for r in rows}
    rows = [r for r in json.loads(Path(args.out).read_text())["rows"] if key(r) not in new] + rows
  Path(args.out).write_text(
    json.dumps({"target": TARGET, "jax": jax.__version__, "config": "tiny", "rows": rows}, indent=1)
  )
  print(table(rows))
  print(f"{len(rows) - len(failed)} compiled, {len(failed)} refused")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
