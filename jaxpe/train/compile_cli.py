"""The ``jaxpe-compile`` command: will this run fit the chips, before renting them? Compiles the run's
real train step (sharded over the config's mesh of the target's devices) and its sample's generation
for a target accelerator, on this host (a CPU is enough), and prints per device what the compiler
reports.

jaxpe-compile --target v5e-8                                  # the built-in config "default"
jaxpe-compile --config tiny --target h100 model.attn_implementation=flash
jaxpe-compile --config my.yaml --target v6e-8 mesh_shape=[2,4,1,1] model.remat=full batch_size=64
jaxpe-compile --target v5p-16 --json sizes.json               # two hosts' worth of v5p chips

Targets: v5e-N and v6e-N (N chips: 4, 8, 16, ... 256), v5p-N and v4-N (N TensorCores, two per
chip: 8, 16, ... 128), h100, h200, a100 (one GPU) and h100-8, h200-8, a100-8 (one host of 8). A TPU
target needs libtpu (pip install "jax[tpu]==<the installed jax>"; jaxpe's test extra installs it), a
GPU target jax's CUDA plugin (pip install "jaxpe[gpu-compile]", several GB); a missing one is named.

Per program and device: HBM needed (arguments, outputs, outputs aliasing the donated state,
temporaries, generated code: XLA's memory_analysis) against the chip's memory, whether it fits, the
compiled FLOPs (cost_analysis) and the model's, a roofline step time (compute at the chip's dense bf16
peak vs. bytes accessed at its HBM bandwidth: jaxpe.train.targets.CHIPS, with sources) and the MFU
estimate it allows (an upper bound), and the custom calls (kernels) the program holds. Detail:
docs/accelerator.md.

Exit status: 0 every program fits, 1 a program does not fit (its sizes are printed), 2 a usage or
configuration error, a missing compiler (one line; --debug shows the traceback) or a program the
target's compiler refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

from jaxpe.errors import MissingExtraError
from jaxpe.train import aot, run_files, run_guard, sharding, targets
from jaxpe.train import config as config_lib
from jaxpe.train.cli import config_parser, resolve_config

GiB = 2**30


def _gib(n: float) -> str:
  """Bytes as GiB, or MiB below 1 GiB."""
  return f"{n / GiB:,.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:,.2f} MiB"


def format_report(r: aot.ProgramReport) -> str:
  """The lines ``jaxpe-compile`` prints for one compiled program."""
  verdict = "fits" if r.fits else f"DOES NOT FIT (short by {_gib(r.needed - r.capacity)})"
  if r.refused:
    lines = [
      f"{r.name} (per device; refused by the compiler after {r.compile_seconds:.0f} s)",
      f"  needed           {_gib(r.needed):>14} of {_gib(r.capacity)} HBM (as the compiler counts them): {verdict}",
    ]
    return "\n".join(lines + [f"  note: {n}" for n in r.notes])
  lines = [
    f"{r.name} (per device; compiled in {r.compile_seconds:.0f} s)",
    f"  arguments        {_gib(r.arguments):>14}",
    f"  outputs          {_gib(r.outputs):>14}",
    f"  aliased (donated) {'-' + _gib(r.aliased):>13}",
    f"  temporaries      {_gib(r.temporaries):>14}",
    f"  generated code   {_gib(r.code):>14}",
    f"  needed           {_gib(r.needed):>14} of {_gib(r.capacity)} HBM ({r.needed / r.capacity:.1%}): {verdict}",
  ]
  flops = f"  FLOPs per step   {r.flops:.3e} compiled (XLA's count)"
  if r.model_flops is not None:
    flops += f", {r.model_flops:.3e} model"
  lines.append(flops)
  work = max(r.flops * r.loop_scale, (r.model_flops or 0) * r.remat_factor)
  moved = r.bytes_accessed * r.loop_scale
  roof = (
    f"  roofline         >= {r.step_seconds * 1e3:,.2f} ms per step "
    f"(compute {work / r.peak_flops * 1e3:,.2f} ms at {r.peak_flops / 1e12:,.0f} TFLOP/s, "
    f"HBM {moved / r.bandwidth * 1e3:,.2f} ms for {_gib(moved)} at {r.bandwidth / 1e9:,.0f} GB/s)"
  )
  lines.append(roof)
  if r.mfu is not None:
    lines.append(f"  MFU estimate     <= {r.mfu:.0%} (model FLOPs over the roofline time at peak)")
  calls = ", ".join(aot.describe_call(c) for c in r.calls) or "none"
  lines.append(f"  custom calls     {calls}")
  lines += [f"  note: {n}" for n in r.notes]
  return "\n".join(lines)


def main(argv: list[str] | None = None, *, prog: str = "jaxpe-compile") -> int:
  """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
  parser = config_parser(prog, __doc__)
  parser.add_argument(
    "--target",
    default="v5e-8",
    metavar="TARGET",
    help=f"the chips (default: %(default)s): {', '.join(targets.TARGETS)}",
  )
  parser.add_argument("--no-generate", action="store_true", help="compile the train step only")
  parser.add_argument("--json", default=None, metavar="PATH", help="also write the reports as JSON to PATH")
  parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
  parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.d_model=64")
  args = parser.parse_intermixed_args(argv)

  def body() -> int:
    cfg = config_lib.load_config(resolve_config(args.config), args.overrides, unique_overrides=True)
    t = targets.target(args.target)
    # the run's devices are the target's compile-only devices: nothing runs on this host's
    jax.config.update("jax_platforms", "cpu")
    try:
      devices = targets.compile_devices(t)
    except MissingExtraError as e:
      print(f"{prog}: error: {e}", file=sys.stderr)
      return 2
    spec = t.spec
    print(
      f"target {t.name}: {t.chips} x {spec.name} ({len(devices)} compile-only devices, topology {t.topology}); "
      f"per device {_gib(targets.device_memory(t, devices))} HBM, peak {spec.peak_flops / 1e12:,.0f} TFLOP/s "
      f"bf16 per chip, {spec.hbm_bandwidth / 1e9:,.0f} GB/s ({spec.source})",
      flush=True,
    )
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    try:
      reports = aot.compile_run(cfg, t.name, generation=not args.no_generate, log=log)
    except MissingExtraError as e:
      print(f"{prog}: error: {e}", file=sys.stderr)
      return 2
    except ValueError:
      raise
    except Exception as e:  # noqa: BLE001  (the target's compiler refused a program)
      if args.debug:
        raise
      print(f"{prog}: error: the {t.name} compiler refused the run: {run_guard.one_line(e)}", file=sys.stderr)
      return 2
    dims = sharding.mesh_dims(cfg.mesh_shape, len(devices))
    print(f"mesh (data, fsdp, tensor, context): {list(dims)} over {len(devices)} devices")
    for r in reports:
      print(format_report(r))
    if args.json:
      Path(args.json).write_text(
        run_files.json_text(
          {
            "target": t.name,
            "config": cfg.model_dump(mode="json"),
            "programs": [r.as_dict() for r in reports],
          },
          indent=1,
        )
      )
    short = [r for r in reports if not r.fits]
    if short:
      sizes = "; ".join(f"{r.name} needs {_gib(r.needed)} per device of {_gib(r.capacity)}" for r in short)
      print(
        f"{prog}: does not fit {t.name}: {sizes}. Shrink batch_size (or raise grad_accum_steps), set "
        "model.remat=full, split the state over more devices (mesh_shape's fsdp), or pick a larger target",
        file=sys.stderr,
      )
      return 1
    return 0

  return run_guard.run_cli(prog, body, debug=args.debug)


def run(prog: str = "jaxpe-compile") -> None:
  """The console entry point: ``main()`` on ``sys.argv``, then exit with its status."""
  run_guard.exit_process(main(prog=prog))


if __name__ == "__main__":
  run()
