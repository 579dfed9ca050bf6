"""Test-wide JAX settings: 8 fake CPU devices, strict dtype promotion, no implicit rank promotion, a
compilation cache per test session shared by its processes."""

import atexit
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# XLA's persistent compilation cache, one folder per test session, shared by every process of the
# session: the xdist workers and the subprocesses tests start (train.py runs the fault tests signal,
# the two-process runs, the command-line runs) inherit it through the environment. The library
# builds a new jax.jit per call in places (the sharded init and the train step of every trainer.train
# run, each study evaluation), so every test that trains or evaluates compiled the same programs
# again (a repeated 4-step run: 30 s of CPU, 4.7 s with the cache), and every subprocess compiled
# the tiny model's programs from nothing. A hit loads the executable XLA compiled for the same
# program (the key covers the HLO, the devices, XLA_FLAGS and the jax version); tracing and every
# trace-time check run as before. The process that makes the folder removes it at exit; a cache the
# user configured (JAX_COMPILATION_CACHE_DIR) is used as it is.
# jax writes an entry in place (open, write), so another process could read one half written (jax
# then warns and compiles): the test processes write each entry to a temporary file and rename it
# (atomic on one file system). jax's own locking (jax_compilation_cache_max_size) is not used: each
# write then lists and reads the whole folder (175 ms at 1,500 entries), under one lock.
_SHARED = "JAXPE_TEST_XLA_CACHE"  # the session's folder, set by the process that made it


def _atomic_put(self, key: str, value: bytes) -> None:
  """``jax._src.lru_cache.LRUCache.put`` without eviction (the cache's max_size is -1), the entry
  written to a temporary file and renamed, so a reader sees all of it or nothing."""
  if not key:
    raise ValueError("key cannot be empty")
  path = self.path / f"{key}{_lru_cache._CACHE_SUFFIX}"
  if path.exists():
    return
  part = path.with_name(f".{path.name}.{os.getpid()}.part")
  part.write_bytes(value)
  os.replace(part, path)


if os.environ.get(_SHARED) or not jax.config.jax_compilation_cache_dir:
  from jax._src import lru_cache as _lru_cache

  _XLA_CACHE = os.environ.get(_SHARED) or tempfile.mkdtemp(prefix="jaxpe-tests-xla-cache-")
  if _XLA_CACHE != os.environ.get(_SHARED):
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
  _settings = {
    "jax_compilation_cache_dir": _XLA_CACHE,
    "jax_persistent_cache_min_compile_time_secs": 0.1,  # not the single eager ops
    "jax_persistent_cache_min_entry_size_bytes": 0,
    "jax_compilation_cache_max_size": -1,  # no eviction, no lock
  }
  os.environ[_SHARED] = _XLA_CACHE
  os.environ.update({name.upper(): str(value) for name, value in _settings.items()})
  for _name, _value in _settings.items():
    jax.config.update(_name, _value)
  if hasattr(_lru_cache, "_CACHE_SUFFIX") and hasattr(_lru_cache.LRUCache, "put"):
    _lru_cache.LRUCache.put = _atomic_put


# The suite's profile (docs/architecture.md, "Tests"): with JAXPE_TEST_PROFILE=PREFIX each test
# process appends one JSON line per test to PREFIX.<pid>.jsonl: its wall seconds (setup, call and
# teardown), the programs it built (``backend_compile`` events: compiled by XLA, or loaded from the
# persistent cache: ``cache_hits``) and the subprocesses it started (compiles inside a subprocess
# are the subprocess's, not counted). Off by default: nothing is patched.
_PROFILE = os.environ.get("JAXPE_TEST_PROFILE")
if _PROFILE:
  import json
  import subprocess
  import time

  _COUNTS = {"programs": 0, "cache_hits": 0, "subprocesses": 0}

  def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      _COUNTS["programs"] += 1

  def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      _COUNTS["cache_hits"] += 1

  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)
  _popen_init = subprocess.Popen.__init__

  def _counted_popen_init(self, *args, **kwargs):
    _COUNTS["subprocesses"] += 1
    _popen_init(self, *args, **kwargs)

  subprocess.Popen.__init__ = _counted_popen_init

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    before, start = dict(_COUNTS), time.perf_counter()
    yield
    row = {"test": item.nodeid, "seconds": round(time.perf_counter() - start, 3)}
    row.update({k: _COUNTS[k] - before[k] for k in _COUNTS})
    with open(f"{_PROFILE}.{os.getpid()}.jsonl", "a") as f:
      f.write(json.dumps(row) + "\n")

  def pytest_sessionfinish(session):
    """The per-file table, PREFIX.md, written by the main process once every worker is done."""
    if hasattr(session.config, "workerinput"):
      return
    files: dict[str, list[float]] = {}
    for part in Path(_PROFILE).parent.glob(Path(_PROFILE).name + ".*.jsonl"):
      for line in part.read_text().splitlines():
        row = json.loads(line)
        total = files.setdefault(row["test"].split("::")[0], [0, 0.0, 0, 0, 0])
        for i, key in enumerate(("seconds", "programs", "cache_hits", "subprocesses"), 1):
          total[i] += row[key]
        total[0] += 1
    lines = [
      "| file | tests | seconds | programs built | cache hits | subprocesses |",
      "|---|---|---|---|---|---|",
    ]
    for name, (n, sec, progs, hits, subs) in sorted(files.items(), key=lambda kv: -kv[1][1]):
      lines.append(f"| `{name}` | {n} | {sec:.1f} | {progs} | {hits} | {subs} |")
    Path(f"{_PROFILE}.md").write_text("\n".join(lines) + "\n")


@pytest.fixture
def standard_promotion():
  """Standard dtype promotion for training tests: optax's Adam mixes Python floats with int32 step
  counts, which strict promotion rejects; the model itself is tested under strict promotion.
  Use with ``pytestmark = pytest.mark.usefixtures("standard_promotion")``."""
  with jax.numpy_dtype_promotion("standard"):
    yield


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> str:
  """A small corpus of real text present on every machine with Python: three stdlib modules."""
  root = Path(sysconfig.get_paths()["stdlib"])
  text = b"".join((root / name).read_bytes() for name in ("textwrap.py", "shlex.py", "bisect.py"))
  path = tmp_path_factory.mktemp("data") / "corpus.txt"
  path.write_bytes(text)
  return str(path)


# The files whose tests take longest (seconds to minutes each: training runs, subprocesses, studies),
# heaviest first, from the suite's profile (``--durations``). They run before every other file:
# pytest-xdist hands the first quarter of the tests out round-robin and the rest as workers finish,
# so long tests started first are spread over the workers and the session ends on short ones; in
# collection order (study/ and train/ last) one worker ran the last long test while the other idled.
# Each file keeps its own order (its module fixtures are set up once). A file not listed runs after
# these, in collection order.
SLOW_FIRST = (
  "tests/study/retrieval_test.py",
  "tests/train/fault_test.py",
  "tests/train/host_devices_test.py",
  "tests/train/trainer_test.py",
  "tests/train/scale_test.py",
  "tests/train/context_parallel_test.py",
  "tests/attention/native_build_test.py",
  "tests/ops/hf_families_test.py",
  "tests/model/generate_test.py",
  "tests/attention/numerics_test.py",
  "tests/study/study_test.py",
  "tests/train/contracts_runs_test.py",
  "tests/benchmarks_test.py",
  "tests/model/model_test.py",
  "tests/attention/cpu_flash_test.py",
  "tests/model/decoder_pe_test.py",
  "tests/docs_test.py",
  "tests/train/contracts_cli_test.py",
  "tests/train/tasks_test.py",
  "tests/train/run_log_test.py",
)


def pytest_collection_modifyitems(items):
  """Runs the ``SLOW_FIRST`` files first (stable: each file keeps its order; every process of an
  xdist session sorts the same collection alike). Marks the jax.jit variants of the chex property
  tests (``@chex.variants(with_jit=True, ...)`` names them ``<test>__with_jit``) with ``jit``:
  ``pytest -m jit`` runs them all, ``-m 'not jit'`` skips them."""
  rank = {name: i for i, name in enumerate(SLOW_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FIRST)))
  for item in items:
    if item.name.endswith("__with_jit"):
      item.add_marker(pytest.mark.jit)
