"""The package layout of docs/architecture.md, checked on the source (every import statement, also
those inside functions and, for cycles, those under ``if TYPE_CHECKING:``):

- no import cycle among jaxpe modules: an import inside a function, one under ``if TYPE_CHECKING:``
  (a type-level cycle: ``jaxpe.model.config`` -> ``bias_options`` -> ``config`` hid there until issue
  38) and ``importlib.import_module("jaxpe...")`` with a constant name all count;
- layers: ``ops -> emulation -> attention -> model -> train -> bloom -> study``; a module imports
  jaxpe modules of its own layer or below (``bloom`` not ``train``; ``study`` anything), the
  top-level ``jaxpe`` package only the first three, ``jaxpe.errors`` none;
- third-party packages per layer, as the extras of pyproject.toml install them: ``jaxpe.ops`` (and
  emulation, attention, the top level) import jax and numpy only, never Flax; optional heavy
  packages (matplotlib, torch, ...) only inside functions;
- ``import jaxpe`` (and its ops) loads no Flax, optax, orbax, pydantic, matplotlib or chex;
- no module longer than ``MAX_LINES`` (``LONG_MODULES`` lists the exceptions, each with its reason);
- the old module paths of docs/architecture.md's changelog are gone, and their new modules exist.
"""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxpe"
LAYERS = ["ops", "emulation", "attention", "model", "train", "bloom", "study"]
MAX_LINES = 450
LONG_MODULES: dict[str, str] = {  # "jaxpe.x.y": why it may exceed MAX_LINES
  "jaxpe.ops.hf_rope": "HFRope and rope_from_hf_config: one public contract whose docstrings state every "
  "family rule and stated fact (the rules themselves live in hf_config / hf_families / hf_verified)",
}
# jaxpe modules each layer may import (besides its own package): the layers below it.
MAY_IMPORT = {layer: set(LAYERS[:i]) | {"errors"} for i, layer in enumerate(LAYERS)}
MAY_IMPORT["bloom"] -= {"train"}
MAY_IMPORT["study"] = set(LAYERS) | {"errors"}
MAY_IMPORT["jaxpe"] = {"ops", "emulation", "attention", "errors"}  # jaxpe/__init__.py
MAY_IMPORT["errors"] = set()
MAY_IMPORT["commands"] = {"errors"}  # the console scripts: their commands are imported when run
# Third-party packages a layer imports at module level (pyproject.toml's extras install them).
_CORE = {"jax", "numpy"}
_MODEL = _CORE | {"flax", "pydantic", "pydantic_core", "ruamel", "annotated_types"}
_TRAIN = _MODEL | {"optax", "orbax", "tqdm", "tensorboardX"}
THIRD_PARTY = {
  "jaxpe": _CORE,
  "errors": set(),
  "commands": set(),
  "ops": _CORE,
  "emulation": _CORE,
  "attention": _CORE,
  "model": _MODEL,
  "train": _TRAIN,
  "bloom": _MODEL,
  "study": _TRAIN,
}
# Imported only inside functions, by code that needs them (an extra, or a plot).
OPTIONAL = {
  "matplotlib",
  "torch",
  "transformers",
  "safetensors",
  "tensorboardX",
  "tokamax",
  "absl",
  "tokenizers",
  "grain",
}
HEAVY = ["flax", "optax", "orbax", "pydantic", "matplotlib", "chex", "torch", "transformers", "tensorstore"]


def module_name(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
  """``jaxpe.ops.rope`` -> ``ops``; ``jaxpe`` -> ``jaxpe``; ``jaxpe.errors`` -> ``errors``."""
  return module.split(".")[1] if "." in module else module


def _is_type_checking(node: ast.If) -> bool:
  test = node.test
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def imports(module: str, type_checking: bool = False) -> list[tuple[str, int, bool]]:
  """``(imported module, line, at module level)`` of every import that runs: jaxpe modules resolved
  to the module file that is executed (``from jaxpe.ops import checks`` -> ``jaxpe.ops.checks``,
  ``from jaxpe.ops import apply_rope`` -> ``jaxpe.ops``), other packages by their full name;
  ``importlib.import_module("name")`` with a constant name as an import inside a function. With
  ``type_checking``, also the imports under ``if TYPE_CHECKING:`` (at module level)."""
  return imports_in(MODULES[module].read_text(), module, MODULES[module].name == "__init__.py", type_checking)


def imports_in(source: str, module: str, is_package: bool, type_checking: bool = False, modules=None):
  """``imports`` of the module ``module`` whose text is ``source`` (``modules``: the module names
  an import may resolve to, default the package's)."""
  modules = MODULES if modules is None else modules
  package = module if is_package else module.rpartition(".")[0]
  out: list[tuple[str, int, bool]] = []

  def visit(node: ast.AST, top: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and _is_type_checking(child):
        for sub in child.body if type_checking else ():
          visit_one(sub, top)
        for sub in child.orelse:
          visit_one(sub, top)
        continue
      visit_one(child, top)

  def visit_one(node: ast.AST, top: bool) -> None:
    if isinstance(node, ast.Import):
      out.extend((a.name, node.lineno, top) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
      for a in node.names:
        sub = f"{base}.{a.name}"
        out.append((sub if sub in modules else base, node.lineno, top))
    else:
      if (
        isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
        in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
      ):
        out.append((node.args[0].value, node.lineno, False))
      inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
      visit(node, inner)

  visit(ast.parse(source), True)
  return out


def jaxpe_edges(type_checking: bool = False) -> dict[str, set[str]]:
  return {
    m: {t for t, _, _ in imports(m, type_checking) if t.split(".")[0] == "jaxpe" and t != m} for m in MODULES
  }


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module of the graph ``edges`` (module ->
  the modules it imports), each sorted: every import cycle lies in one (Tarjan's algorithm)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  cycles: list[list[str]] = []

  def connect(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(edges):
    if v not in index:
      connect(v)
  return cycles


def old_module_paths() -> dict[str, tuple[str, ...]]:
  """docs/architecture.md's changelog table: old module path -> the modules its names moved to."""
  doc = (ROOT / "docs" / "architecture.md").read_text()
  text = re.search(r"<!-- old-paths: begin -->(.*?)<!-- old-paths: end -->", doc, re.S).group(1)
  rows = dict(re.findall(r"^\| `(jaxpe[\w.]*)` \| (.*) \|$", text, re.M))
  return {old: tuple(re.findall(r"`(jaxpe[\w.]*)`", new)) for old, new in rows.items()}


OLD_PATHS = old_module_paths()


def test_every_import_resolves_to_a_module():
  unknown = [
    f"{m}:{line} imports {t}"
    for m in MODULES
    for t, line, _ in imports(m)
    if t.split(".")[0] == "jaxpe" and t not in MODULES
  ]
  assert not unknown, unknown


def test_no_old_module_paths_inside_the_package():
  old = [f"{m}:{line} imports {t}" for m in MODULES for t, line, _ in imports(m, True) if t in OLD_PATHS]
  assert not old, f"imports of removed module paths (docs/architecture.md's changelog): {old}"


def test_no_import_cycles():
  edges = jaxpe_edges(type_checking=True)
  cycles = import_cycles(edges)
  detail = [
    f"{' <-> '.join(c)}: " + "; ".join(f"{a} imports {b}" for a in c for b in sorted(edges[a] & set(c)))
    for c in cycles
  ]
  assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_cycle_check_sees_imports_inside_functions_type_checking_and_import_module():
  # A package of three modules, each cycle closed by a different kind of import: the check must
  # find all three (this is how config -> bias_options -> config went unseen: TYPE_CHECKING).
  fake = {
    "p.a": "from p import b\n",
    "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from p.a import X\n",
    "p.c": "def f():\n  from p import d\n",
    "p.d": "import p.c\n",
    "p.e": "import importlib\ndef f():\n  return importlib.import_module('p.f')\n",
    "p.f": "from p.e import g\n",
  }
  edges = {
    m: {t for t, _, _ in imports_in(src, m, False, True, fake) if t in fake} for m, src in fake.items()
  }
  assert import_cycles(edges) == [["p.a", "p.b"], ["p.c", "p.d"], ["p.e", "p.f"]]
  without_type_checking = {
    m: {t for t, _, _ in imports_in(src, m, False, False, fake) if t in fake} for m, src in fake.items()
  }
  assert ["p.a", "p.b"] not in import_cycles(without_type_checking)


def test_every_module_belongs_to_a_layer():
  assert {layer(m) for m in MODULES} == set(THIRD_PARTY) == set(MAY_IMPORT), sorted(
    {layer(m) for m in MODULES}
  )


@pytest.mark.parametrize("own", sorted(THIRD_PARTY))
def test_each_package_imports_only_its_layer_and_below(own):
  bad = []
  for m in (m for m in MODULES if layer(m) == own):
    for target, line, _ in imports(m, type_checking=True):
      if target.split(".")[0] != "jaxpe" or target not in MODULES:
        continue
      other = layer(target)
      if other != own and other not in MAY_IMPORT[own]:
        bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {m} ({own}) imports {target} ({other})")
  assert not bad, (
    "imports against the layer order ops -> emulation -> attention -> model -> train -> bloom -> study:\n"
    + "\n".join(bad)
  )


def test_ops_import_neither_flax_nor_anything_above_them():
  bad = [
    f"{m}:{line} imports {t}"
    for m in MODULES
    if layer(m) == "ops"
    for t, line, _ in imports(m)
    if t.split(".")[0] == "flax" or (t.split(".")[0] == "jaxpe" and layer(t) != "ops")
  ]
  assert not bad, bad


@pytest.mark.parametrize("own", sorted(THIRD_PARTY))
def test_third_party_imports_match_the_extras(own):
  bad = []
  for m in (m for m in MODULES if layer(m) == own):
    allowed = THIRD_PARTY[own]
    for target, line, top in imports(m):
      name = target.split(".")[0]
      if name in ("jaxpe", "__future__") or name in sys.stdlib_module_names:
        continue
      if name in allowed or (not top and name in OPTIONAL):
        continue
      where = "at module level" if top else "inside a function"
      bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {m} imports {name} {where}")
  assert not bad, "third-party imports outside the layer's extra:\n" + "\n".join(bad)


def test_import_jaxpe_loads_no_heavy_package():
  code = (
    "import sys, jaxpe, jaxpe.ops, jaxpe.emulation, jaxpe.attention; jaxpe.apply_rope\n"
    f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
  )
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "[]", f"import jaxpe loaded {proc.stdout.strip()}"


def test_no_module_is_too_long():
  long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
  too_long = {m: n for m, n in long.items() if n > MAX_LINES and m not in LONG_MODULES}
  assert not too_long, (
    f"modules over {MAX_LINES} lines (split them, or list them in LONG_MODULES with a reason): {too_long}"
  )
  stale = [m for m in LONG_MODULES if m not in long or long[m] <= MAX_LINES]
  assert not stale, f"LONG_MODULES entries no longer needed: {stale}"


def test_the_changelog_lists_the_old_module_paths():
  assert len(OLD_PATHS) == 22 and all(OLD_PATHS.values()), OLD_PATHS
  assert not (PACKAGE / "_compat.py").exists()


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_is_removed_and_its_new_modules_exist(old):
  assert old not in MODULES and importlib.util.find_spec(old) is None, f"{old} still imports"
  assert all(target in MODULES for target in OLD_PATHS[old]), OLD_PATHS[old]


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_is_no_attribute_of_the_package(old):
  # jaxpe.__getattr__ served ``jaxpe.rope`` etc. as attributes until issue 38.
  import jaxpe

  assert not hasattr(jaxpe, old.removeprefix("jaxpe.")), f"jaxpe still has {old}"
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module(old)
