"""`jaxpe-study` from a checkout (python train/study.py --help); the command is jaxpe/study/cli.py."""

from jaxpe.study.cli import main, run  # noqa: F401  (main: the tests and scripts call study.py's main(argv))

if __name__ == "__main__":
  run(prog="study.py")
