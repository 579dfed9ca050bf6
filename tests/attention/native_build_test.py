"""The kernel's first-use build and load (issue 39, kind 7) can neither hang a call nor crash the
process: a compiler that never returns is killed after ``JAXPE_CPU_FLASH_BUILD_TIMEOUT`` seconds
(the kernel then reports itself unavailable, with a warning, and attention runs on the XLA loops); a
cached library that crashes the process loading it, although its digest matches, is caught in a
child process and rebuilt; a Ctrl-C at the terminal does not reach the compiler, and a
``KeyboardInterrupt`` in the building process propagates and leaves nothing cached. Each case runs
in a child process (a crash or a hang there fails the test instead of killing the suite), with a
tiny C++ source so that a build takes a fraction of a second."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxpe.attention import native

ROOT = Path(__file__).resolve().parents[2]
SYMBOL = "jaxpe_test_symbol"
TINY = f'extern "C" int {SYMBOL}() {{ return 7; }}\n'
# A library that kills the process that loads it, as a damaged or truncated mapping does (SIGBUS).
CRASHING = (
  "#include <csignal>\n__attribute__((constructor)) static void crash() { std::raise(SIGBUS); }\n" + TINY
)

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="needs a C++ compiler")


def _source(tmp_path, text=TINY, name="tiny.cc") -> Path:
  path = tmp_path / name
  path.write_text(text)
  return path


def _script(tmp_path, body: str) -> Path:
  path = tmp_path / "child.py"
  path.write_text(textwrap.dedent(body))
  return path


def _env(tmp_path, **extra):
  env = {**os.environ, "JAXPE_CACHE_DIR": str(tmp_path / "cache"), "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
  return {**env, **extra}


def _fake_compiler(tmp_path, body: str) -> Path:
  """A ``$CXX`` that writes its pid to ``cxx.pid``, then runs ``body`` (sh)."""
  path = tmp_path / "cxx"
  path.write_text(f'#!/bin/sh\necho $$ > "{tmp_path}/cxx.pid"\n{body}\n')
  path.chmod(0o755)
  return path


def _gone(pid: int, within: float = 10.0) -> bool:
  end = time.time() + within
  while time.time() < end:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.05)
  return False


def test_a_compiler_that_never_returns_is_killed_and_the_kernel_reported_unavailable(tmp_path):
  # main: the first attention call waited 300 s for the compiler (308 s measured)
  cxx = _fake_compiler(tmp_path, "sleep 600")  # a child of the script: the whole group must go
  child = _script(
    tmp_path,
    """
    import time
    t = time.time()
    from jaxpe.attention import cpu_flash
    print(cpu_flash.available(), round(time.time() - t, 1))
    print(cpu_flash.unavailable_reason())
    """,
  )
  env = _env(tmp_path, CXX=str(cxx), JAXPE_CPU_FLASH_BUILD_TIMEOUT="2")
  done = subprocess.run([sys.executable, str(child)], env=env, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr[-2000:]
  first, reason = done.stdout.splitlines()[:2]
  assert first.startswith("False"), done.stdout
  assert "did not finish building cpu_flash.cc within 2 s and was killed" in reason, reason
  assert "JAXPE_CPU_FLASH_BUILD_TIMEOUT" in reason
  assert "RuntimeWarning: the CPU attention kernel is not available" in done.stderr, done.stderr[-2000:]
  assert _gone(int((tmp_path / "cxx.pid").read_text())), "the compiler was left running"
  assert not list((tmp_path / "cache").glob("*.so"))


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf", "nan"])
def test_a_build_timeout_that_is_not_a_number_of_seconds_is_refused(value, monkeypatch):
  monkeypatch.setenv("JAXPE_CPU_FLASH_BUILD_TIMEOUT", value)
  with pytest.raises(
    ValueError, match=f"JAXPE_CPU_FLASH_BUILD_TIMEOUT must be a number of seconds > 0, got '{value}'"
  ):
    native.build_timeout()


_REGISTER = f"""
import sys
from pathlib import Path
from jaxpe.attention import native
try:
  native.register(Path(sys.argv[1]), {{"jaxpe_test_target": "{SYMBOL}"}})
  print("registered")
except RuntimeError as err:
  print("RuntimeError:", err)
"""


def test_a_cached_library_that_crashes_its_loader_is_rebuilt_not_loaded(tmp_path, monkeypatch):
  # main: a library whose digest matches was loaded into the process, which died of SIGBUS
  monkeypatch.setenv("JAXPE_CACHE_DIR", str(tmp_path / "cache"))
  source = _source(tmp_path)
  target = native.build(source)  # builds only, loads nothing
  crashing = native.build(_source(tmp_path, CRASHING, "crashing.cc"))
  target.write_bytes(crashing.read_bytes())
  digest = target.with_name(target.name + ".sha256")
  digest.write_text(hashlib.sha256(target.read_bytes()).hexdigest())  # the digest matches the damage
  child = _script(tmp_path, _REGISTER)
  done = subprocess.run(
    [sys.executable, str(child), str(source)], env=_env(tmp_path), capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
  assert done.stdout.strip() == "registered", done.stdout
  assert target.read_bytes() != crashing.read_bytes()  # rebuilt
  assert not list((tmp_path / "cache").glob(".*.so"))  # no private copy left behind

  # A source whose every build crashes its loader: an error naming the signal, never a crash.
  bad = _source(tmp_path, CRASHING, "always.cc")
  done = subprocess.run(
    [sys.executable, str(child), str(bad)], env=_env(tmp_path), capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
  assert "RuntimeError:" in done.stdout and "kills the process (SIGBUS)" in done.stdout, done.stdout


def test_ctrl_c_at_the_terminal_reaches_the_trainer_not_the_compiler(tmp_path):
  # main: the compiler, in the trainer's process group, died of the SIGINT; step 1 then ran on the
  # XLA loops and the resumed run on the kernel (not bit-identical)
  cxx = _fake_compiler(tmp_path, f'touch "{tmp_path}/started"\nsleep 2\nexec {native.compiler()} "$@"')
  child = _script(
    tmp_path,
    """
    import signal, sys
    from pathlib import Path
    from jaxpe.attention import native
    got = []
    signal.signal(signal.SIGINT, lambda *a: got.append("SIGINT"))  # as the trainer's stop_signals
    path = native.build(Path(sys.argv[1]))
    print(got, path.is_file())
    """,
  )
  proc = subprocess.Popen(
    [sys.executable, str(child), str(_source(tmp_path))],
    env=_env(tmp_path, CXX=str(cxx)),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,  # its own process group, as a terminal's foreground job
  )
  end = time.time() + 60
  while not (tmp_path / "started").exists():
    assert proc.poll() is None and time.time() < end, proc.communicate()
    time.sleep(0.01)
  os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err[-2000:]
  assert out.strip() == "['SIGINT'] True", out


def test_keyboard_interrupt_during_the_build_propagates_kills_the_compiler_and_caches_nothing(tmp_path):
  cxx = _fake_compiler(tmp_path, f'touch "{tmp_path}/started"\nsleep 600')
  child = _script(
    tmp_path,
    """
    import signal, sys
    from pathlib import Path
    # Ctrl-C raises KeyboardInterrupt here whatever this process inherited: in the full suite it was
    # once started with SIGINT ignored or blocked at the OS level (the xdist worker's state after
    # earlier tests), and kept ignoring it until the build's timeout
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from jaxpe.attention import native
    try:
      native.build(Path(sys.argv[1]))
    except KeyboardInterrupt:
      print("KeyboardInterrupt")
    """,
  )
  proc = subprocess.Popen(
    [sys.executable, str(child), str(_source(tmp_path))],
    env=_env(tmp_path, CXX=str(cxx), JAXPE_CPU_FLASH_BUILD_TIMEOUT="90"),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  end = time.time() + 60
  while not (tmp_path / "started").exists():
    assert proc.poll() is None and time.time() < end, proc.communicate()
    time.sleep(0.01)
  proc.send_signal(signal.SIGINT)
  try:  # generous: the child only kills the compiler and exits, but a loaded machine can stall it
    out, err = proc.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(
      f"the interrupted build did not return within 120 s: {out!r} {err[-2000:]!r}"
    ) from None
  assert out.strip() == "KeyboardInterrupt", (out, err[-2000:])
  assert _gone(int((tmp_path / "cxx.pid").read_text())), "the compiler was left running"
  assert not list((tmp_path / "cache").glob("*.so"))


def test_an_intact_library_in_a_read_only_cache_is_copied_to_the_temporary_folder(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXPE_CACHE_DIR", str(tmp_path / "cache"))
  target = native.build(_source(tmp_path))
  mkstemp = native.tempfile.mkstemp

  def read_only_cache(*args, dir=None, **kw):
    if Path(dir) == target.parent:
      raise PermissionError(13, "Permission denied", str(dir))
    return mkstemp(*args, dir=dir, **kw)

  monkeypatch.setattr(native.tempfile, "mkstemp", read_only_cache)
  copy = native._private_copy(target)
  try:
    assert copy.parent == Path(native.tempfile.gettempdir()) and copy.read_bytes() == target.read_bytes()
  finally:
    copy.unlink()
  target.write_bytes(target.read_bytes()[:100])  # damaged: no copy to load
  assert native._private_copy(target) is None


@pytest.mark.parametrize(
  "body, said",
  [
    ("exit 3", r"failed \(exit status 3\):\n\(it wrote nothing to stderr\)"),  # CXX=/bin/false
    ("kill -SEGV $$", r"failed \(killed by SIGSEGV\)"),
    ("exit 0", "exited 0 but wrote no library"),  # CXX=/bin/true
  ],
)
def test_a_failing_compiler_is_named_with_its_exit(tmp_path, monkeypatch, body, said):
  monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, body)))
  monkeypatch.setenv("JAXPE_CACHE_DIR", str(tmp_path / "cache"))
  with pytest.raises(RuntimeError, match=said):
    native.build(_source(tmp_path))
  assert not list((tmp_path / "cache").glob("*.so"))  # nothing cached


def test_the_build_limit_is_on_the_compilers_cpu_time_and_stalls_not_wall_time():
  """Issue 48: the limit was 120 s of wall time where a build takes about 4 s of CPU (2-14 s wall
  idle, 50 s on a 2-core machine at load 15): a hung compiler blocked the first attention call for
  two minutes, and a shorter wall limit would kill healthy builds on a loaded machine. Now: 30 s of
  the compiler's CPU time or of no progress. A compiler slower in wall time than the limit that keeps
  working finishes (main: killed at 1.5 s); one that stalls, or spins, is killed."""
  assert native.BUILD_TIMEOUT_S == 30.0
  working = (
    "for r in 1 2 3 4; do i=0; while [ $i -lt 60000 ]; do i=$((i+1)); done; sleep 0.5; done; echo built"
  )
  t = time.monotonic()
  done = native._run_killable(["sh", "-c", working], 1.5)
  assert done.returncode == 0 and done.stdout.strip() == "built"
  assert time.monotonic() - t > 2.0  # it ran past the limit in wall time (4 sleeps alone take 2 s)
  for stuck in ("sleep 30", "while :; do :; done"):  # stalled; spinning (1.5 s of CPU)
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
      native._run_killable(["sh", "-c", stuck], 1.5)
    assert time.monotonic() - t < 15.5  # the wall-time backstop at the latest
