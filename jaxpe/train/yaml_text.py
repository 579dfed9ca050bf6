"""YAML text as the configs read it: files and ``key=value`` override values (``jaxpe.train.config``
and ``jaxpe.study.config`` use these). A key given twice in one mapping is refused; numbers with an
exponent (``3e-4``) are floats as in YAML 1.2, not the strings PyYAML's YAML 1.1 makes of them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class UniqueKeyLoader(yaml.SafeLoader):
  """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML keeps the last)."""

  def construct_mapping(self, node, deep=False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=True)
      line = key_node.start_mark.line + 1
      if key in seen:
        raise yaml.constructor.ConstructorError(
          None, None, f"duplicate key {key!r} (first given on line {seen[key]})", key_node.start_mark
        )
      seen[key] = line
    return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads a plain number with an exponent but no dot or no exponent sign (``3e-4``,
# ``1e4``, ``1.0e5``) as a string, which the strict schema then refuses as "not a valid number";
# YAML 1.2 and every other reader take it as a float. Files, overrides and values inside flow
# collections (``model.rope_scaling={rope_type: linear, factor: 1e2}``) all go through this loader.
UniqueKeyLoader.add_implicit_resolver(
  "tag:yaml.org,2002:float",
  re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
  list("-+0123456789."),
)


def read_text(path: Path, source: str) -> str:
  """``path``'s UTF-8 text.

  Raises:
    ValueError: bytes that are not UTF-8, naming ``source``, the line and the byte.
  """
  data = path.read_bytes()
  try:
    return data.decode()
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise ValueError(f"{source} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None


def load_yaml(text: str, source: str) -> Any:
  """Parses YAML ``text``; errors name ``source`` (a file or an override) and the line.

  Raises:
    ValueError: invalid YAML or a duplicate key.
  """
  try:
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e)
    raise ValueError(f"{source}{where}: {problem}") from None


def parse_value(raw: str, key: str = "") -> Any:
  """YAML value syntax, plus unquoted numbers YAML 1.1 reads as strings (``1e-2``); quoted values
  (``'1e3'``) stay strings. The value's type is then checked by the schema (strict: ``workdir=1e3``
  or ``sample_prompt=yes`` are refused, not turned into strings).

  Raises:
    ValueError: an empty value, invalid YAML, or text after the value that YAML would drop as a
      comment (``path=my text #2.txt`` would read ``my text``).
  """
  where = f"override {key}={raw!r}" if key else f"override value {raw!r}"
  if not raw.strip():
    raise ValueError(
      f"{where} has no value; write {key or 'key'}=null for null or quote an empty string ('')"
    )
  value = load_yaml(raw, where)
  try:
    node = yaml.compose(raw, Loader=yaml.SafeLoader)
  except yaml.YAMLError:  # pragma: no cover (parsed above)
    node = None
  if node is None or raw[node.end_mark.index :].strip():
    raise ValueError(
      f"{where}: YAML reads the text after ' #' as a comment and drops it; quote the value "
      f"({key or 'key'}='...') to keep it"
    )
  if isinstance(value, str) and raw.strip()[:1] not in ("'", '"'):
    try:
      return float(value)
    except ValueError:
      pass
  return value


def load_yaml_file(path: str | Path, what: str = "config file") -> dict[str, Any]:
  """The mapping in the YAML file ``path`` (``{}`` for an empty file).

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: a directory, not UTF-8, not valid YAML, a key given twice in one mapping (named with its line),
      or not a mapping at the top.
  """
  path = Path(path)
  source = f"{what} {str(path)!r}"
  if path.is_dir():
    raise ValueError(f"{source} is a directory; give a YAML file")
  if not path.is_file():
    raise FileNotFoundError(f"{source} does not exist")
  raw = load_yaml(read_text(path, source), source)
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ValueError(f"{source} must hold a mapping, got {type(raw).__name__}")
  return raw


__all__ = ["UniqueKeyLoader", "load_yaml", "load_yaml_file", "parse_value", "read_text"]
