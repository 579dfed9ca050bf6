"""The docs run as written: README.md and docs/*.md.

- Every ```python block runs (the blocks of one file in order, in one namespace, in a scratch
  folder, under the suite's strict dtype and rank promotion). A block tagged ```python no-run: <reason>
  is skipped; each says why, and there are at most ``MAX_NO_RUN``.
- Every fenced block names its language (an untagged fence is an error: it would not be run).
- Every shell line of a ```bash block names a command that exists: ``jaxpe-train`` / ``jaxpe-study``
  (and ``python train/*.py``) with options they take and overrides their config schema accepts,
  ``python <script>`` / ``python -m <module>`` with options in its ``--help``, ``pip install`` extras
  that pyproject declares, ``pytest`` paths and markers that exist.
- Every repository path (``tests/...``, ``jaxpe/...``, ``benchmarks/...``), relative link and
  dotted ``jaxpe.`` name the docs cite exists, and none is a deprecated old path.
- docs/api.md lists every name of ``jaxpe.__all__`` and of each package's ``__all__``, and only names
  that exist.
- ``.ci/run`` runs exactly the README's test command.
"""

import functools
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import jaxpe

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
API = ROOT / "docs" / "api.md"
MAX_NO_RUN = 3
# Packages whose ``__all__`` docs/api.md must cover (each has a "## `package`" section).
PACKAGES = [
  "jaxpe.ops",
  "jaxpe.emulation",
  "jaxpe.attention",
  "jaxpe.attention.context",
  "jaxpe.model",
  "jaxpe.bloom",
  "jaxpe.study",
]
# The top-level names: the ones marked ★ in the sections of these packages.
TOP_LEVEL_FROM = ["jaxpe.ops", "jaxpe.emulation", "jaxpe.attention"]

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def _id(path: Path) -> str:
  return str(path.relative_to(ROOT))


def fenced_blocks(path: Path) -> list[tuple[str, str, int]]:
  """``(info string, body, line of the body's first line)`` of every fenced block."""
  text = path.read_text()
  return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start(2)) + 1) for m in FENCE.finditer(text)]


def _prose(path: Path) -> str:
  """The text outside fenced blocks (docs/architecture.md's table of old paths is checked by
  tests/architecture_test.py)."""
  return FENCE.sub("", path.read_text())


# -- code blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_every_fence_names_its_language(path):
  untagged = [line for info, _, line in fenced_blocks(path) if not info]
  assert not untagged, f"{_id(path)}: fenced blocks without a language at lines {untagged}"


def test_no_run_blocks_are_rare_and_say_why():
  no_run = [
    (_id(p), line, info)
    for p in DOCS
    for info, _, line in fenced_blocks(p)
    if info.startswith("python no-run")
  ]
  assert len(no_run) <= MAX_NO_RUN, no_run
  for where, line, info in no_run:
    assert re.fullmatch(r"python no-run: \S.*", info), f"{where}:{line}: ```python no-run: <reason>"


@pytest.mark.parametrize(
  "path", [p for p in DOCS if any(i == "python" for i, _, _ in fenced_blocks(p))], ids=_id
)
def test_python_blocks_run(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # examples may write files
  namespace = {"__name__": f"docs_{path.stem}"}
  for info, body, line in fenced_blocks(path):
    if info == "python":  # "\n" * line: tracebacks give the line in the markdown file
      exec(compile("\n" * (line - 1) + body, str(path), "exec"), namespace)


# -- shell blocks ------------------------------------------------------------------------------


def shell_lines(path: Path) -> list[tuple[str, int]]:
  """Each command of the ```bash blocks (continuations joined, comments dropped, ``&&`` split)."""
  out = []
  for info, body, line in fenced_blocks(path):
    if info != "bash":
      continue
    for n, cmd in enumerate(body.replace("\\\n", " ").splitlines()):
      cmd = re.sub(r"(^|\s)#.*$", "", cmd).strip()
      out.extend((part.strip(), line + n) for part in cmd.split("&&") if part.strip())
  return out


def _pyproject() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


@functools.cache
def _help_text(argv: tuple[str, ...]) -> str:
  proc = subprocess.run(
    [sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, f"{' '.join(argv)} --help failed:\n{proc.stderr[-2000:]}"
  return proc.stdout


def _check_options(words: list[str], help_text: str, where: str) -> None:
  for w in words:
    if w.startswith("--"):
      assert w.split("=")[0] in help_text, f"{where}: {w.split('=')[0]} is not an option"


def _check_jaxpe_command(kind: str, args: list[str], where: str) -> None:
  """A jaxpe-train / jaxpe-study line: its options exist and its config with the overrides validates."""
  from jaxpe.study import load_study_config
  from jaxpe.train.cli import builtin_configs, resolve_config
  from jaxpe.train.config import load_config

  options = {"--config": None, "--data": None}
  flags = {"--debug", "--quick"} if kind == "study" else {"--debug", "--print-config"}
  overrides, i = [], 0
  while i < len(args):
    if args[i] in options:
      options[args[i]] = args[i + 1]
      i += 2
    elif args[i] in flags:
      options[args[i]] = True
      i += 1
    else:
      assert not args[i].startswith("-"), f"{where}: unknown option {args[i]}"
      overrides.append(args[i])
      i += 1
  default = "default" if kind == "train" else ("study_quick" if options.get("--quick") else "study")
  config = options["--config"] or default
  builtin = builtin_configs(study=kind == "study")
  if (ROOT / config).is_file():  # a path in the checkout (configs/tiny.yaml)
    config = str(ROOT / config)
  elif Path(config).stem not in builtin:
    config = default  # a user's file, named only: its overrides are checked against the built-in config
  load = load_config if kind == "train" else load_study_config
  load(resolve_config(config), overrides, unique_overrides=True)


def check_shell_line(cmd: str, where: str) -> None:
  words = shlex.split(cmd)
  while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
    words = words[1:]
  prog, args = words[0], words[1:]
  if prog in ("jaxpe-train", "jaxpe-study"):
    _check_jaxpe_command(prog.removeprefix("jaxpe-"), args, where)
    scripts = _pyproject()["project"]["scripts"]
    assert prog in scripts, f"{where}: pyproject declares no console script {prog}"
  elif prog == "jaxpe-compile":  # jaxpe-train's config and overrides, plus its own options
    assert prog in _pyproject()["project"]["scripts"], f"{where}: pyproject declares no console script {prog}"
    from jaxpe.train.targets import TARGETS

    rest, i = [], 0
    while i < len(args):
      if args[i] in ("--target", "--json"):
        assert args[i] != "--target" or args[i + 1] in TARGETS, f"{where}: no target {args[i + 1]}"
        i += 2
      elif args[i] == "--no-generate":
        i += 1
      else:
        rest.append(args[i])
        i += 1
    _check_jaxpe_command("train", rest, where)
  elif prog in ("jaxpe-sample", "jaxpe-tokenize"):  # positional arguments and options: the options exist
    assert prog in _pyproject()["project"]["scripts"], f"{where}: pyproject declares no console script {prog}"
    _check_options(args, _help_text(("-m", f"jaxpe.train.{prog.removeprefix('jaxpe-')}")), where)
  elif prog == "python" and args[:1] == ["-m"]:
    module = args[1]
    if module == "pytest":
      check_shell_line(shlex.join(["pytest", *args[2:]]), where)
      return
    assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
    _check_options(args[2:], _help_text(("-m", module)), where)
  elif prog == "python":
    script = args[0]
    assert (ROOT / script).is_file(), f"{where}: no script {script}"
    if script in ("train/train.py", "train/study.py"):
      _check_jaxpe_command(Path(script).stem, args[1:], where)
    else:
      _check_options(args[1:], _help_text((script,)), where)
  elif prog == "pip":
    extras = set(_pyproject()["project"]["optional-dependencies"])
    for i, w in enumerate(args):
      if w in ("-c", "--constraint", "-r", "--requirement"):
        assert (ROOT / args[i + 1]).is_file(), f"{where}: no file {args[i + 1]}"
      for group in re.findall(r"\[([\w,]+)\]", w):
        assert set(group.split(",")) <= extras, f"{where}: pyproject declares no extra {group}"
  elif prog == "pytest":
    markers = " ".join(_pyproject()["tool"]["pytest"]["ini_options"]["markers"])
    for i, w in enumerate(args):
      if w == "-m":
        for marker in re.findall(r"[a-z_]+", args[i + 1]):
          assert marker in ("not", "and", "or") or f"{marker}:" in markers, f"{where}: no marker {marker}"
      elif not w.startswith("-") and (i == 0 or args[i - 1] not in ("-m", "-k", "-n")):
        assert (ROOT / w.split("::")[0]).exists(), f"{where}: no test path {w}"
  elif prog == "ruff":
    pass
  elif prog == "bash":
    assert (ROOT / args[0]).is_file(), f"{where}: no script {args[0]}"
  else:
    raise AssertionError(f"{where}: unknown command {prog!r} (teach tests/docs_test.py to check it)")


@pytest.mark.parametrize("path", [p for p in DOCS if shell_lines(p)], ids=_id)
def test_shell_commands_exist(path):
  for cmd, line in shell_lines(path):
    check_shell_line(cmd, f"{_id(path)}:{line}: {cmd}")


# -- paths and names ---------------------------------------------------------------------------

# Cited by docs/architecture.md, created by the other parts of issue 18 (the encoding registry, one
# module per attention backend): checked once they exist; the entry must then go.
PENDING: set[str] = set()

PATH = re.compile(r"(?<![\w/.])((?:tests|jaxpe|benchmarks|train|configs|docs|\.ci)/[\w/.*-]*[\w*/])")
NAME = re.compile(r"(?<![\w.])(jaxpe(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _exists(p: str) -> bool:
  return bool(list(ROOT.glob(p))) if "*" in p else (ROOT / p).exists()


def test_pending_paths_are_still_pending():
  landed = sorted(p for p in PENDING if _exists(p))
  assert not landed, f"these exist now: remove them from PENDING in tests/docs_test.py: {landed}"


@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_cited_paths_exist(path):
  text = _prose(path)  # python blocks run, bash blocks are checked above, diffs show new files
  missing = [p for p in set(PATH.findall(text)) if not _exists(p) and p not in PENDING]
  assert not missing, f"{_id(path)} cites paths that do not exist: {sorted(missing)}"
  links = [lk for lk in LINK.findall(text) if "://" not in lk and not (path.parent / lk).exists()]
  assert not links, f"{_id(path)} links to files that do not exist: {links}"


def resolve(dotted: str):
  """The object a dotted ``jaxpe.`` name means: the longest importable module, then attributes.

  Raises DeprecationWarning for a name whose lookup warns (deprecated), and AttributeError /
  ImportError for a name that does not exist (an old module path of docs/architecture.md's
  changelog among them)."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    module_name = ".".join(parts[:cut])
    try:
      if importlib.util.find_spec(module_name) is None:
        continue
    except ModuleNotFoundError:  # a parent is a module, not a package: an attribute
      continue
    with warnings.catch_warnings():
      warnings.simplefilter("error", DeprecationWarning)
      obj = importlib.import_module(module_name)
      for attr in parts[cut:]:
        obj = getattr(obj, attr)
    return obj
  raise ImportError(dotted)


@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_cited_names_exist(path):
  bad = []
  text = re.sub(r"<!-- old-paths: begin -->.*?<!-- old-paths: end -->", "", _prose(path), flags=re.S)
  for name in sorted(set(NAME.findall(text))):
    try:
      resolve(name)
    except (AssertionError, AttributeError, ImportError, DeprecationWarning) as e:
      bad.append(f"{name} ({type(e).__name__}: {e})")
  assert not bad, f"{_id(path)} cites names that do not exist or are deprecated: {bad}"


# -- docs/api.md against __all__ ---------------------------------------------------------------

IDENT = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def api_sections() -> dict[str, list[tuple[str, bool]]]:
  """``module -> [(name, starred)]`` of docs/api.md: the names a bullet starts with (the backticked
  names before the first ``\\`:``) under each "## `module`" heading; ★ marks top-level names."""
  sections = {}
  for chunk in re.split(r"^## ", API.read_text(), flags=re.M)[1:]:
    heading, _, body = chunk.partition("\n")
    m = re.fullmatch(r"`(jaxpe(?:\.\w+)*)`", heading.strip())
    if not m:
      continue
    names = []
    for bullet in re.findall(r"^- (.*(?:\n  .*)*)", body, re.M):
      head = bullet.split("`:", 1)[0] + "`"
      if not head.lstrip("★ ").startswith("`"):
        continue  # prose
      for starred, span in re.findall(r"(★ )?`([^`]+)`", head):
        names.append((IDENT.match(span).group(0), bool(starred)))
    sections[m.group(1)] = names
  return sections


@pytest.mark.parametrize("package", PACKAGES)
def test_api_lists_every_exported_name(package):
  documented = {name for name, _ in api_sections().get(package, [])}
  missing = sorted(set(importlib.import_module(package).__all__) - documented)
  assert not missing, f"docs/api.md, section `{package}`, lacks {missing}"


def test_api_stars_exactly_the_top_level_names():
  sections = api_sections()
  starred = {name for p in sections for name, star in sections[p] if star}
  assert starred == set(jaxpe.__all__), (
    f"not starred: {sorted(set(jaxpe.__all__) - starred)}; starred but not top-level: {sorted(starred - set(jaxpe.__all__))}"
  )
  elsewhere = {name for p in sections if p not in TOP_LEVEL_FROM for name, star in sections[p] if star}
  assert not elsewhere, f"★ outside {TOP_LEVEL_FROM}: {sorted(elsewhere)}"


def test_api_names_exist():
  stale = []
  for module, names in api_sections().items():
    exported = getattr(importlib.import_module(module), "__all__", None)
    for name, _ in names:
      try:
        resolve(f"{module}.{name}")
      except (AssertionError, AttributeError, ImportError, DeprecationWarning) as e:
        stale.append(f"{module}.{name} ({type(e).__name__})")
        continue
      if exported is not None and name.split(".")[0] not in exported:
        stale.append(f"{module}.{name} (not in {module}.__all__)")
  assert not stale, f"docs/api.md documents names that do not exist: {stale}"


# -- CI ----------------------------------------------------------------------------------------


def test_ci_runs_the_readme_test_command():
  readme_commands = [body for info, body, _ in fenced_blocks(README) if info == "bash"]
  test_command = next(c.strip() for c in readme_commands if "pytest" in c)
  ci = (ROOT / ".ci" / "run").read_text()
  assert test_command in ci.splitlines()
