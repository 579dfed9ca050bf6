"""Train short, test long: one small model per positional encoding, held-out bits/byte at 1x..8x the
training length (logic in ``jaxpe/study.py``; outputs in the study's workdir).

python train/study.py                                 # configs/study.yaml (all encodings)
python train/study.py --quick                         # configs/study_quick.yaml (a few minutes)
python train/study.py --data my_corpus/ workdir=runs/study_mine
python train/study.py encodings=[rope,alibi,rope_alibi_k2] train.num_steps=200

Rerunning with the same workdir reuses finished models and evaluations; an interrupted model resumes
from its last checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxpe.study import StudyInterrupted, load_study_config, model_train_config, run_study
from jaxpe.train import run_guard

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=None, help=f"study YAML (default: {CONFIGS / 'study.yaml'})")
  parser.add_argument("--quick", action="store_true", help="use configs/study_quick.yaml")
  parser.add_argument(
    "--data",
    default=None,
    help="text file or directory, taken verbatim (not YAML; default: Python stdlib sources)",
  )
  parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
  parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.num_steps=100")
  args = parser.parse_intermixed_args(argv)
  if args.quick and args.config:
    parser.error("--quick and --config are exclusive")
  path = args.config or CONFIGS / ("study_quick.yaml" if args.quick else "study.yaml")

  def body() -> int:
    study = load_study_config(path, args.overrides, data_path=args.data, unique_overrides=True)
    from jaxpe.train import sharding
    from jaxpe.train.memory_check import check_fits_memory

    sharding.initialize_distributed(study.train.distributed)  # before the memory check lists devices

    # A model too large for memory is one line before any training; the encodings share the
    # architecture, and learned positions add a table: the first and "learned" are the largest.
    for name in dict.fromkeys(n for n in study.encodings if n in (study.encodings[0], "learned")):
      check_fits_memory(model_train_config(study, name))
    try:
      run_study(study)
    except StudyInterrupted as e:
      print(e, file=sys.stderr)
      return 1
    print((Path(study.workdir) / "study.md").read_text())
    print(f"wrote {study.workdir}/study.md, study.json, bits_per_byte.png, loss_vs_position.png")
    return 0

  return run_guard.run_cli("study.py", body, debug=args.debug)


if __name__ == "__main__":
  run_guard.exit_process(main())
