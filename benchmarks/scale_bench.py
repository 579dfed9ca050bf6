"""Scaling measurements on fake CPU devices: step time and per-device memory of the default model
under every (data, fsdp, tensor) mesh of 1, 2, 4 and 8 devices, train-step compile time with
and without ``scan_layers`` at 4, 16 and 48 layers, and context-parallel train steps (the sequence
split over the ``context`` axis, all-gather and ring) per mesh.

    python benchmarks/scale_bench.py                 # everything (~10 min on 2 cores)
    python benchmarks/scale_bench.py --part meshes   # or: --part compile, --part context

Memory is XLA's compiled ``memory_analysis()`` of the train step, per device: arguments (the
device's share of parameters, optimizer state and batch) and temporaries (activations, gradients).
Fake CPU devices share the host's cores, so step times measure the partitioned program's overhead,
not a speed-up; on a shared machine all times are noisy - compare ratios within one run.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpe.train import (
  sharding,
  steps,
  trainer,  # noqa: E402
)
from jaxpe.train.config import load_config  # noqa: E402

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def meshes(n: int, num_heads: int):
  """All (data, fsdp, tensor) shapes of n devices with tensor dividing the head count."""
  for d, f in itertools.product(range(1, n + 1), repeat=2):
    if n % (d * f) == 0 and num_heads % (n // (d * f)) == 0:
      yield (d, f, n // (d * f))


def compiled_step(cfg, shape):
  n = int(np.prod(shape))
  mesh = sharding.make_mesh(shape, devices=jax.devices()[:n])
  sharding.check_divisible(cfg.model, mesh, cfg.batch_size, seq_len=cfg.seq_len, rules=cfg.logical_rules)
  graphdef, state, shardings = trainer.create_state(cfg, mesh)
  batch_sharding = sharding.batch_sharding(mesh, cfg.logical_rules)
  step = steps.make_train_step(
    graphdef,
    mesh=mesh,
    rules=cfg.logical_rules,
    state_shardings=shardings,
    batch_sharding=batch_sharding,
    grad_accum_steps=cfg.grad_accum_steps,
  )
  batch = np.random.default_rng(0).integers(0, 256, (cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
  batch = jax.device_put(batch, batch_sharding)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  return compiled, state, batch, time.perf_counter() - t0


def run_meshes(cfg, steps_timed: int) -> None:
  print(
    f"default model: d_model {cfg.model.d_model}, {cfg.model.num_layers} layers, batch {cfg.batch_size} x {cfg.seq_len}"
  )
  print(
    f"{'devices':>7} {'mesh (d,f,t)':>13} {'step s':>8} {'vs 1 dev':>8} {'args MiB/dev':>12} {'temp MiB/dev':>12}"
  )
  base = None
  for n in (1, 2, 4, 8):
    for shape in meshes(n, cfg.model.num_heads):
      compiled, state, batch, _ = compiled_step(cfg, shape)
      state, out = compiled(state, batch)  # warm-up
      jax.block_until_ready(out)
      t0 = time.perf_counter()
      for _ in range(steps_timed):
        state, out = compiled(state, batch)
      jax.block_until_ready(out)
      dt = (time.perf_counter() - t0) / steps_timed
      base = base or dt
      mem = compiled.memory_analysis()
      print(
        f"{n:>7} {str(shape):>13} {dt:>8.3f} {dt / base:>8.2f} {mem.argument_size_in_bytes / 2**20:>12.2f} "
        f"{mem.temp_size_in_bytes / 2**20:>12.2f}",
        flush=True,
      )


def run_compile(cfg) -> None:
  print(f"{'layers':>6} {'loop compile s':>14} {'scan compile s':>14} {'loop/scan':>9}")
  for layers in (4, 16, 48):
    times = []
    for scan in (False, True):
      c = cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"num_layers": layers, "scan_layers": scan})}
      )
      times.append(compiled_step(c, (1, 1, 1))[3])
    print(f"{layers:>6} {times[0]:>14.1f} {times[1]:>14.1f} {times[0] / times[1]:>9.1f}", flush=True)


CONTEXT_MESHES = ((1, 1, 1, 1), (1, 1, 1, 2), (1, 1, 1, 4), (1, 1, 1, 8), (2, 1, 1, 4), (1, 2, 1, 4))
"""(data, fsdp, tensor, context) meshes ``context_step_times`` times by default."""


def context_step_times(cfg, steps_timed: int, shapes=CONTEXT_MESHES, strategies=("all_gather", "ring")):
  """Train-step time and per-device memory of ``cfg`` with the sequence split over each mesh's
  ``context`` axis (``seq_len`` must divide by 2 x context), for each attention ``strategy``
  (``model.context_attention``); the first row (context 1) is the reference of the ratios.

  Returns a list of dicts ``{mesh, strategy, step_s, vs_first, args_mib, temp_mib}`` (one line each
  is printed as it is measured: ``context <mesh> <strategy> <s> <ratio> <MiB> <MiB>``). Needs the
  devices the meshes name (8 fake CPU devices: run it in a process started with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, as this script sets).
  """
  rows, base = [], None
  for shape in shapes:
    for strategy in strategies if shape[3] > 1 else strategies[:1]:
      c = cfg.model_copy(update={"model": cfg.model.model_copy(update={"context_attention": strategy})})
      compiled, state, batch, _ = compiled_step(c, shape)
      state, out = compiled(state, batch)  # warm-up
      jax.block_until_ready(out)
      t0 = time.perf_counter()
      for _ in range(steps_timed):
        state, out = compiled(state, batch)
      jax.block_until_ready(out)
      dt = (time.perf_counter() - t0) / steps_timed
      base = base or dt
      mem = compiled.memory_analysis()
      row = dict(
        mesh=shape,
        strategy=strategy if shape[3] > 1 else "-",
        step_s=dt,
        vs_first=dt / base,
        args_mib=mem.argument_size_in_bytes / 2**20,
        temp_mib=mem.temp_size_in_bytes / 2**20,
      )
      rows.append(row)
      print(
        f"context {str(shape):>12} {row['strategy']:>10} {dt:>8.3f} {dt / base:>8.2f} {row['args_mib']:>12.2f} "
        f"{row['temp_mib']:>12.2f}",
        flush=True,
      )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", choices=("all", "meshes", "compile", "context"), default="all")
  parser.add_argument("--steps", type=int, default=3, help="timed steps per mesh")
  parser.add_argument("overrides", nargs="*", help="key=value config overrides")
  args = parser.parse_args()
  cfg = load_config(DEFAULT, args.overrides)
  print(
    f"jax {jax.__version__}, {jax.device_count()} fake CPU devices on {os.cpu_count()} cores (noisy: shared machine)"
  )
  if args.part in ("all", "meshes"):
    run_meshes(cfg, args.steps)
  if args.part in ("all", "compile"):
    run_compile(cfg)
  if args.part in ("all", "context"):
    print(f"context parallelism: batch {cfg.batch_size} x {cfg.seq_len}")
    print(
      f"{'':7} {'mesh (d,f,t,c)':>12} {'strategy':>10} {'step s':>8} {'vs first':>8} {'args MiB/dev':>12} {'temp MiB/dev':>12}"
    )
    context_step_times(cfg, args.steps)


if __name__ == "__main__":
  main()
