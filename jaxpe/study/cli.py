"""The ``jaxpe-study`` command. Train short, test long: one small model per positional encoding,
held-out bits/byte at 1x..8x the training length (logic in ``jaxpe.study``; outputs in the study's
workdir).

jaxpe-study                                      # the built-in config "study" (all encodings)
jaxpe-study --quick                              # the built-in config "study_quick" (a few minutes)
jaxpe-study --data my_corpus/ workdir=runs/study_mine
jaxpe-study encodings=[rope,alibi,rope_alibi_k2] train.num_steps=200

--config takes a study YAML file or a built-in config's name. From a checkout,
``python train/study.py`` is the same command. Rerunning with the same workdir reuses finished models
and evaluations; an interrupted model resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxpe.study import StudyInterrupted, load_study_config, model_train_config, run_study
from jaxpe.train import host_devices, memory_check, run_guard, sharding
from jaxpe.train.cli import builtin_configs, resolve_config


def main(argv: list[str] | None = None, *, prog: str = "study.py") -> int:
  """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit status; errors
  are one line on stderr prefixed with ``prog``."""
  parser = argparse.ArgumentParser(
    prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--config",
    default=None,
    help=f"study YAML file, or a built-in name: {', '.join(builtin_configs(study=True))} (default: study)",
  )
  parser.add_argument("--quick", action="store_true", help="use the built-in config study_quick")
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

  def body() -> int:
    path = resolve_config(args.config or ("study_quick" if args.quick else "study"))
    study = load_study_config(path, args.overrides, data_path=args.data, unique_overrides=True)
    host_devices.apply(study.train, auto=False)  # an explicit split, before anything starts JAX
    sharding.initialize_distributed(study.train.distributed)  # before the memory check lists devices

    # A model too large for memory is one line before any training; the encodings share the
    # architecture, and learned positions add a table: the first and "learned" are the largest.
    for name in dict.fromkeys(n for n in study.encodings if n in (study.encodings[0], "learned")):
      for task in (None, *study.tasks):  # the text models, then each retrieval task's (task_train)
        host_devices.check_fits(model_train_config(study, name, 0, task), key="train.cpu_devices")
        memory_check.check_fits_memory(model_train_config(study, name, 0, task))
    try:
      run_study(study)
    except StudyInterrupted as e:
      print(e, file=sys.stderr)
      return 1
    print((Path(study.workdir) / "study.md").read_text())
    plots = "bits_per_byte.png, loss_vs_position.png" + (", retrieval.png" if study.tasks else "")
    print(f"wrote {study.workdir}/study.md, study.json, {plots}")
    return 0

  return run_guard.run_cli(prog, body, debug=args.debug)


def run(prog: str = "jaxpe-study") -> None:
  """The console entry point: ``main()`` on ``sys.argv``, then exit with its status."""
  run_guard.exit_process(main(prog=prog))


if __name__ == "__main__":
  run()
