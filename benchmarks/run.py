"""jaxpe's benchmark suite: every benchmark, one table, one JSON record per run, the history.

  python benchmarks/run.py                  # everything (on 2 idle CPU cores: minutes)
  python benchmarks/run.py --quick          # small shapes
  python benchmarks/run.py --only ops train # some groups (ceiling always runs)
  python benchmarks/run.py --plot           # also plot the history of the records
  python benchmarks/run.py --update-readme  # rewrite docs/results.md's "Measured" block from the newest record
  python benchmarks/run.py --results-dir benchmarks/results   # keep the record in the checkout

Groups (each row is a figure and, where there is one, a ratio against a reference measured in the
same run, with the issue's goal):
  ceiling    float32 m^3 matmul FLOP/s and x*2+1 bytes/s (the machine, one size)  ops_bench.py
  ops        RoPE / xPos / emulation dims / sinusoidal vs the elementwise ceiling
             on their own arrays, RoPE vs rotate-half and vs transformers' torch
             apply_rotary_pos_emb, emulated vs native ALiBi attention, attention
             fwd+bwd vs jax.nn                                                    ops_bench.py
  attention  backends x encodings vs xla (subprocess)                           attention_bench.py
             xla (blockwise) forward + backward temporaries at T 16k and 64k,
             compiled (goal < 1 GiB at 16k)                                      run.py
  scale      step time per mesh on 8 fake devices, and context-parallel step time
             per (data, fsdp, tensor, context) mesh and strategy (subprocess, not
             --quick)                                                              scale_bench.py
  train      jaxpe's trainer step vs the PyTorch reference (eager, torch.compile)
             and vs the matmul ceiling at its shapes, at D 512 / L 8 / N 8 /
             B 8 x T 512 and D 128 / L 4 / N 8 / B 32 x T 256; the step's parts   train_bench.py
  bloom      560M importer time and peak memory, forward and generate vs HF,
             forward FLOP/s vs the matmul ceiling at its shapes                  bloom_bench.py
  generate   greedy decoding: BLOOM-560M at 1 x 32 + 128 and 8 x 128 + 128 vs
             transformers generate, the default decoder vs nanoGPT's torch
             generate; tokens/s, time to first token, memory                      generate_bench.py
  growth     step time per token as T and D grow                                 train_bench.py

A ratio against a ceiling (matmul or elementwise) divides the ceiling's time by the measured time
for the same work, the ceiling measured at the same shapes in the same process, alternately with
what it bounds, its best round (``benchmarks/ceilings.py``): it is at most 1 unless the measured
code beats the ceiling's own program.

Each run writes a JSON record ``<UTC time>-<commit>.json`` (commit, date, machine and its load
average, jax/flax/torch/transformers versions, rows) to ``--results-dir``: by default
``$XDG_CACHE_HOME/jaxpe/benchmarks`` (``~/.cache/jaxpe/benchmarks``), outside the checkout;
``--results-dir benchmarks/results`` keeps it with the committed history; ``--no-record`` skips it.
``--plot`` and ``--update-readme`` read the records of ``--results-dir``. Timings on a shared
machine are noisy: compare ratios within one record, and the load average says how busy it was.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bloom_bench  # noqa: E402
import generate_bench  # noqa: E402
import jax  # noqa: E402
import ops_bench  # noqa: E402
import train_bench  # noqa: E402
from ops_bench import Row, row  # noqa: E402

GROUPS = ("ceiling", "ops", "attention", "scale", "train", "bloom", "generate", "growth")
BEGIN, END = (
  "<!-- benchmarks:begin (written by benchmarks/run.py --update-readme) -->",
  "<!-- benchmarks:end -->",
)


def _subprocess_rows(args: list[str], timeout: float) -> str:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  out = subprocess.run(
    [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=True
  )
  return out.stdout


def attention_rows(*, quick: bool) -> list[Row]:
  """Timed rows of ``attention_bench.py`` (its markdown table), time ratio against ``xla``."""
  lengths = ["512"] if quick else ["1024", "2048"]
  text = _subprocess_rows(
    [
      str(HERE / "attention_bench.py"),
      "--lengths",
      *lengths,
      "--interpret-max-len",
      "512",
      "--interpret-memory-max-len",
      lengths[-1],
      "--repeats",
      "1" if quick else "3",
    ],
    timeout=600,
  )
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 10 or not cells[0].isdigit() or cells[8] in ("-", ""):
      continue
    t_len, encoding, backend, *_, temp_gib, temp_ratio, ms, time_ratio = cells
    extra = {} if time_ratio == "-" else {"ratio": float(time_ratio), "vs": "xla (time)"}
    rows.append(
      row(
        "attention",
        f"{encoding} on {backend}, T {t_len}, fwd",
        float(ms),
        "ms",
        temp_gib=float(temp_gib),
        **extra,
      )
    )
  return rows


def xla_memory_rows(*, quick: bool) -> list[Row]:
  """Compiled temporaries of causal attention forward + backward on ``xla`` (blockwise; on the CPU
  the fused kernel, its per-thread workspace ``cpu_flash.workspace_bytes`` added) at long T:
  B 1, N 16, H 64, float32, rope (plain q, k) and rope_alibi (ALiBi bias per block, 2 float32
  emulation dims), from XLA's ``memory_analysis`` (compiled, not run); goal under 1 GiB at T 16k
  (issue 21). The dense path writes ``[1, N, T, T]`` float32 score arrays, 4 N T^2 bytes each (16 GiB at T 16k)."""
  import jax.numpy as jnp
  import numpy as np

  from jaxpe import alibi_slopes
  from jaxpe.attention import AlibiSpec, cpu_flash, masks
  from jaxpe.attention import kernels as attn_kernels
  from jaxpe.train import host_devices

  lengths = (4096,) if quick else (16384, 65536)
  heads, head_dim = 16, 64
  slopes = np.asarray(alibi_slopes(heads), np.float32)
  rows = []
  for t_len in lengths:
    for encoding, extra in (("rope", 0), ("rope_alibi", 2)):
      q = jax.ShapeDtypeStruct((1, t_len, heads, head_dim + extra), jnp.float32)
      v = jax.ShapeDtypeStruct((1, t_len, heads, head_dim), jnp.float32)
      positions = jnp.arange(t_len, dtype=jnp.int32)[None]

      def loss(q, k, v, extra=extra, positions=positions, t_len=t_len):
        spec = None
        if extra:
          spec = AlibiSpec(slopes=slopes, q_positions=positions, k_positions=positions, max_position=t_len)
        out = attn_kernels.attention(
          q,
          k,
          v,
          scale=head_dim**-0.5,
          mask=masks.AttentionMask(causal=True),
          alibi_spec=spec,
          precise_dims=extra,
          implementation="xla",
        )
        return out.sum()

      compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, v).compile()
      xla_gib = compiled.memory_analysis().temp_size_in_bytes / 2**30
      # the fused CPU kernel's own scratch (outside XLA's accounting), one per thread
      kernel_gib = 0.0
      if jax.default_backend() == "cpu" and cpu_flash.available():
        per_thread = cpu_flash.workspace_bytes(t_len, t_len, head_dim + extra, head_dim, extra)
        kernel_gib = per_thread * host_devices.cores() / 2**30
      gib = xla_gib + kernel_gib
      dense_gib = 4 * heads * t_len**2 / 2**30  # one float32 [1, N, T, T] score array
      rows.append(
        row(
          "attention",
          f"{encoding} on xla (blockwise), T {t_len}, fwd+bwd temporaries, B 1 N {heads} H {head_dim}",
          gib,
          "GiB",
          **({"ratio": gib, "vs": "1 GiB", "goal": "<= 1.0"} if t_len == 16384 else {}),
          dense_score_array_gib=dense_gib,
          xla_temporaries_gib=xla_gib,
          cpu_kernel_workspace_gib=kernel_gib,
        )
      )
  return rows


def scale_rows(*, quick: bool) -> list[Row]:
  """``scale_bench.py --part meshes``: the fastest mesh per device count, step time vs 1 device."""
  script = HERE / "scale_bench.py"
  if quick or not script.is_file():
    return []
  text = _subprocess_rows(
    [str(script), "--part", "meshes", "--steps", "2", "batch_size=8", "seq_len=128"], timeout=600
  )
  best: dict[int, tuple[float, str, float]] = {}
  for line in text.splitlines():
    m = re.match(r"\s*(\d+)\s+(\(\d+, \d+, \d+\))\s+([\d.]+)\s+([\d.]+)", line)
    if m:
      n, mesh, secs, rel = int(m[1]), m[2], float(m[3]), float(m[4])
      if n not in best or secs < best[n][0]:
        best[n] = (secs, mesh, rel)
  rows = [
    row(
      "scale",
      f"default model B 8 x T 128 on {n} fake devices, mesh {mesh}",
      secs * 1e3,
      "ms",
      ratio=rel,
      vs="1 device (time)",
    )
    for n, (secs, mesh, rel) in sorted(best.items())
  ]
  # context parallelism: the sequence split over the mesh's context axis, all-gather and ring
  try:
    text = _subprocess_rows(
      [str(script), "--part", "context", "--steps", "2", "batch_size=8", "seq_len=128"], timeout=1500
    )
  except subprocess.SubprocessError as err:  # keep the mesh rows; say what failed
    print(f"scale: context-parallel steps not measured: {err}", file=sys.stderr)
    return rows
  for line in text.splitlines():
    m = re.match(
      r"context\s+(\(\d+, \d+, \d+, \d+\))\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line
    )
    if m:
      mesh, strategy, secs, rel, args_mib, temp_mib = (
        m[1],
        m[2],
        float(m[3]),
        float(m[4]),
        float(m[5]),
        float(m[6]),
      )
      how = "" if strategy == "-" else f", {strategy}"
      rows.append(
        row(
          "scale",
          f"context-parallel step, default model B 8 x T 128, mesh (d,f,t,c) {mesh}{how}",
          secs * 1e3,
          "ms",
          ratio=rel,
          vs="mesh (1, 1, 1, 1) (time)",
          temp_mib_per_device=temp_mib,
          args_mib_per_device=args_mib,
        )
      )
  return rows


def machine() -> dict:
  cpu = next(
    (
      line.split(":", 1)[1].strip()
      for line in _read("/proc/cpuinfo").splitlines()
      if line.startswith("model name")
    ),
    platform.processor(),
  )
  mem = re.search(r"MemTotal:\s+(\d+) kB", _read("/proc/meminfo"))
  return {
    "cpu": cpu,
    "cores": os.cpu_count(),
    "memory_gib": round(int(mem[1]) / 2**20, 1) if mem else None,
    "platform": platform.platform(),
    "devices": [str(d) for d in jax.devices()],
  }


def _read(path: str) -> str:
  try:
    return Path(path).read_text()
  except OSError:
    return ""


def versions() -> dict:
  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def commit() -> str:
  try:
    sha = subprocess.run(
      ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return sha + ("-dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def goal_met(r: Row) -> bool | None:
  goal, ratio = r.get("goal"), r.get("ratio")
  if not goal or ratio is None:
    return None
  op, value = goal.split()
  return ratio >= float(value) if op == ">=" else ratio <= float(value)


def table(rows: list[Row]) -> str:
  lines = ["| group | benchmark | figure | ratio | against | goal |", "|---|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['ratio']:.2f}" if r.get("ratio") is not None else ""
    met = goal_met(r)
    goal = "" if met is None else f"{r['goal']} {'met' if met else '**not met**'}"
    lines.append(
      f"| {r['group']} | {r['name']} | {r['value']:.4g} {r['unit']} | {ratio} | {r.get('vs', '')} | {goal} |"
    )
  return "\n".join(lines)


def default_results_dir() -> Path:
  """``$XDG_CACHE_HOME/jaxpe/benchmarks`` (``~/.cache/jaxpe/benchmarks`` without it): records stay
  outside the checkout unless ``--results-dir`` says otherwise."""
  cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return Path(cache) / "jaxpe" / "benchmarks"


def run(groups: list[str], *, quick: bool) -> tuple[list[Row], dict]:
  small = quick
  rows: list[Row] = []
  rows += ops_bench.ceiling_rows(ops_bench.ceilings(small=small))
  seconds = {}
  for group in groups:
    t0 = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] {group} ...", file=sys.stderr, flush=True)
    if group == "ops":
      rows += ops_bench.op_rows(small=small)
    elif group == "attention":
      rows += attention_rows(quick=quick)
      rows += xla_memory_rows(quick=quick)
    elif group == "scale":
      rows += scale_rows(quick=quick)
    elif group == "train":
      rows += train_bench.train_rows(small=small)
    elif group == "bloom":
      rows += bloom_bench.bloom_rows(small=small)
    elif group == "generate":
      rows += generate_bench.generate_rows(quick=quick)
    elif group == "growth":
      rows += train_bench.growth_rows(small=small)
    seconds[group] = round(time.time() - t0, 1)
  return rows, seconds


def readme_block(record: dict) -> str:
  m = record["machine"]
  load = record["load_average"]
  return "\n".join(
    [
      BEGIN,
      f"`{record['command']}` at commit `{record['commit']}`, {record['date']}, {record['wall_seconds']:.0f} s; "
      f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; load average {load['start']:.1f} at the start, "
      f"{load['end']:.1f} at the end; jax {record['versions']['jax']}, torch {record['versions']['torch']}, "
      f"transformers {record['versions']['transformers']}. Ratios are measured within the run; "
      "goals are issues 12's and 21's.",
      "",
      table(record["rows"]),
      END,
    ]
  )


def update_readme(readme: Path, record: dict) -> None:
  text = readme.read_text()
  block = readme_block(record)
  pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
  if not pattern.search(text):
    raise ValueError(f"{readme} has no block between {BEGIN!r} and {END!r}")
  readme.write_text(pattern.sub(lambda _: block, text))


def history(results_dir: Path) -> list[dict]:
  return [json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))]


def plot_history(records: list[dict], out: Path) -> None:
  """Ratios of the rows with a goal, one line each, over the records (full runs and quick runs
  apart: their shapes differ)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 5), squeeze=False)
  for ax, quick in zip(axes[0], (False, True)):
    recs = [r for r in records if r.get("quick") == quick]
    series: dict[str, list[tuple[int, float]]] = {}
    for i, rec in enumerate(recs):
      for r in rec["rows"]:
        if r.get("goal") and r.get("ratio") is not None:
          series.setdefault(r["name"], []).append((i, r["ratio"]))
    for name, points in series.items():
      ax.plot(*zip(*points), "o-", label=name[:50])
    ax.set_xticks(range(len(recs)), [f"{r['date'][:10]}\n{r['commit'][:7]}" for r in recs], fontsize=7)
    ax.set_title("--quick runs" if quick else "full runs")
    ax.set_ylabel("ratio (see the table for its reference)")
    if series:
      ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
    "--quick", action="store_true", help="small shapes (about 7 min on 2 CPU cores: 440 s measured)"
  )
  parser.add_argument("--only", nargs="+", choices=GROUPS, help="run only these groups")
  parser.add_argument(
    "--results-dir",
    type=Path,
    default=default_results_dir(),
    help="where records are written and read (default: %(default)s, outside the checkout; "
    "benchmarks/results holds the committed ones)",
  )
  parser.add_argument("--no-record", action="store_true", help="do not write a JSON record")
  parser.add_argument("--plot", action="store_true", help="plot the history to <results-dir>/history.png")
  parser.add_argument(
    "--update-readme", action="store_true", help="rewrite docs/results.md's block from the newest record"
  )
  parser.add_argument("--readme", type=Path, default=ROOT / "docs" / "results.md")
  parser.add_argument("--no-run", action="store_true", help="run nothing (with --plot / --update-readme)")
  args = parser.parse_args(argv)
  record = None
  if not args.no_run:
    groups = [g for g in GROUPS if g != "ceiling" and (args.only is None or g in args.only)]
    start = time.time()
    load_start = os.getloadavg()[0]
    rows, seconds = run(groups, quick=args.quick)
    record = {
      "command": "python benchmarks/run.py"
      + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
      "commit": commit(),
      "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
      "quick": args.quick,
      "groups": groups,
      "group_seconds": seconds,
      "wall_seconds": time.time() - start,
      "machine": machine(),
      "load_average": {"start": load_start, "end": os.getloadavg()[0]},
      "versions": versions(),
      "rows": rows,
    }
    print(table(rows))
    print(
      f"\nload average {load_start:.1f} -> {record['load_average']['end']:.1f}; {record['wall_seconds']:.0f} s"
    )
    if not args.no_record:
      args.results_dir.mkdir(parents=True, exist_ok=True)
      path = args.results_dir / f"{record['date'].replace(':', '').replace('-', '')}-{record['commit']}.json"
      path.write_text(json.dumps(record, indent=1) + "\n")
      print(f"record: {path}")
  if args.plot or args.update_readme:
    records = history(args.results_dir)
    if args.plot:
      plot_history(records, args.results_dir / "history.png")
      print(f"history: {args.results_dir / 'history.png'}")
    if args.update_readme:
      # the newest run of every group (an --only record holds a few rows; older records lack "groups")
      complete = [
        r for r in records if not r.get("quick") and len(r.get("groups", GROUPS[1:])) >= len(GROUPS) - 1
      ]
      full = complete or [r for r in records if not r.get("quick")] or records
      if not full:
        raise SystemExit(f"no records in {args.results_dir}")
      update_readme(args.readme, full[-1])
      print(f"updated {args.readme} from the record of {full[-1]['date']}")
  return record or {}


if __name__ == "__main__":
  main()
