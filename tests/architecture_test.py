"""The package layout of docs/architecture.md, checked on the source (every import statement, also
those inside functions; ``if TYPE_CHECKING:`` blocks excluded, they never run):

- no import cycle among jaxpe modules (so no import inside a function can be hiding one);
- layers: ``ops -> emulation -> attention -> model -> train -> bloom -> study``; a module imports
  jaxpe modules of its own layer or below (``bloom`` not ``train``; ``study`` anything), the
  top-level ``jaxpe`` package only the first three, ``jaxpe.errors`` and ``jaxpe._compat`` none;
- third-party packages per layer, as the extras of pyproject.toml install them: ``jaxpe.ops`` (and
  emulation, attention, the top level) import jax and numpy only, never Flax; optional heavy
  packages (matplotlib, torch, ...) only inside functions;
- ``import jaxpe`` (and its ops) loads no Flax, optax, orbax, pydantic, matplotlib or chex;
- no module longer than ``MAX_LINES`` (``LONG_MODULES`` lists the exceptions, each with its reason);
- docs/architecture.md's table of old module paths is ``jaxpe._compat.MOVED``.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpe import _compat

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxpe"
LAYERS = ["ops", "emulation", "attention", "model", "train", "bloom", "study"]
MAX_LINES = 450
LONG_MODULES: dict[str, str] = {}  # "jaxpe.x.y": why it may exceed MAX_LINES
# jaxpe modules each layer may import (besides its own package): the layers below it.
MAY_IMPORT = {layer: set(LAYERS[:i]) | {"errors"} for i, layer in enumerate(LAYERS)}
MAY_IMPORT["bloom"] -= {"train"}
MAY_IMPORT["study"] = set(LAYERS) | {"errors"}
MAY_IMPORT["jaxpe"] = {"ops", "emulation", "attention", "errors", "_compat"}  # jaxpe/__init__.py
MAY_IMPORT["errors"] = set()
MAY_IMPORT["_compat"] = set()
MAY_IMPORT["commands"] = {"errors"}  # the console scripts: their commands are imported when run
# Third-party packages a layer imports at module level (pyproject.toml's extras install them).
_CORE = {"jax", "numpy"}
_MODEL = _CORE | {"flax", "pydantic", "pydantic_core", "yaml", "annotated_types"}
_TRAIN = _MODEL | {"optax", "orbax", "tqdm", "tensorboardX"}
THIRD_PARTY = {
  "jaxpe": _CORE,
  "errors": set(),
  "_compat": set(),
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
OPTIONAL = {"matplotlib", "torch", "transformers", "safetensors", "tensorboardX", "tokamax", "absl"}
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


def imports(module: str) -> list[tuple[str, int, bool]]:
  """``(imported module, line, at module level)`` of every import that runs: jaxpe modules resolved
  to the module file that is executed (``from jaxpe.ops import checks`` -> ``jaxpe.ops.checks``,
  ``from jaxpe.ops import apply_rope`` -> ``jaxpe.ops``), other packages by their full name."""
  path = MODULES[module]
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  out: list[tuple[str, int, bool]] = []

  def visit(node: ast.AST, top: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and _is_type_checking(child):
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
        out.append((sub if sub in MODULES else base, node.lineno, top))
    else:
      inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
      visit(node, inner)

  visit(ast.parse(path.read_text()), True)
  return out


def jaxpe_edges() -> dict[str, set[str]]:
  return {
    m: {target for target, _, _ in imports(m) if target.split(".")[0] == "jaxpe" and target != m}
    for m in MODULES
  }


def test_every_import_resolves_to_a_module():
  unknown = [
    f"{m}:{line} imports {t}"
    for m in MODULES
    for t, line, _ in imports(m)
    if t.split(".")[0] == "jaxpe" and t not in MODULES and t not in _compat.MOVED
  ]
  assert not unknown, unknown


def test_no_old_module_paths_inside_the_package():
  old = [f"{m}:{line} imports {t}" for m in MODULES for t, line, _ in imports(m) if t in _compat.MOVED]
  assert not old, f"imports of deprecated paths (jaxpe._compat.MOVED): {old}"


def test_no_import_cycles():
  edges = jaxpe_edges()
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  cycles: list[list[str]] = []

  def connect(v: str) -> None:  # Tarjan's strongly connected components
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
  detail = [
    f"{' <-> '.join(c)}: " + "; ".join(f"{a} imports {b}" for a in c for b in sorted(edges[a] & set(c)))
    for c in cycles
  ]
  assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_each_package_imports_only_its_layer_and_below():
  bad = []
  for m in MODULES:
    own = layer(m)
    for target, line, _ in imports(m):
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


def test_third_party_imports_match_the_extras():
  bad = []
  for m in MODULES:
    allowed = THIRD_PARTY[layer(m)]
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


def test_architecture_doc_lists_the_old_module_paths():
  doc = (ROOT / "docs" / "architecture.md").read_text()
  text = re.search(r"<!-- old-paths: begin -->(.*?)<!-- old-paths: end -->", doc, re.S).group(1)
  rows = dict(re.findall(r"^\| `(jaxpe[\w.]*)` \| (.*) \|$", text, re.M))
  table = {old: tuple(re.findall(r"`(jaxpe[\w.]*)`", new)) for old, new in rows.items()}
  assert table == _compat.MOVED


@pytest.mark.parametrize("old", sorted(_compat.MOVED))
def test_old_paths_point_to_modules_that_exist(old):
  assert all(target in MODULES for target in _compat.MOVED[old]), _compat.MOVED[old]
