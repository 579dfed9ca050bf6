r"""One accelerator check (issue 19): every backend and encoding against xla, the ALiBi emulation's
logit deviation on the hardware, attention time and memory, train-step MFU and BLOOM-560M against
transformers, in one command that keeps to a time budget (default 450 s: under 8 minutes on one GPU).

  python benchmarks/accelerator_check.py                       # on the GPU (or TPU)
  python benchmarks/accelerator_check.py --smoke               # CPU, tiny sizes, Pallas in interpret mode
  python benchmarks/accelerator_check.py --lower               # any host: lower everything for cuda and tpu
                                                               # (benchmarks/lowering_check.py; --quick)
  python benchmarks/accelerator_check.py --results-dir DIR --budget 450 --parts a b c d e

On the device machine of this workplace (no pydantic in its image; wheels carried as ``.whl/``,
made by ``benchmarks/device_wheels.sh``; docs/accelerator.md), one command line:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
  PYTHONUNBUFFERED=1 python3 benchmarks/accelerator_check.py --results-dir $OUT 2>&1 | tee $OUT/check.log

(a ``run`` with ``carry: [".whl"]`` and ``timeout_s`` 570; the record is rewritten after every part).

Parts (each has a share of the budget; an item that would start past its part's deadline is skipped
and the reason recorded, so the run ends on time; an error ends its part only, with the error recorded):
  a  every backend (``jaxpe.attention.backends.BACKENDS`` available here: xla, cudnn, pallas_gpu,
     splash, tokamax and flash where present) x encoding (none, rope, xpos, alibi: native on xla and
     tokamax, emulated on the fused kernels in each ``AlibiSpec.form``, rope_alibi) against xla at
     precision HIGHEST on float32 copies of the same inputs: max |d out| forward and max |d grad|
     (q, k, v), bf16 and float32 inputs; causal with a left-padded row, grouped-query heads.
  b  the ALiBi emulation's logit deviation measured on the hardware at contexts 2k..64k: q/k content
     zero (scores are the emulated bias alone), v one-hot on 64 probe keys, so the output holds the
     softmax weights ``w_ij``; ``log(w_ij / w_ii) + m_h (i - j)`` is the measured logit deviation
     (resolution: the output's rounding, ~8e-3 for bf16), next to the rounding model's prediction
     for the same pairs (``jaxpe.emulation.bf16_exact.float32_accumulated_dot``, bf16 inputs).
  c  attention forward + backward time and memory (compiled temporaries) at T 1k..64k, B 1, N 16,
     H 64, bf16, causal: RoPE on the fused kernel (cudnn), native ALiBi as a dense bias on xla
     (skipped where it does not fit), ALiBi blockwise on xla, emulated ALiBi on the fused kernel in
     each form, jaxpe's kernel (flash) and tokamax where present.
  d  bf16 train-step MFU at two sizes (``benchmarks/train_bench.trainer_step``: jaxpe's trainer step;
     model FLOPs ``benchmarks/ceilings.decoder_matmuls``, 6 per parameter per token plus causal
     attention) / step time / peak: 989 TFLOP/s dense bf16 for H100/H200 (NVIDIA datasheet; KINDS.md
     measured ~790 on random data here); ``--peak-tflops`` to override; no MFU where unknown.
  e  BLOOM-560M-shaped model (random weights from a ``BloomConfig``, ``benchmarks/bloom_bench.BLOOM_560M``)
     in transformers on the same device (torch CUDA) and through jaxpe's importer: max |d logits|
     (float32, matmuls at HIGHEST / no TF32), forward ms per token, greedy generation ms per token.

Writes one JSON record ``accelerator-<UTC time>-<commit>.json`` to ``--results-dir`` (default
``$XDG_CACHE_HOME/jaxpe/benchmarks``, as ``benchmarks/run.py``) and prints README-ready markdown.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]  # the benchmarks, and this checkout's jaxpe
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in part e

import accelerator_parts  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

PARTS = ("a", "b", "c", "d", "e")
SHARES = {"a": 0.2, "b": 0.12, "c": 0.3, "d": 0.16, "e": 0.17}  # of the budget; the rest is margin
TITLES = {
  "a": "backend x encoding vs xla (HIGHEST)",
  "b": "ALiBi emulation: measured logit deviation vs the rounding model",
  "c": "attention fwd+bwd time and memory",
  "d": "bf16 train-step MFU",
  "e": "BLOOM-560M shape vs transformers",
}


def default_results_dir() -> Path:
  """``$XDG_CACHE_HOME/jaxpe/benchmarks`` (``~/.cache/jaxpe/benchmarks``), as ``benchmarks/run.py``."""
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxpe" / "benchmarks"


def _commit() -> str:
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"
  except OSError:
    return "unknown"


def _versions() -> dict:
  import importlib.metadata

  found = {}
  for name in ("jax", "jaxlib", "flax", "optax", "pydantic", "torch", "transformers", "tokamax"):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def markdown(part: str, result: dict) -> str:
  """A part's rows as a markdown table (columns: the keys of its rows), then its skips and error."""
  lines = [f"### {part}. {TITLES[part]}", ""]
  rows = result.get("rows", [])
  if rows:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    lines += ["| " + " | ".join(_cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
      lines.append("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")
  for skip in result.get("skipped", []):
    lines.append(f"- skipped: {skip}")
  if result.get("error"):
    lines.append(f"- error: {result['error']}")
  lines.append(f"- part time {result.get('seconds', 0):.1f} s")
  return "\n".join(lines)


def _cell(x) -> str:
  """A table cell: floats to 3 digits, ``|`` escaped (column names hold ``|d out|``)."""
  if isinstance(x, float):
    return f"{x:.3g}"
  return str(x).replace("|", "\\|")


def main(argv: list[str] | None = None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--lower" in argv:  # no device needed: lower every backend and the model for cuda and tpu
    import lowering_check  # noqa: PLC0415

    argv.remove("--lower")
    return {"kind": "lowering_check", "status": lowering_check.main(argv)}
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
    "--smoke", action="store_true", help="CPU, tiny sizes, Pallas kernels in interpret mode"
  )
  parser.add_argument(
    "--budget", type=float, default=None, help="seconds for all parts (default 450; smoke 40)"
  )
  parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
  parser.add_argument("--results-dir", type=Path, default=None)
  parser.add_argument("--no-record", action="store_true")
  parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU")
  args = parser.parse_args(argv)
  if args.budget is not None and not 0 < args.budget < float("inf"):
    parser.error(f"--budget must be a number of seconds > 0, got {args.budget}")
  budget = args.budget if args.budget is not None else (40.0 if args.smoke else 450.0)
  t_start = time.perf_counter()
  device = jax.devices()[0]
  peak = args.peak_tflops * 1e12 if args.peak_tflops else accelerator_parts.datasheet_peak(device)
  cfg = accelerator_parts.Settings.for_run(smoke=args.smoke, peak=peak)
  record = {
    "kind": "accelerator_check",
    "commit": _commit(),
    "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "smoke": args.smoke,
    "budget_s": budget,
    "device": {"platform": device.platform, "kind": device.device_kind, "count": jax.device_count()},
    "peak_bf16_flops": peak,
    "peak_source": "--peak-tflops" if args.peak_tflops else accelerator_parts.PEAK_SOURCE,
    "versions": _versions(),
    "backends": {"known": list(accelerator_parts.backends.BACKENDS), "here": list(cfg.backends)},
    "parts": {},
  }
  print(
    f"accelerator check: {device.device_kind} ({device.platform}); backends here {cfg.backends}; budget {budget:.0f} s"
  )
  path = None
  if not args.no_record:
    out_dir = args.results_dir or default_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = record["date"].replace(":", "").replace("-", "")
    path = out_dir / f"accelerator-{stamp}-{record['commit']}.json"
    # written now, so a results dir that cannot be written fails before any part spends the budget
    path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
  runners = {
    "a": accelerator_parts.part_a,
    "b": accelerator_parts.part_b,
    "c": accelerator_parts.part_c,
    "d": accelerator_parts.part_d,
    "e": accelerator_parts.part_e,
  }
  for i, part in enumerate(args.parts):
    now = time.perf_counter()
    end = t_start + budget
    # this part's share, plus what earlier parts left unused, never past the end
    later = sum(SHARES[p] for p in args.parts[i + 1 :]) * budget
    deadline = min(end, max(now + SHARES[part] * budget, end - later))
    result = {"rows": [], "skipped": []}
    if deadline - now < 1 and not args.smoke:
      result["skipped"].append(f"part {part}: no time left in the {budget:.0f} s budget")
    else:  # smoke: every part runs at least its first item (the code path is the point)
      clock = accelerator_parts.Clock(max(deadline, now + 0.5))
      try:
        runners[part](cfg, clock, result)
      except Exception as err:  # noqa: BLE001  one part's failure is recorded; the others still run
        result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        result["traceback"] = traceback.format_exc()[-2000:]
    result["seconds"] = time.perf_counter() - now
    record["parts"][part] = result
    record["seconds"] = time.perf_counter() - t_start
    print(markdown(part, result), flush=True)
    if path:  # after every part, so a run killed later still leaves what it measured
      path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
  print(f"\ntotal {record['seconds']:.1f} s of {budget:.0f} s")
  if path:
    print(f"record: {path}")
  return record


def _json_default(x):
  if isinstance(x, np.generic):
    return x.item()
  return str(x)


if __name__ == "__main__":
  main()
