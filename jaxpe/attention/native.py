"""Building and loading jaxpe's C++ kernels for XLA's FFI (the CPU attention kernel, ``cpu_flash``).

A kernel's source ships in the package; on first use ``register`` compiles it with the system C++
compiler (``$CXX``, else ``c++``, ``g++``, ``clang++``) with ``-O3 -march=native`` against the
installed jaxlib's FFI headers (``jax.ffi.include_dir()``), caches the shared library under
``cache_dir()`` keyed by the source, jaxlib version, compiler, flags and CPU model, loads it and
registers its handlers with ``jax.ffi.register_ffi_target`` on the CPU. ``$JAXPE_CPU_FLASH_MARCH``
names another ``-march`` target (``x86-64-v3`` for a cluster of mixed CPUs). Several processes may
build at once: each compiles into a private folder and renames its library into place (atomic), so
none loads a half-written file; a library whose bytes do not match the digest written beside it
(damaged, truncated) is rebuilt, never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")
"""Compiler flags besides ``-march`` and the include path."""


def cache_dir() -> Path:
  """Where compiled kernels are kept: ``$JAXPE_CACHE_DIR``, default ``~/.cache/jaxpe``."""
  return Path(os.environ.get("JAXPE_CACHE_DIR") or Path.home() / ".cache" / "jaxpe")


def compiler() -> str | None:
  """The C++ compiler ``build`` uses: ``$CXX`` when set (None if it is not found), else the first
  of ``c++``, ``g++``, ``clang++`` on the PATH; None when there is none."""
  if os.environ.get("CXX"):
    return shutil.which(os.environ["CXX"])  # the one asked for, or none
  for name in ("c++", "g++", "clang++"):
    found = shutil.which(name)
    if found:
      return found
  return None


def _cpu_tag() -> str:
  """What ``-march=native`` depends on: the CPU model and its flags."""
  try:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return f"{platform.machine()} {platform.processor()}"
  return "\n".join([ln for ln in lines if ln.startswith(("model name", "flags", "Features"))][:2])


def build(source: Path) -> Path:
  """The shared library of ``source`` (a C++ file), compiled into ``cache_dir()`` when missing.

  Raises:
    RuntimeError: no compiler, the compiler failed (its message included), or the cache folder
      cannot be written.
  """
  cxx = compiler()
  if cxx is None:
    asked = os.environ.get("CXX")
    raise RuntimeError(
      f"CXX={asked} is not found" if asked else "no C++ compiler found ($CXX, c++, g++, clang++)"
    )
  flags = (*FLAGS, f"-march={os.environ.get('JAXPE_CPU_FLASH_MARCH') or 'native'}")
  key = hashlib.sha256()
  for part in (source.read_bytes(), importlib.metadata.version("jaxlib"), _cpu_tag(), cxx, " ".join(flags)):
    key.update(part if isinstance(part, bytes) else part.encode())
  target = cache_dir() / f"{source.stem}_{key.hexdigest()[:16]}.so"
  if _intact(target):
    return target
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
      built = Path(tmp) / target.name
      cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(built)]
      done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
      if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
      digest = Path(tmp) / (target.name + ".sha256")
      digest.write_text(hashlib.sha256(built.read_bytes()).hexdigest())
      os.replace(built, target)  # the library, then its digest: a reader that sees a digest
      os.replace(digest, target.with_name(target.name + ".sha256"))  # sees its library whole
  except (OSError, subprocess.SubprocessError) as err:
    raise RuntimeError(f"could not build {source.name} in {target.parent}: {err}") from err
  return target


def _intact(target: Path) -> bool:
  """Whether ``target`` exists and matches the digest written beside it (a truncated or damaged
  library would crash the process that loads it; it is rebuilt instead)."""
  try:
    want = target.with_name(target.name + ".sha256").read_text().strip()
    return hashlib.sha256(target.read_bytes()).hexdigest() == want
  except OSError:
    return False


def register(source: Path, handlers: dict[str, str]) -> None:
  """Builds ``source`` (``build``), loads it and registers each ``{ffi target name: exported
  handler symbol}`` on the CPU platform.

  Raises:
    RuntimeError: as ``build``; the library does not load or lacks a symbol.
  """
  path = build(source)
  try:
    lib = ctypes.cdll.LoadLibrary(str(path))
    for name, symbol in handlers.items():
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except (OSError, AttributeError) as err:
    raise RuntimeError(f"could not load {path}: {err}") from err


__all__ = ["FLAGS", "build", "cache_dir", "compiler", "register"]
