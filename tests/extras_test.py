"""Missing extras (issue 37, item 3): every console script and every optional import names the
extra to install instead of failing with a bare ``No module named ...``.

The core install has jax and numpy only. A fresh subprocess blocks the other packages the way
Python documents (``sys.modules[name] = None``: ``import name`` then raises ImportError), one case at
a time, and runs the console scripts' entry points and the imports. ``scripts/core_install_check.sh``
does the same in a real virtual environment with only the core install.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jaxpe import errors

ROOT = Path(__file__).resolve().parent.parent

_CASES = r"""
import contextlib, io, json, sys
import jax, numpy  # the core install (C extensions are not re-imported: only jaxpe's modules are)
saved = {}

def fresh(blocked):
  for name in [n for n in sys.modules if n == "jaxpe" or n.startswith("jaxpe.")]:
    del sys.modules[name]
  for name, module in saved.items():
    if module is None:
      sys.modules.pop(name, None)
    else:
      sys.modules[name] = module
  saved.clear()
  for name in blocked:
    saved[name] = sys.modules.get(name)
    sys.modules[name] = None

def script(entry, argv, blocked):
  fresh(blocked)
  from jaxpe import commands
  err = io.StringIO()
  sys.argv = [entry, *argv]
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      getattr(commands, entry.split("-")[1])()
      code = 0
    except SystemExit as e:
      code = e.code
  return {"code": code, "stderr": err.getvalue()}

def checkout(script, blocked):
  import runpy
  fresh(blocked)
  err = io.StringIO()
  sys.argv = [script, "--help"]
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      runpy.run_path(script, run_name="__main__")
      code = 0
    except SystemExit as e:
      code = e.code
  return {"code": code, "stderr": err.getvalue()}

def imported(module, blocked, call=None):
  fresh(blocked)
  try:
    mod = __import__(module, fromlist=["_"])
    if call:
      getattr(mod, call[0])(*call[1:])
    return {"code": 0, "stderr": ""}
  except ImportError as e:
    return {"code": type(e).__name__, "stderr": str(e)}

out = {
  "train_core": script("jaxpe-train", ["--help"], ["pydantic", "flax", "ruamel", "optax", "orbax", "tqdm"]),
  "train_model_only": script("jaxpe-train", ["--help"], ["optax", "orbax", "tqdm", "matplotlib"]),
  "study_core": script("jaxpe-study", ["--help"], ["flax", "pydantic"]),
  "sample_core": script("jaxpe-sample", ["--help"], ["flax", "optax"]),
  "train_checkout": checkout("train/train.py", ["pydantic"]),
  "study_checkout": checkout("train/study.py", ["tqdm"]),
  "model": imported("jaxpe.model", ["flax"]),
  "model_config": imported("jaxpe.model.config", ["pydantic"]),
  "train_data": imported("jaxpe.train.data", ["tqdm"]),
  "bloom": imported("jaxpe.bloom", ["ruamel"]),
  "study": imported("jaxpe.study", ["orbax"]),
  "core": imported("jaxpe", ["flax", "pydantic", "ruamel", "optax", "orbax", "tqdm", "torch"]),
  "bloom_torch": imported("jaxpe.bloom.hf_import", ["torch"], ("_read_torch_bin", "x.bin")),
  "bloom_safetensors": imported("jaxpe.bloom.hf_import", ["safetensors"], ("_read_safetensors", "x.st")),
  "bloom_transformers": imported("jaxpe.bloom.hf_export", ["transformers"], ("to_transformers", None)),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cases() -> dict:
  proc = subprocess.run([sys.executable, "-c", _CASES], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
  "case, extra, module",
  [
    ("train_core", "train", "pydantic"),  # jaxpe-train from the core install (main: a traceback)
    ("train_model_only", "train", "tqdm"),  # jaxpe-train with the model extra only
    ("study_core", "train", "flax"),
    ("sample_core", "train", "flax"),
    ("train_checkout", "train", "pydantic"),  # python train/train.py from a checkout
    ("study_checkout", "train", "tqdm"),
  ],
)
def test_a_console_script_names_the_extra_in_one_line(cases, case, extra, module):
  got = cases[case]
  assert got["code"] == 2, got
  line = got["stderr"].strip()
  assert "\n" not in line and "Traceback" not in line, line
  assert f'pip install "jaxpe[{extra}]"' in line and module in line, line


@pytest.mark.parametrize(
  "case, extra, module",
  [
    ("model", "model", "flax"),
    ("model_config", "model", "pydantic"),
    ("train_data", "train", "tqdm"),
    ("bloom", "model", "ruamel.yaml"),
    ("study", "train", "orbax-checkpoint"),
    ("bloom_torch", "bloom", "torch"),
    ("bloom_safetensors", "bloom", "safetensors"),
    ("bloom_transformers", "bloom", "transformers"),
  ],
)
def test_an_optional_import_names_the_extra(cases, case, extra, module):
  got = cases[case]
  assert got["code"] == "MissingExtraError", got
  assert f'pip install "jaxpe[{extra}]"' in got["stderr"] and module in got["stderr"], got


def test_the_core_install_imports_jaxpe(cases):
  assert cases["core"] == {"code": 0, "stderr": ""}


def _extra_requirements(extra: str, table: dict) -> set[str]:
  names = set()
  for req in table[extra]:
    name = req.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower()
    if name == "jaxpe":
      inner = req.split("[")[1].split("]")[0]
      names |= _extra_requirements(inner, table)
    else:
      names.add(name)
  return names


def test_the_checked_modules_are_the_extras_of_pyproject():
  table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  for extra, modules in errors.EXTRAS.items():
    wanted = {errors._DISTRIBUTIONS.get(m, m).lower() for m in modules}
    assert wanted <= _extra_requirements(extra, table), (extra, wanted)


def test_the_console_scripts_go_through_jaxpe_commands():
  scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
  from jaxpe import commands

  assert {name: target.split(":")[0] for name, target in scripts.items()} == dict.fromkeys(
    commands.COMMANDS, "jaxpe.commands"
  )
  for name, target in scripts.items():
    assert callable(getattr(commands, target.split(":")[1])), name


def _install_section() -> str:
  readme = (ROOT / "README.md").read_text()
  return readme[readme.index("## Install") : readme.index("## A short tour")]


def test_the_install_section_says_how_to_install_without_a_registry_and_torch_for_cpu():
  """Issue 37 item 4: ``pip install jaxpe`` is on no registry yet, and ``.[bloom]`` resolves the CUDA
  build of torch (6.3 GB) on a CPU machine: the section names the checkout and wheel installs and
  PyTorch's CPU index, before the extra."""
  section = _install_section()
  assert "pip install ." in section and "pip wheel --no-deps -w dist ." in section
  cpu = section.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
  assert cpu < section.index('pip install ".[bloom]"', cpu)
  assert "not on a package registry yet" in section
