"""`jaxpe-study` from a checkout (python train/study.py --help); the command is jaxpe/study/cli.py."""

import sys

from jaxpe.errors import MissingExtraError

try:
  from jaxpe.study.cli import main, run  # noqa: F401  (main: the tests and scripts call study.py's main(argv))
except MissingExtraError as e:  # the extra is named in one line, as by the console script
  if __name__ != "__main__":
    raise
  print(f"study.py: error: {e}", file=sys.stderr)
  sys.exit(2)

if __name__ == "__main__":
  run(prog="study.py")
