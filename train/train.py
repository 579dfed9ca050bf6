"""`jaxpe-train` from a checkout (python train/train.py --help); the command is jaxpe/train/cli.py."""

from jaxpe.train.cli import main, run  # noqa: F401  (main: the tests and scripts call train.py's main(argv))

if __name__ == "__main__":
  run(prog="train.py")
