"""Train a jaxpe decoder on byte-level text.

python train/train.py                                  # defaults: stdlib corpus, configs/default.yaml
python train/train.py --config configs/tiny.yaml model.pos_encoding=alibi
python train/train.py --data my_corpus/ workdir=runs/mine num_steps=5000
python train/train.py mesh_shape=[1,-1,2] model.scan_layers=true model.remat=full grad_accum_steps=4

Two hosts (the same line on each, distributed.process_id=0 on 10.0.0.1 and 1 on the other host;
the workdir on a disk both see; or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID):
python train/train.py workdir=/shared/runs/big mesh_shape=[2,-1,1] distributed.coordinator_address=10.0.0.1:8476 distributed.num_processes=2 distributed.process_id=0

Options and key=value overrides may come in any order. Exit status: 0 done (or stopped at
stop_at/max_seconds), 1 stopped on a non-finite step, 2 a usage or configuration error (one line;
--debug shows the traceback), 128 + N stopped by signal N after a checkpoint (143 SIGTERM, 130 Ctrl-C).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpe.train import run_guard

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
  parser.add_argument(
    "--data",
    default=None,
    help="text file or directory, taken verbatim (not YAML; default: Python stdlib sources)",
  )
  parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
  parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.d_model=64")
  args = parser.parse_intermixed_args(argv)

  from jaxpe.train.config import load_config
  from jaxpe.train.memory_check import check_fits_memory
  from jaxpe.train.trainer import train

  def body() -> int:
    cfg = load_config(args.config, args.overrides, data_path=args.data, unique_overrides=True)
    from jaxpe.train import sharding

    # Multi-process runs start JAX's runtime before any other JAX use (the memory check lists the
    # devices); trainer.train's own call is then a no-op.
    sharding.initialize_distributed(cfg.distributed)
    check_fits_memory(cfg)  # a huge model, batch or sample is one line, not an out-of-memory crash
    result = train(cfg)
    print(
      f"\nsteps: {result.step}  wall time: {result.wall_seconds:.0f} s  tokens/s: {result.tokens_per_second:,.0f}"
    )
    unigram = result.unigram_bits_per_byte  # 0 for a corpus of one repeated byte
    print(
      f"held-out bits/byte: {result.eval_bits_per_byte:.3f}  unigram bits/byte: {unigram:.3f}"
      + (f"  ratio: {result.eval_bits_per_byte / unigram:.1%}" if unigram > 0 else "")
    )
    print(f"loss curve: {Path(cfg.workdir) / 'loss.png'}\nsample:\n{result.sample}")
    return 0

  return run_guard.run_cli("train.py", body, debug=args.debug)


if __name__ == "__main__":
  run_guard.exit_process(main())
