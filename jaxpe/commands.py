"""The console scripts pyproject.toml installs (``jaxpe-train``, ``jaxpe-study``, ``jaxpe-sample``,
``jaxpe-tokenize``, ``jaxpe-compile``), importable with the core install alone.

Each imports its command's module only when run, so a missing extra is one line naming the extra
and the pip command (``jaxpe-train: error: jaxpe.train needs the 'train' extra (not installed:
pydantic, ...): pip install "jaxpe[train]"``) with exit status 2, not a traceback.
"""

from __future__ import annotations

import importlib
import sys

from jaxpe.errors import MissingExtraError

__all__ = ["COMMANDS", "compile", "sample", "study", "tokenize", "train"]

COMMANDS = {
  "jaxpe-train": "jaxpe.train.cli",
  "jaxpe-study": "jaxpe.study.cli",
  "jaxpe-sample": "jaxpe.train.sample",
  "jaxpe-tokenize": "jaxpe.train.tokenize",
  "jaxpe-compile": "jaxpe.train.compile_cli",
}
"""Console script -> the module whose ``run(prog)`` it calls."""


def _run(prog: str) -> None:
  try:
    module = importlib.import_module(COMMANDS[prog])
  except MissingExtraError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  module.run(prog)


def train() -> None:
  """``jaxpe-train`` (``jaxpe.train.cli``)."""
  _run("jaxpe-train")


def study() -> None:
  """``jaxpe-study`` (``jaxpe.study.cli``)."""
  _run("jaxpe-study")


def sample() -> None:
  """``jaxpe-sample`` (``jaxpe.train.sample``)."""
  _run("jaxpe-sample")


def tokenize() -> None:
  """``jaxpe-tokenize`` (``jaxpe.train.tokenize``)."""
  _run("jaxpe-tokenize")


def compile() -> None:  # noqa: A001  (the command's name)
  """``jaxpe-compile`` (``jaxpe.train.compile_cli``)."""
  _run("jaxpe-compile")
