"""The exceptions jaxpe defines (one per idea; everything else raises ValueError / TypeError)."""

from __future__ import annotations


class CheckpointError(OSError, ValueError):
  """A checkpoint that cannot be written or read: a training checkpoint (``jaxpe.train``) with no
  intact step, or a BLOOM checkpoint (``jaxpe.bloom``) with missing/unexpected keys, wrong shapes or
  a file that cannot be read. The message names the key or the file; nothing is loaded when it is
  raised. Both an ``OSError`` (what training checkpoints raised) and a ``ValueError`` (what BLOOM
  imports raised), so existing ``except`` clauses keep working."""


EXTRAS: dict[str, tuple[str, ...]] = {
  "model": ("flax", "pydantic", "yaml"),
  "train": ("flax", "pydantic", "yaml", "optax", "orbax.checkpoint", "tqdm", "matplotlib"),
  "bloom": ("flax", "pydantic", "yaml", "torch", "transformers", "safetensors"),
}
"""The modules each of pyproject.toml's extras installs (by import name), checked by
``require_extra``; ``tests/extras_test.py`` checks them against pyproject.toml."""

_DISTRIBUTIONS = {"yaml": "pyyaml", "orbax.checkpoint": "orbax-checkpoint"}


class MissingExtraError(ModuleNotFoundError):
  """A part of jaxpe was used without the extra that installs its dependencies (the core install
  has jax and numpy only). The message names the missing module, the extra and the command that
  installs it: ``pip install "jaxpe[train]"`` (from a checkout: ``pip install ".[train]"``). A
  ``ModuleNotFoundError``, so ``except ImportError`` clauses keep working."""


def _missing(name: str) -> bool:
  import importlib.util

  try:
    return importlib.util.find_spec(name) is None  # locates without importing (None: absent or blocked)
  except (ImportError, ValueError):  # a parent package missing, or a module without a spec
    return True


def require_extra(extra: str, user: str, modules: tuple[str, ...] | None = None) -> None:
  """Checks that the modules of ``extra`` (``EXTRAS[extra]``, or ``modules``) can be imported,
  without importing them.

  Args:
    extra: ``"model"``, ``"train"`` or ``"bloom"``.
    user: what needs them, for the message (``"jaxpe.model"``, ``"jaxpe-train"``).
    modules: the modules to check instead of all of the extra's (a function needing only torch).

  Raises:
    MissingExtraError: a module is missing; names it, ``user`` and the pip command.
    KeyError: ``extra`` is not one of ``EXTRAS``.
  """
  missing = [m for m in (modules if modules is not None else EXTRAS[extra]) if _missing(m)]
  if missing:
    names = ", ".join(_DISTRIBUTIONS.get(m, m) for m in missing)
    err = MissingExtraError(
      f'{user} needs the {extra!r} extra (not installed: {names}): pip install "jaxpe[{extra}]" '
      f'(from a checkout: pip install ".[{extra}]")'
    )
    err.name = missing[0]
    raise err
