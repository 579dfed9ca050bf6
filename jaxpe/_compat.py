"""Old module paths (jaxpe before its subpackages) kept importable, with a DeprecationWarning.

``import jaxpe.rope`` or ``from jaxpe.kernels import attention`` still work: the old name is a
small module whose attributes are looked up, on first use, in the module(s) the code moved to.
The table is the whole map from old paths to new ones (docs/architecture.md repeats it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

MOVED: dict[str, tuple[str, ...]] = {
  "jaxpe._checks": ("jaxpe.ops.checks",),
  "jaxpe.rope": ("jaxpe.ops.rope",),
  "jaxpe.rope_scaling": ("jaxpe.ops.rope_scaling",),
  "jaxpe.hf_rope": ("jaxpe.ops.hf_rope",),
  "jaxpe.layouts": ("jaxpe.ops.layouts",),
  "jaxpe.positions": ("jaxpe.ops.positions", "jaxpe.attention.masks"),
  "jaxpe.alibi": ("jaxpe.ops.alibi",),
  "jaxpe.xpos": ("jaxpe.ops.xpos",),
  "jaxpe.sinusoidal": ("jaxpe.ops.sinusoidal",),
  "jaxpe.bf16_exact": ("jaxpe.emulation.bf16_exact",),
  "jaxpe.emulation_report": ("jaxpe.emulation.report",),
  "jaxpe.kernels": ("jaxpe.attention.kernels", "jaxpe.attention"),
  "jaxpe.config": ("jaxpe.model.config", "jaxpe.train.config"),
  "jaxpe.generate": ("jaxpe.model.generate",),
  "jaxpe.sharding": ("jaxpe.train.sharding", "jaxpe.model.partitioning"),
  "jaxpe.steps": ("jaxpe.train.steps", "jaxpe.train.optimizer"),
  "jaxpe.trainer": (
    "jaxpe.train.trainer",
    "jaxpe.train.run_checks",
    "jaxpe.train.state",
    "jaxpe.train.evaluation",
    "jaxpe.train.run_files",
    "jaxpe.train.loop",
    "jaxpe.train.run_log",
  ),
  "jaxpe.checkpoint": ("jaxpe.train.checkpoint",),
  "jaxpe.data": ("jaxpe.train.data",),
  "jaxpe.pacing": ("jaxpe.train.pacing",),
  "jaxpe.run_guard": ("jaxpe.train.run_guard",),
  "jaxpe.memory_check": ("jaxpe.train.memory_check",),
}
"""Old module path -> the modules its names now live in, searched in order."""


def _import_existing(name: str) -> types.ModuleType | None:
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name != name:
      raise
    return None


class _MovedModule(types.ModuleType):
  def __getattr__(self, attr: str):
    if attr.startswith("__"):
      raise AttributeError(attr)
    for target in MOVED[self.__name__]:
      module = _import_existing(target)
      if module is not None and hasattr(module, attr):
        warnings.warn(
          f"{self.__name__}.{attr} moved to {target}.{attr}; the old path will be removed",
          DeprecationWarning,
          stacklevel=2,
        )
        return getattr(module, attr)
    raise AttributeError(
      f"module {self.__name__!r} (moved to {', '.join(MOVED[self.__name__])}) has no attribute {attr!r}"
    )

  def __dir__(self):
    names: set[str] = set()
    for target in MOVED[self.__name__]:
      module = _import_existing(target)
      if module is not None:
        names.update(n for n in vars(module) if not n.startswith("__"))
    return sorted(names)


class _Loader(importlib.abc.Loader):
  def create_module(self, spec):
    return _MovedModule(spec.name)

  def exec_module(self, module):
    module.__doc__ = f"Deprecated path: moved to {', '.join(MOVED[module.__name__])}."

  def get_code(self, fullname):
    """``python -m <old path>``: warn, then run the module it moved to as ``__main__``."""
    target = MOVED[fullname][0]
    source = (
      "import runpy, warnings\n"
      f"warnings.warn({f'python -m {fullname} moved to python -m {target}'!r}, DeprecationWarning)\n"
      f"runpy.run_module({target!r}, run_name='__main__', alter_sys=True)\n"
    )
    return compile(source, f"<{fullname}: moved to {target}>", "exec")

  def is_package(self, fullname):
    return False


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path, target=None):
    if fullname in MOVED:
      return importlib.machinery.ModuleSpec(fullname, _Loader())
    return None


def install() -> None:
  """Put the old-path finder on ``sys.meta_path`` (once; after the real finders, so it only
  answers names that no longer exist as files)."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
