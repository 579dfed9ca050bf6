"""The ``jaxpe-train`` command: train a jaxpe decoder on byte-level text.

jaxpe-train                                      # defaults: stdlib corpus, the built-in config "default"
jaxpe-train --config tiny model.pos_encoding=alibi
jaxpe-train --config my.yaml --data my_corpus/ workdir=runs/mine num_steps=5000
jaxpe-train mesh_shape=[1,-1,2] model.scan_layers=true model.remat=full grad_accum_steps=4
jaxpe-train --config tiny --print-config           # every key: its value, default and description

--config takes a YAML file or the name of a built-in config (default, tiny; shipped in the
package). From a checkout, ``python train/train.py`` is the same command.

Two hosts (the same line on each, distributed.process_id=0 on 10.0.0.1 and 1 on the other host;
the workdir on a disk both see; or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID):
jaxpe-train workdir=/shared/runs/big mesh_shape=[2,-1,1] distributed.coordinator_address=10.0.0.1:8476 distributed.num_processes=2 distributed.process_id=0

Options and key=value overrides may come in any order. Exit status: 0 done (or stopped at
stop_at/max_seconds), 1 stopped on a non-finite step, 2 a usage or configuration error (one line;
--debug shows the traceback), 128 + N stopped by signal N after a checkpoint (143 SIGTERM, 130 Ctrl-C).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpe.train import config as config_lib
from jaxpe.train import config_keys, host_devices, memory_check, run_guard, sharding, trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
"""The built-in configs, shipped as package data (``jaxpe/configs/*.yaml``)."""


def builtin_configs(*, study: bool = False) -> list[str]:
  """The built-in names ``--config`` accepts besides a path: the training configs (``default``,
  ``tiny``), or with ``study=True`` the study configs (``study``, ``study_quick``)."""
  return sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem.startswith("study") == study)


def resolve_config(value: str | Path) -> Path:
  """The YAML file ``--config value`` means: ``value`` itself when it exists, else the built-in
  config of that name (``tiny`` or ``tiny.yaml`` -> ``jaxpe/configs/tiny.yaml``), else ``value``
  unchanged (the loader then names it as missing).

  Raises:
    FileNotFoundError: ``value`` is a bare name (no folder) that is neither a file nor a built-in
      config; the message lists the built-in names.
  """
  path = Path(value)
  if path.exists() or len(path.parts) != 1:
    return path
  builtin = CONFIGS / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
  if builtin.is_file():
    return builtin
  names = ", ".join(builtin_configs() + builtin_configs(study=True))
  raise FileNotFoundError(f"config file {str(value)!r} does not exist and is no built-in config ({names})")


def config_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
  """The parser of a command that takes a run's config: ``--config`` (a file or built-in name) and the
  config keys listed in the epilog (``jaxpe-train``, ``jaxpe-compile``)."""
  parser = argparse.ArgumentParser(
    prog=prog,
    description=description,
    epilog=config_keys.help_listing(),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--config",
    default="default",
    help=f"YAML config file, or a built-in name: {', '.join(builtin_configs())} (default: %(default)s)",
  )
  return parser


def main(argv: list[str] | None = None, *, prog: str = "train.py") -> int:
  """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit status; errors
  are one line on stderr prefixed with ``prog``."""
  parser = config_parser(prog, __doc__)
  parser.add_argument(
    "--data",
    default=None,
    help="text file or directory, taken verbatim (not YAML; default: Python stdlib sources)",
  )
  parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
  parser.add_argument(
    "--print-config",
    action="store_true",
    help="print the resolved config (every key, its value, default and description) as YAML and exit",
  )
  parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.d_model=64")
  args = parser.parse_intermixed_args(argv)

  def body() -> int:
    cfg = config_lib.load_config(
      resolve_config(args.config), args.overrides, data_path=args.data, unique_overrides=True
    )
    if args.print_config:
      print(config_keys.format_config(cfg))
      return 0
    # One XLA device per core on a CPU host (cpu_devices), before anything starts JAX's backend.
    host_devices.apply(cfg)
    # Multi-process runs start JAX's runtime before any other JAX use (the memory check lists the
    # devices); trainer.train's own call is then a no-op.
    sharding.initialize_distributed(cfg.distributed)
    # A huge model, batch or sample is one line, not an out-of-memory crash.
    memory_check.check_fits_memory(cfg)
    result = trainer.train(cfg)
    print(
      f"\nsteps: {result.step}  wall time: {result.wall_seconds:.0f} s  tokens/s: {result.tokens_per_second:,.0f}"
    )
    unigram = result.unigram_bits_per_byte  # 0 for a corpus of one repeated byte
    unit = result.unit  # byte (text), token (data.tokens) or answer (data.task)
    print(
      f"held-out bits/{unit}: {result.eval_bits_per_byte:.3f}  unigram bits/{unit}: {unigram:.3f}"
      + (
        f"  held-out bits/byte: {result.eval_bits_per_byte / result.bytes_per_token:.3f}"
        if result.bytes_per_token > 0
        else ""
      )
      + (f"  ratio: {result.eval_bits_per_byte / unigram:.1%}" if unigram > 0 else "")
    )
    print(f"loss curve: {Path(cfg.workdir) / 'loss.png'}\nsample:\n{result.sample}")
    return 0

  return run_guard.run_cli(prog, body, debug=args.debug)


def run(prog: str = "jaxpe-train") -> None:
  """The console entry point: ``main()`` on ``sys.argv``, then exit with its status."""
  run_guard.exit_process(main(prog=prog))


if __name__ == "__main__":
  run()
