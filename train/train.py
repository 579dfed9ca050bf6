"""`jaxpe-train` from a checkout (python train/train.py --help); the command is jaxpe/train/cli.py."""

import sys

from jaxpe.errors import MissingExtraError

try:
  from jaxpe.train.cli import main, run  # noqa: F401  (main: the tests and scripts call train.py's main(argv))
except MissingExtraError as e:  # the extra is named in one line, as by the console script
  if __name__ != "__main__":
    raise
  print(f"train.py: error: {e}", file=sys.stderr)
  sys.exit(2)

if __name__ == "__main__":
  run(prog="train.py")
