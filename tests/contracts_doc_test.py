"""docs/contracts.md covers every public entry point the issue names, and each is walked by a test.

The table is the contract: an entry point missing from it has no written contract, and one whose
name appears in no ``tests/contracts_*_test.py`` file is not walked by the hostile-input suite.
"""

import re
from pathlib import Path

import pytest

import jaxpe

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "contracts.md").read_text()
SUITE = "\n".join(p.read_text() for p in sorted((ROOT / "tests").rglob("contracts_*_test.py")))

# Beyond jaxpe.__all__: the entry points issue 17 names, as they are spelled in the docs.
OTHER_ENTRY_POINTS = [
  "kernels.attention",
  "generate",
  "bloom.from_hf",
  "save_hf",
  "train/train.py",
  "train/study.py",
]


def _documented(name: str) -> bool:
  return re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", DOC) is not None


@pytest.mark.parametrize("name", sorted(jaxpe.__all__) + OTHER_ENTRY_POINTS)
def test_every_entry_point_has_a_contract_table(name):
  assert _documented(name), f"docs/contracts.md has no contract for {name}"


@pytest.mark.parametrize("name", sorted(n for n in jaxpe.__all__ if callable(getattr(jaxpe, n))))
def test_every_public_name_is_walked_by_the_hostile_suite(name):
  assert re.search(rf"\b{re.escape(name)}\b", SUITE), f"no tests/contracts_*_test.py walks {name}"


def test_every_section_is_filled():
  sections = re.findall(r"<!-- (\w+): section begins -->(.*?)<!-- \1: section ends -->", DOC, re.S)
  assert [area for area, _ in sections] == ["ops", "attention", "model", "cli", "runs", "numerics", "issue48"]
  for area, body in sections:
    assert body.count("\n|") >= 3, f"section {area} of docs/contracts.md has no table"
