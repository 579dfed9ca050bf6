"""Stale numbers and commands in the docs (issue 37, item 12): documented training commands that
share a workdir must be resumable from each other (following README.md and docs/training.md both
was refused: two configs in ``runs/alibi``), no test count that rots, ``--quick``'s time as
measured, and README's "Measured" one table of current figures with the history in
``benchmarks/results/HISTORY.md``."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from jaxpe.train import cli, config, run_checks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"  # the README's measurements, moved there (issue 48)
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _train_commands() -> list[tuple[str, list[str]]]:
  """(where, argv) of every single-host ``jaxpe-train`` / ``python train/train.py`` command in the
  docs' bash blocks (a multi-line or multi-process command excluded)."""
  out = []
  for path in DOCS:
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
      for line in block.splitlines():
        for part in line.split("#")[0].split("&&"):
          part = part.strip()
          if part.endswith("\\") or "distributed." in part:
            continue
          words = shlex.split(part)
          if words[:1] == ["jaxpe-train"]:
            out.append((f"{path.name}: {part}", words[1:]))
          elif words[:2] == ["python", "train/train.py"]:
            out.append((f"{path.name}: {part}", words[2:]))
  return out


def _config(argv: list[str]) -> config.TrainConfig:
  overrides = [a for a in argv if "=" in a and not a.startswith("-")]
  name = argv[argv.index("--config") + 1] if "--config" in argv else "default"
  name = Path(name).stem if name.startswith("configs/") else name
  cfg = config.load_config(cli.resolve_config(name), overrides)
  if "--data" in argv:  # the data's path is part of the run: kept as given, not read
    cfg = cfg.model_copy(
      update={"data": cfg.data.model_copy(update={"path": argv[argv.index("--data") + 1]})}
    )
  return cfg


def test_documented_commands_that_share_a_workdir_can_follow_each_other():
  commands = _train_commands()
  assert len(commands) >= 6, commands
  by_workdir: dict[str, list[tuple[str, config.TrainConfig]]] = {}
  for where, argv in commands:
    cfg = _config(argv)
    by_workdir.setdefault(cfg.workdir, []).append((where, cfg))
  refused = []
  for workdir, runs in by_workdir.items():
    first_where, first = runs[0]
    for where, cfg in runs[1:]:
      try:
        run_checks.check_resume_config(first.model_dump_json(), cfg, source=first_where)
      except ValueError as e:
        refused.append(f"{workdir}: {first_where!r} then {where!r}: {e}")
  assert not refused, "\n".join(refused)


def test_no_test_count_in_the_docs():
  """A count of tests goes stale with the next test (docs/rope.md said 207 where 198 were)."""
  stale = [(p.name, m) for p in DOCS for m in re.findall(r"\(\d+ tests\.\)", p.read_text())]
  assert not stale, stale


def test_quick_benchmarks_time_is_the_measured_one():
  """``benchmarks/run.py --quick`` took 440 s on the 2-core machine, not "about 1 min"."""
  run_py = (ROOT / "benchmarks" / "run.py").read_text()
  help_text = re.search(r'"--quick".*?help="([^"]*)"', run_py, re.S)[1]
  assert "about 7 min" in help_text, help_text
  assert "--quick: small shapes, about 7 min" in RESULTS.read_text()


def _measured() -> str:
  text = RESULTS.read_text()
  start = text.index("\n## Measured\n")
  return text[start : text.index("\n### ", start)]


def test_measured_is_one_table_of_current_figures_and_the_history_is_kept():
  section = _measured()
  generated = section.index("<!-- benchmarks:begin")
  head = section[:generated]
  tables = re.findall(r"(?:^\|.*\|\n)+", head, re.M)
  assert len(tables) == 1, tables
  assert not re.search(r"^- ", head, re.M), "the Measured section lists runs as a diary again"
  history = ROOT / "benchmarks" / "results" / "HISTORY.md"
  assert history.is_file() and "4d12f87" in history.read_text()  # an earlier training run
  assert "benchmarks/results/HISTORY.md" in head


@pytest.mark.parametrize("where, argv", _train_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_each_documented_command_is_a_valid_config(where, argv):
  _config(argv)
