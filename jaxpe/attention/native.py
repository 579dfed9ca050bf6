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

The build trusts nothing in its environment (issue 39): the compiler runs in its own session (a
Ctrl-C at the terminal reaches the trainer, which stops after the step, not the compiler, so the
kernel a run uses does not depend on when it was interrupted) and is killed with its children after
``build_timeout()`` seconds of its CPU time or of no progress (``$JAXPE_CPU_FLASH_BUILD_TIMEOUT``,
default 30; a build takes about 4 s of CPU), a ``RuntimeError``
naming the limit; a ``KeyboardInterrupt`` in the waiting process kills the compiler and propagates,
leaving nothing behind. Loading never runs bytes that were not checked: ``register`` copies the
cached library to a private file, checks the copy's SHA-256 against the digest, loads the copy in a
child process first (a library that crashes the process that loads it, e.g. with SIGBUS, kills only
the child: it is deleted and rebuilt once, else a ``RuntimeError``), then loads the same copy.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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


BUILD_TIMEOUT_S = 30.0
"""Default of ``build_timeout()``: the compiler's budget in seconds of its own CPU time, and the
longest it may go without using any (a hung compiler). A build of ``cpu_flash.cc`` takes 4.3 s of
CPU (g++ 13, -O3; 2-14 s wall on an idle machine, 50 s wall on a 2-core machine at load 15, where
a wall-clock limit would kill a healthy build): 30 s is 7x that, and a hung compiler blocks the
first attention call for 30 s, not the 120 s of the wall-clock limit before."""
WALL_FACTOR = 10
"""A build is killed after ``WALL_FACTOR * build_timeout()`` wall seconds whatever its CPU use (a
compiler starved of CPU for that long is as good as hung)."""
PROBE_TIMEOUT_S = 60.0
"""Seconds the child process that test-loads a library may take."""


def build_timeout() -> float:
  """Seconds the compiler may run before it is killed: ``$JAXPE_CPU_FLASH_BUILD_TIMEOUT`` (a finite
  number > 0), else ``BUILD_TIMEOUT_S``.

  Raises:
    ValueError: ``$JAXPE_CPU_FLASH_BUILD_TIMEOUT`` is set but not a finite number > 0 (named).
  """
  raw = os.environ.get("JAXPE_CPU_FLASH_BUILD_TIMEOUT", "").strip()
  if not raw:
    return BUILD_TIMEOUT_S
  try:
    value = float(raw)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"JAXPE_CPU_FLASH_BUILD_TIMEOUT must be a number of seconds > 0, got {raw!r}")
  return value


def _group_cpu_seconds(pgid: int) -> float | None:
  """CPU seconds (user + system, with reaped children) of the processes in group ``pgid``, from
  ``/proc``; None where ``/proc`` cannot be read (not Linux)."""
  try:
    names = os.listdir("/proc")
  except OSError:
    return None
  ticks = 0
  for name in names:
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue  # gone meanwhile
    if len(fields) > 14 and fields[2] == str(pgid):  # pgrp; utime, stime, cutime, cstime
      ticks += sum(int(x) for x in fields[11:15])
  return ticks / os.sysconf("SC_CLK_TCK")


def _run_killable(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
  """Runs ``cmd`` in its own session (no terminal signal reaches it) and process group; the whole
  group is killed (``subprocess.TimeoutExpired``) when it has used ``timeout`` seconds of CPU, used
  none for ``timeout`` seconds (hung), or run ``WALL_FACTOR * timeout`` wall seconds (without
  ``/proc``: ``timeout`` wall seconds), and when this process is interrupted (the
  ``KeyboardInterrupt`` propagates). CPU time, not wall time, so that a loaded machine does not
  kill a healthy build."""
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
  )
  try:
    start = last_progress = time.monotonic()
    used = 0.0
    while True:
      try:
        out, err = proc.communicate(timeout=0.2)  # retrying loses no output
        break
      except subprocess.TimeoutExpired:
        now, cpu = time.monotonic(), _group_cpu_seconds(proc.pid)
        if cpu is not None and cpu > used:
          used, last_progress = cpu, now
        limit = timeout * WALL_FACTOR if cpu is not None else timeout
        if used > timeout or now - last_progress > timeout or now - start > limit:
          raise
  except BaseException:
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # the driver and its children (cc1plus, as, ld)
    except OSError:
      pass
    proc.wait()  # not communicate(): a daemon that left the group may hold the pipes open
    for pipe in (proc.stdout, proc.stderr):
      pipe.close()
    raise
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
    RuntimeError: no compiler, the compiler failed (its message included) or ran past
      ``build_timeout()`` seconds (killed), or the cache folder cannot be written.
    ValueError: ``$JAXPE_CPU_FLASH_BUILD_TIMEOUT`` is not a number > 0.
    KeyboardInterrupt: the build was interrupted (the compiler is killed; nothing is cached).
  """
  timeout = build_timeout()
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
      try:
        done = _run_killable(cmd, timeout)
      except subprocess.TimeoutExpired:
        raise RuntimeError(
          f"the C++ compiler did not finish building {source.name} within {timeout:g} s and was killed "
          f"(seconds of its CPU time, or of no progress; {cxx}; set JAXPE_CPU_FLASH_BUILD_TIMEOUT=<seconds> "
          "to wait longer)"
        ) from None
      if done.returncode != 0:
        said = done.stderr.strip()[-2000:] or "(it wrote nothing to stderr)"
        raise RuntimeError(f"{' '.join(cmd)} failed ({_exit_status(done.returncode)}):\n{said}")
      if not built.is_file():
        raise RuntimeError(f"{' '.join(cmd)} exited 0 but wrote no library to {built}")
      digest = Path(tmp) / (target.name + ".sha256")
      digest.write_text(hashlib.sha256(built.read_bytes()).hexdigest())
      os.replace(built, target)  # the library, then its digest: a reader that sees a digest
      os.replace(digest, target.with_name(target.name + ".sha256"))  # sees its library whole
  except (OSError, subprocess.SubprocessError) as err:
    raise RuntimeError(f"could not build {source.name} in {target.parent}: {err}") from err
  return target


def _exit_status(returncode: int) -> str:
  """A process's exit as words: ``exit status 3``, or the signal that killed it (``SIGSEGV``)."""
  if returncode >= 0:
    return f"exit status {returncode}"
  try:
    return f"killed by {signal.Signals(-returncode).name}"
  except ValueError:
    return f"killed by signal {-returncode}"


def _intact(target: Path) -> bool:
  """Whether ``target`` exists and matches the digest written beside it (a truncated or damaged
  library would crash the process that loads it; it is rebuilt instead)."""
  try:
    want = target.with_name(target.name + ".sha256").read_text().strip()
    return hashlib.sha256(target.read_bytes()).hexdigest() == want
  except OSError:
    return False


_PROBE = "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); [getattr(lib, s) for s in sys.argv[2:]]"


def _probe(path: Path, symbols: list[str]) -> str | None:
  """None when a child process loads the library ``path`` and finds ``symbols`` in it; else what
  happened (its error, or the signal that killed it: a library that would crash this process)."""
  try:
    done = _run_killable([sys.executable, "-c", _PROBE, str(path), *symbols], PROBE_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return f"loading it did not finish within {PROBE_TIMEOUT_S:g} s"
  except OSError as err:
    return f"no process could test-load it ({err})"
  if done.returncode < 0:
    return f"loading it kills the process ({_exit_status(done.returncode).removeprefix('killed by ')})"
  if done.returncode:
    return f"it does not load: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
  return None


def _private_copy(target: Path) -> Path | None:
  """A private copy of ``target`` whose bytes match ``target``'s digest, or None when they do not:
  what is checked is what is loaded, and nothing written to the cache later can change it. Made
  beside ``target`` (a folder that may map code), else, for a read-only cache, in the temporary
  folder. The caller deletes it.

  Raises:
    OSError: neither folder can be written.
  """
  try:
    data = target.read_bytes()
    want = target.with_name(target.name + ".sha256").read_text().strip()
  except OSError:
    return None
  if hashlib.sha256(data).hexdigest() != want:
    return None
  for i, folder in enumerate((target.parent, Path(tempfile.gettempdir()))):
    try:
      fd, name = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=folder)
    except OSError:
      if i:
        raise
      continue
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    return Path(name)
  return None  # pragma: no cover (the loop returns or raises)


def _remove(target: Path) -> None:
  for path in (target, target.with_name(target.name + ".sha256")):
    try:
      path.unlink()
    except OSError:
      pass


def register(source: Path, handlers: dict[str, str]) -> None:
  """Builds ``source`` (``build``), loads it and registers each ``{ffi target name: exported
  handler symbol}`` on the CPU platform.

  The library is loaded from a private copy checked against its digest, and only once a child
  process has loaded that copy and found the symbols; a cached library that fails (damaged,
  crashing its loader) is deleted and built again, once.

  Raises:
    RuntimeError: as ``build``; the library (also rebuilt) does not load in a child process, kills
      it, or lacks a symbol.
    ValueError, KeyboardInterrupt: as ``build``.
  """
  for attempt in range(2):
    path, copy = build(source), None
    try:
      copy = _private_copy(path)
      problem = "its bytes do not match its digest" if copy is None else _probe(copy, list(handlers.values()))
      if problem is None:
        try:
          lib = ctypes.cdll.LoadLibrary(str(copy))
          for name, symbol in handlers.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except (OSError, AttributeError) as err:
          raise RuntimeError(f"could not load {path}: {err}") from err
        return
    except OSError as err:
      raise RuntimeError(f"could not copy {path} to load it: {err}") from err
    finally:
      if copy is not None:
        copy.unlink(missing_ok=True)  # a loaded library stays mapped
    if attempt == 0:
      _remove(path)  # damaged since it was built: built again
  raise RuntimeError(f"the library built from {source.name}, {path}, cannot be used: {problem}")


__all__ = ["BUILD_TIMEOUT_S", "FLAGS", "build", "build_timeout", "cache_dir", "compiler", "register"]
