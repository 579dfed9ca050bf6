r"""The size table of docs/accelerator.md: will a config fit a target? ``jaxpe-compile`` for the default
config and 125M / 350M / 1B-parameter configs on v5e-8, v6e-8 and one H100.

  python benchmarks/size_table.py --targets v5e-8 v6e-8          # TPU rows (libtpu)
  JAX_PLATFORMS=cpu /path/to/venv-with-gpu-compile/bin/python benchmarks/size_table.py --targets h100
  python benchmarks/size_table.py --table                        # the markdown table of the saved rows

Each row is ``jaxpe.train.aot.compile_run`` of the config (the built-in ``default`` with the overrides
of ``CONFIGS``) for the target, written as JSON to ``benchmarks/results/compile_sizes/<config>-<target>.json``
(the command's ``--json``); ``--table`` prints them. Big compiles take minutes on a busy 2-core host:
run it in the background (``nice``). The configs are GPT-3's shapes (Brown et al., arXiv 2005.14165,
table 2.1: 125M is L 12, D 768, N 12; 350M L 24, D 1024, N 16) with GPT-2's vocabulary padded to 50304
and RoPE, and a 1B of L 18, D 2048, N 16; T 2048, bfloat16 activations, ``remat=full`` and
``scan_layers``, the state split over the chips (``mesh_shape=[1,-1,1,1]``: FSDP), 8 sequences per chip.
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

OUT = HERE / "results" / "compile_sizes"
BIG = ["seq_len=2048", "model.max_len=2048", "model.vocab_size=50304", "model.dtype=bfloat16"]
BIG += [
  "model.remat=full",
  "model.scan_layers=true",
  "mesh_shape=[1,-1,1,1]",
  "model.attn_implementation=auto",
]
CONFIGS = {
  "default": [],
  "125M": [*BIG, "model.d_model=768", "model.num_layers=12", "model.num_heads=12"],
  "350M": [*BIG, "model.d_model=1024", "model.num_layers=24", "model.num_heads=16"],
  "1B": [*BIG, "model.d_model=2048", "model.num_layers=18", "model.num_heads=16"],
}
"""Config name -> overrides of the built-in ``default`` config (``jaxpe-compile --config default ...``)."""


def run_row(name: str, target: str) -> dict:
  """Compiles one row and writes its JSON; returns it (``error``: the compiler's refusal)."""
  import jax  # noqa: PLC0415

  from jaxpe.train import aot, targets  # noqa: PLC0415
  from jaxpe.train import config as config_lib  # noqa: PLC0415
  from jaxpe.train.cli import resolve_config  # noqa: PLC0415
  from jaxpe.train.state import num_params  # noqa: PLC0415, F401

  t = targets.target(target)
  chips = t.chips
  overrides = list(CONFIGS[name])
  if name != "default":
    overrides.append(f"batch_size={8 * chips}")
  cfg = config_lib.load_config(resolve_config("default"), overrides)
  start = time.time()
  row = {"config": name, "target": target, "overrides": overrides, "jax": jax.__version__}
  from jaxpe.train.memory_check import memory_floor_bytes  # noqa: PLC0415

  row["params"] = memory_floor_bytes(cfg)[0]
  try:
    with jax.numpy_dtype_promotion("standard"):
      reports = aot.compile_run(cfg, target, log=lambda m: print(f"  {m}", flush=True))
    row["programs"] = [r.as_dict() for r in reports]
  except Exception as err:  # noqa: BLE001  (a refusal is a row)
    row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
  row["seconds"] = time.time() - start
  OUT.mkdir(parents=True, exist_ok=True)
  (OUT / f"{name}-{target}.json").write_text(json.dumps(row, indent=1))
  return row


def table() -> str:
  """The markdown table of every saved row."""
  lines = [
    "| config | params | target | train step per device | fits | compiled FLOPs / model FLOPs | MFU bound | generate | compile s |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for path in sorted(OUT.glob("*.json"), key=lambda p: (list(CONFIGS).index(p.stem.split("-")[0]), p.stem)):
    row = json.loads(path.read_text())
    head = f"| {row['config']} | {row['params'] / 1e6:,.0f}M | {row['target']} |"
    if "error" in row:
      lines.append(f"{head} refused: {row['error'][:120]} | - | - | - | - | {row['seconds']:.0f} |")
      continue
    from jaxpe.train import aot, targets  # noqa: PLC0415

    remat = 4 / 3 if "model.remat=full" in row["overrides"] else 1.0
    spec = targets.target(row["target"]).spec
    chip = {"remat_factor": remat, "peak_flops": spec.peak_flops, "bandwidth": spec.hbm_bandwidth}
    reports = [aot.report_from_dict({**chip, **p}) for p in row["programs"]]
    reports[0].remat_factor = remat
    step = {**reports[0].as_dict()}
    gen = reports[1].as_dict() if len(reports) > 1 else None
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    fits = "yes" if step["fits"] else "**no**"
    ratio = f"{step['flops'] / step['model_flops']:.2f}" if step["flops"] and step["model_flops"] else "n/a"
    mfu = f"{step['mfu']:.0%}" if step.get("mfu") is not None and not step["refused"] else "-"
    if mfu != "-" and not step["bytes_accessed"] > step["arguments"] + step["outputs"]:
      mfu += " (compute only)"  # no cost analysis (XLA:GPU): the bytes are a floor
    need = gib(step["needed"]) + f" of {gib(step['capacity'])}"
    if step["refused"]:
      need += " (refused by the compiler)"
    g = "-" if gen is None else f"{gib(gen['needed'])}, {'fits' if gen['fits'] else 'no'}"
    lines.append(f"{head} {need} | {fits} | {ratio} | {mfu} | {g} | {row['seconds']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="*", default=["v5e-8", "v6e-8"])
  parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
  parser.add_argument("--table", action="store_true", help="print the saved rows as markdown and exit")
  args = parser.parse_args(argv)
  if args.table:
    print(table())
    return 0
  for target in args.targets:
    for name in args.configs:
      print(f"{name} on {target} ...", flush=True)
      row = run_row(name, target)
      print(f"  done in {row['seconds']:.0f} s" + (f": {row['error']}" if "error" in row else ""), flush=True)
  print(table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
