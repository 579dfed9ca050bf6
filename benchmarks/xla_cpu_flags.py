"""XLA:CPU's library flags (YNNPACK, XNNPACK, oneDNN) on jaxpe's train step and on its matmuls.

  python benchmarks/xla_cpu_flags.py [--size 512|128|both] [--rounds 5] [--steps 4] [--no-matmuls]
                                     [--configs default,ynn_off,...]

Every configuration compiles the same lowered program in one process with its own XLA options
(``lowered.compile(compiler_options=...)``: the ``DebugOptions`` fields that ``XLA_FLAGS`` sets,
per compilation), so the configurations are timed alternately in one process (``ceilings.alternate``,
medians) and their ratios to the default are free of the machine's drift. For each configuration
and size (``train_bench.SIZES``, on the CPU devices ``jaxpe-train`` uses):

  * what the compiled step holds: the library fusions (``__ynn_fusion``, ``__onednn_fusion``, ...),
    plain ``dot`` thunks, custom calls and XLA's own loop fusions, counted in ``compiled.as_text()``;
  * the step's median time and its ratio to the default's;
  * the losses of ``--steps`` steps from the same initial state, and their largest relative
    difference from the default's (float32 rounding: a few 1e-7; after updates a few 1e-6);
  * with matmuls, the step's matmul ceiling (``ceilings.decoder_matmuls``, each shape and operand
    layout alone, best round) compiled with the same options, and its ratio to the default's.

A configuration XLA cannot compile is reported with its error; one whose program crashes the
process (``SIGILL``: the oneDNN fusions in jaxlib 0.10.2) is left out unless ``--configs`` names it.
The equivalent ``XLA_FLAGS`` of each configuration is printed with it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np
import train_bench
from ceilings import alternate, best_by_shape, ceiling_seconds, decoder_matmuls, median

from jaxpe.train import host_devices

T = "LIBRARY_FUSION_TYPE_"
CONFIGS: dict[str, dict] = {
  "default": {},
  # YNNPACK (XNNPACK's successor): the default fuses dots with their elementwise / reduce neighbours
  "ynn_off": {"xla_cpu_experimental_ynn_fusion_type": ""},
  "ynn_individual_dot": {"xla_cpu_experimental_ynn_fusion_type": T + "INDIVIDUAL_DOT"},
  "ynn_dot": {"xla_cpu_experimental_ynn_fusion_type": T + "DOT"},
  "ynn_dot_eltwise_reduce": {"xla_cpu_experimental_ynn_fusion_type": f"{T}DOT,{T}ELTWISE,{T}REDUCE"},
  # oneDNN fusions (need xla_cpu_use_onednn); with YNN on, YNN takes the dots it claims first
  "onednn_dot": {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_fusion_type": T + "DOT"},
  "onednn_dot_ynn_off": {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": T + "DOT",
    "xla_cpu_experimental_ynn_fusion_type": "",
  },
  "onednn_dot_eltwise_reduce_ynn_off": {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": f"{T}DOT,{T}ELTWISE,{T}REDUCE",
    "xla_cpu_experimental_ynn_fusion_type": "",
  },
  "onednn_custom_call": {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_custom_call": True},
  "onednn_custom_call_ynn_off": {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_custom_call": True,
    "xla_cpu_experimental_ynn_fusion_type": "",
  },
  # XNNPACK (the older library)
  "xnnpack_off": {"xla_cpu_use_xnnpack": False},
  "xnn_dot_ynn_off": {
    "xla_cpu_experimental_xnn_fusion_type": T + "DOT",
    "xla_cpu_experimental_ynn_fusion_type": "",
  },
  "xnn_graph_greedy": {"xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY"},
  # XLA's own code generation
  "vector_width_512": {"xla_cpu_prefer_vector_width": 512},
  "eigen_single_thread": {"xla_cpu_multi_thread_eigen": False},
}
"""Name -> ``compiler_options`` (``DebugOptions`` fields, as ``XLA_FLAGS`` names them)."""

SIGILL = ("onednn_dot", "onednn_dot_ynn_off", "onednn_dot_eltwise_reduce_ynn_off")
"""Configurations whose train step kills the process with SIGILL in jaxlib 0.10.2 (oneDNN Graph:
``partition compile failed`` on a dot with an elementwise epilogue; benchmarks/results/
xla_cpu_flags.md): left out of the default ``--configs``, kept for ``--matmul-configs`` (plain
products run) and for trying another jaxlib."""


def xla_flags(options: dict) -> str:
  """The ``XLA_FLAGS`` string of ``compiler_options`` (enum lists in the flags' short names)."""

  def value(v):
    if isinstance(v, bool):
      return str(v).lower()
    return str(v).replace(T, "").lower() if isinstance(v, str) and T in v else str(v)

  return " ".join(f"--{k}={value(v)}" for k, v in options.items()) or "(none)"


_FUSION_KIND = re.compile(r'"fusion_config":\{"kind":"(\w+)"')


def hlo_summary(text: str) -> dict[str, int]:
  """Counts of the thunks of a compiled module's entry computation: library fusions by kind,
  XLA's fusions by kind (``kLoop``...), custom calls by target, and other ops by name."""
  entry = text[text.index("\nENTRY") :]
  counts: collections.Counter = collections.Counter()
  for line in entry.splitlines()[1:]:
    m = re.search(r"= \S+ ([a-z][\w-]*)\(", line)
    if not m or m[1] in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
      continue
    op = m[1]
    if op == "fusion":
      kind = _FUSION_KIND.search(line)
      op = kind[1] if kind else re.search(r"kind=(k\w+)", line)[1]
    elif op == "custom-call":
      op = "custom-call " + re.search(r'custom_call_target="([^"]+)"', line)[1]
    counts[op] += 1
  return dict(counts.most_common())


def alternate_cpu(fns, *, rounds: int, warmup: int = 1):
  """``ceilings.alternate`` that also records the process's CPU seconds (all threads) per call:
  on a machine other processes load, CPU time is less inflated by waiting than wall time."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  wall: dict = {name: [] for name in fns}
  cpu: dict = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      c0, t0 = time.process_time(), time.perf_counter()
      fn()
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return wall, cpu


def compile_all(lowered, names):
  """``{name: compiled or error string}`` for the configurations ``names``."""
  out = {}
  for name in names:
    try:
      out[name] = lowered.compile(compiler_options=CONFIGS[name])
    except Exception as err:  # noqa: BLE001  an option XLA refuses is a result
      out[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
  return out


def step_report(label, cfg, batch, seq, names, *, rounds, steps):
  """Compiles the trainer step per configuration and prints its HLO summary, losses and time."""
  split = host_devices.auto_count(
    train_bench.TrainConfig(model=cfg, batch_size=batch, seq_len=seq, mesh_shape=(-1, 1, 1, 1)),
    len(jax.devices()),
  )
  trainer = train_bench.trainer_step(cfg, batch=batch, seq=seq, devices=split)
  state, tokens = trainer.args()
  lowered = trainer.step.lower(state, tokens)
  t0 = time.perf_counter()
  compiled = compile_all(lowered, names)
  print(
    f"\n## {label}, B {batch} x T {seq}, {split} CPU devices (compiled {len(names)} in {time.perf_counter() - t0:.0f} s)"
  )
  ok = {n: c for n, c in compiled.items() if not isinstance(c, str)}
  texts = {n: c.as_text() for n, c in ok.items()}
  for name, c in compiled.items():
    if isinstance(c, str):
      print(f"- {name} [{xla_flags(CONFIGS[name])}]: does not compile: {c}")
  # losses of `steps` steps from the same initial state
  losses = {}
  for name, c in ok.items():
    st = jax.tree.map(jnp.copy, trainer.initial)
    out = []
    for _ in range(steps):
      st, metrics = c(st, tokens)
      out.append(float(metrics["loss"]))
    losses[name] = np.array(out)
  holders = {n: [jax.tree.map(jnp.copy, trainer.initial)] for n in ok}

  def runner(name):
    c, holder = ok[name], holders[name]

    def run():
      holder[0], metrics = c(holder[0], tokens)
      jax.block_until_ready((holder[0], metrics))

    return run

  load0 = os.getloadavg()[0]
  times, cpu = alternate_cpu({n: runner(n) for n in ok}, rounds=rounds)
  load1 = os.getloadavg()[0]
  t_def = median(times["default"]) if "default" in times else None
  print(f"load average (1 min) {load0:.2f} -> {load1:.2f}; {rounds} alternating rounds, medians")
  print(
    "| configuration | XLA_FLAGS | step ms | / default (per-round median) | CPU ms | CPU / default "
    "| max rel. loss diff vs default | compiled HLO |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for name in ok:
    t = median(times[name])
    # the median of the per-round ratios (each round runs every configuration once, back to back)
    paired = median([a / b for a, b in zip(times[name], times["default"], strict=True)]) if t_def else None
    ratio = f"{t / t_def:.3f} ({paired:.3f})" if t_def else ""
    diff = np.max(np.abs(losses[name] / losses["default"] - 1)) if "default" in losses else float("nan")
    same = next((m for m in ok if texts[m] == texts[name]), name)  # the first with this program
    hlo = f"same program as {same}" if same != name else hlo_summary(texts[name])
    cpu_ratio = median(cpu[name]) / median(cpu["default"]) if t_def else float("nan")
    print(
      f"| {name} | `{xla_flags(CONFIGS[name])}` | {t * 1e3:.1f} | {ratio} | {median(cpu[name]) * 1e3:.0f}"
      f" | {cpu_ratio:.3f} | {diff:.1e} | {hlo} |",
      flush=True,
    )
  print("losses (default):", losses.get("default"))
  return split


def matmul_report(cfg, batch, seq, names, *, rounds):
  """The matmul ceiling of the step's shapes under each configuration (best round per shape and
  layout), its seconds and ratio to the default's."""
  matmuls = decoder_matmuls(cfg, batch, seq)
  shapes = list(dict.fromkeys(mm.shape for mm in matmuls))
  fns, sums = {}, {}
  for i, (b, m, k, n) in enumerate(shapes):
    lead = () if b == 1 else (b,)
    key = jax.random.key(i)
    a = {
      "NN": (jax.random.normal(key, (*lead, m, k)), jax.random.normal(key, (*lead, k, n))),
      "TN": (jax.random.normal(key, (*lead, k, m)), jax.random.normal(key, (*lead, k, n))),
      "NT": (jax.random.normal(key, (*lead, m, k)), jax.random.normal(key, (*lead, n, k))),
    }
    prods = {
      "NN": lambda x, y: jnp.matmul(x, y),
      "TN": lambda x, y: jnp.matmul(x.mT, y),
      "NT": lambda x, y: jnp.matmul(x, y.mT),
    }
    for o, (x, y) in a.items():
      lowered = jax.jit(prods[o]).lower(x, y)
      for name, c in compile_all(lowered, names).items():
        if not isinstance(c, str):
          fns[name, ((b, m, k, n), o)] = lambda c=c, x=x, y=y: jax.block_until_ready(c(x, y))
  times = alternate(fns, rounds=rounds)
  for name in names:
    per = best_by_shape({k[1]: v for k, v in times.items() if k[0] == name})
    sums[name] = ceiling_seconds(matmuls, per) if len(per) == len(shapes) else None
  print("| configuration | matmul ceiling ms at the step's shapes | / default |")
  print("|---|---|---|")
  for name in names:
    if sums[name] is not None:
      print(f"| {name} | {sums[name] * 1e3:.1f} | {sums[name] / sums['default']:.3f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", choices=("512", "128", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--configs", default=",".join(n for n in CONFIGS if n not in SIGILL))
  parser.add_argument("--matmul-configs", default="default,ynn_off,ynn_individual_dot,onednn_dot_ynn_off")
  parser.add_argument("--no-matmuls", action="store_true")
  args = parser.parse_args()
  names = args.configs.split(",")
  if "default" not in names:
    names.insert(0, "default")
  print(
    f"jax {jax.__version__}, jaxlib {jaxlib.version.__version__}, {host_devices.cores()} cores, devices {jax.devices()}"
  )
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; load average {os.getloadavg()}")
  for label, cfg, (batch, seq), _ in train_bench.SIZES:
    if args.size != "both" and not label.startswith(f"D {args.size}"):
      continue
    step_report(label, cfg, batch, seq, names, rounds=args.rounds, steps=args.steps)
    if not args.no_matmuls:
      matmul_report(cfg, batch, seq, args.matmul_configs.split(","), rounds=3)
  print(f"load average at the end {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
  main()
