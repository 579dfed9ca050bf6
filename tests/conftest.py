"""Test-wide JAX settings: 8 fake CPU devices, strict dtype promotion, no implicit rank promotion, a
per-process compilation cache."""

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

# XLA's persistent compilation cache, in a fresh folder per test process, removed at exit: the
# library builds a new jax.jit per call in places (the sharded init and the train step of every
# trainer.train run, each study evaluation), so every test that trains or evaluates compiled the same
# programs again (a repeated 4-step run: 30 s of CPU, 4.7 s with the cache). A hit loads the
# executable XLA compiled for the same program in this process; nothing is shared between processes
# (xdist workers, or the train.py subprocesses the fault tests start and signal) or between sessions.
if not jax.config.jax_compilation_cache_dir:
  _XLA_CACHE = tempfile.mkdtemp(prefix="jaxpe-tests-xla-cache-")
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)  # not the single eager ops
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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


def pytest_collection_modifyitems(items):
  """Marks the jax.jit variants of the chex property tests (``@chex.variants(with_jit=True, ...)``
  names them ``<test>__with_jit``) with ``jit``: ``pytest -m jit`` runs them all, ``-m 'not jit'``
  skips them."""
  for item in items:
    if item.name.endswith("__with_jit"):
      item.add_marker(pytest.mark.jit)
