"""The README's code examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_python_examples_run(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # examples may write files
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert blocks
  for block in blocks:  # under the suite's strict dtype and rank promotion
    exec(compile(block, str(README), "exec"), {})


def test_ci_runs_the_readme_test_command():
  readme_commands = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
  test_command = next(c.strip() for c in readme_commands if "pytest" in c)
  ci = (README.parent / ".ci" / "run").read_text()
  assert test_command in ci.splitlines()
