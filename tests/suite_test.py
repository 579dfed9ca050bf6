"""The test suite's own machinery (tests/conftest.py): one XLA compilation cache per session, shared
by the processes of the session (xdist workers, the subprocesses tests start), so a program compiled
once is loaded, not compiled, by the next process that builds it (docs/architecture.md, "Tests")."""

import os
import subprocess
import sys
import uuid

import jax

SHARED = "JAXPE_TEST_XLA_CACHE"
# A program that takes XLA well over the cache's 0.1 s threshold to compile; SALT makes it new to
# the cache (the constant is part of the program).
PROGRAM = """
import jax, jax.numpy as jnp

def chain(x):
  for i in range(400):
    x = jnp.sin(x) * SALT + jnp.cos(x[::-1]) * i
  return x

compiled = jax.jit(chain).lower(jnp.ones(64, jnp.float32)).compile()
"""


def _run(code: str) -> None:
  exec(compile(code, "<suite_test program>", "exec"), {})  # one file name: the same program's metadata


def _child(code: str, then: str) -> str:
  script = f"from suite_test import _run\n_run({code!r})\nimport jax\n{then}"
  proc = subprocess.run(
    [sys.executable, "-c", script],
    cwd=os.path.dirname(__file__),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc.stdout.strip()


def test_this_process_writes_programs_to_the_session_cache():
  assert jax.config.jax_compilation_cache_dir and os.path.isdir(jax.config.jax_compilation_cache_dir)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.1
  assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
  assert os.environ[SHARED] == jax.config.jax_compilation_cache_dir  # what subprocesses inherit


def test_entries_are_written_whole_or_not_at_all(tmp_path):
  from jax._src import lru_cache

  cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
  cache.put("key", b"x" * 100_000)
  cache.put("key", b"y")  # an entry is never replaced
  assert cache.get("key") == b"x" * 100_000
  assert sorted(p.name for p in tmp_path.iterdir()) == ["key-cache"]  # no temporary file left


def test_a_program_a_subprocess_compiled_is_loaded_here_not_compiled():
  assert os.environ[SHARED] == jax.config.jax_compilation_cache_dir
  salt = f"{1.0 + int(uuid.uuid4().hex[:6], 16) * 1e-9!r}"
  code = PROGRAM.replace("SALT", salt)
  settings = "print(jax.config.jax_compilation_cache_dir)"
  assert _child(code, settings) == os.environ[SHARED]  # the child shares the session's folder
  hits = []

  def listen(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
      hits.append(event)

  jax.monitoring.register_event_listener(listen)
  try:
    _run(code)  # the same program, in this process
  finally:
    jax.monitoring.unregister_event_listener(listen)
  assert hits, "the program the subprocess compiled was compiled again here"


def test_the_slow_files_run_first_and_exist(request):
  """conftest's SLOW_FIRST names files that exist (a renamed file would silently lose its place) and
  the session's collection starts with them, in that order."""
  import conftest

  root = request.config.rootpath
  missing = [name for name in conftest.SLOW_FIRST if not (root / name).is_file()]
  assert not missing, f"conftest.SLOW_FIRST names files that do not exist: {missing}"
  files = [item.nodeid.split("::")[0] for item in request.session.items]
  listed = [f for f in dict.fromkeys(files) if f in conftest.SLOW_FIRST]
  assert listed == [f for f in conftest.SLOW_FIRST if f in files]  # in SLOW_FIRST's order
  first_other = next((i for i, f in enumerate(files) if f not in conftest.SLOW_FIRST), len(files))
  assert all(f not in conftest.SLOW_FIRST for f in files[first_other:])


def test_no_two_test_files_share_a_name():
  # The test folders are not packages (rootdir-relative imports): two files of one name, in two
  # folders, fail the whole session's collection with "import file mismatch" (tests/study/ and
  # tests/attention/ both held patterns_test.py: each passed alone, the suite errored).
  from collections import Counter
  from pathlib import Path

  names = Counter(p.name for p in Path(__file__).parent.rglob("*_test.py"))
  assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
