"""YAML text as the configs read it: files and ``key=value`` override values (``jaxpe.train.config``
and ``jaxpe.study.config`` use these), read as YAML 1.2 (its core schema) by ruamel.yaml, PyYAML's
YAML 1.2 successor: ``010`` is ten (YAML 1.1: eight), ``3e-4`` a float (YAML 1.1: a string), ``yes``,
``on``, ``nan`` and ``inf`` strings (YAML 1.1: booleans; Python's ``float``: numbers; YAML 1.2 spells
them ``true``, ``.nan``, ``.inf``), and a date such as ``2024-01-01`` a string (YAML 1.2 has no
timestamps). Merge keys (``<<: *base``) and anchors work; a key given twice in one mapping is refused
(the merged keys a mapping overrides are not duplicates); a structure that contains itself
(``&a [*a]``) is refused; every error names the file or override and the line.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.constructor import ConstructorError, SafeConstructor


class _Constructor(SafeConstructor):
  """ruamel.yaml's safe (YAML 1.2 core schema) constructor that refuses a key given twice in one
  mapping, naming both lines, and reads timestamps (not in YAML 1.2's core schema) as strings."""

  def construct_mapping(self, node, deep=False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
      if key_node.tag == "tag:yaml.org,2002:merge":
        continue
      key = self.construct_object(key_node, deep=True)
      try:
        hash(key)
      except TypeError:
        continue  # the base constructor names an unhashable key
      line = key_node.start_mark.line + 1
      if key in seen:
        raise ConstructorError(
          None, None, f"duplicate key {key!r} (first given on line {seen[key]})", key_node.start_mark
        )
      seen[key] = line
    return super().construct_mapping(node, deep=deep)

  def construct_yaml_timestamp(self, node, values=None):
    return self.construct_scalar(node)


_Constructor.add_constructor("tag:yaml.org,2002:timestamp", _Constructor.construct_yaml_timestamp)


def _reader() -> YAML:
  """A YAML 1.2 safe reader (a new one per call: ruamel.yaml's objects keep state)."""
  yaml = YAML(typ="safe", pure=True)
  yaml.Constructor = _Constructor
  yaml.allow_duplicate_keys = True  # refused by _Constructor, naming the first line
  return yaml


def dump_flow(value: Any) -> str:
  """``value`` as one line of YAML 1.2 flow style that ``load_yaml`` reads back as ``value``
  (strings that would read as another type are quoted: ``'1e4'``, ``'010'``, ``'null'``)."""
  yaml = YAML(typ="safe", pure=True)
  yaml.default_flow_style = True
  yaml.width = 10_000
  out = io.StringIO()
  yaml.dump(value, out)
  return out.getvalue().removesuffix("\n...\n").strip()


def _check_acyclic(value: Any, source: str, seen: tuple[int, ...] = ()) -> None:
  if isinstance(value, dict | list | tuple | set):
    if id(value) in seen:
      raise ValueError(
        f"{source}: an alias refers to a collection that contains it (&a [*a]); a config is a tree"
      )
    for item in value.values() if isinstance(value, dict) else value:
      _check_acyclic(item, source, (*seen, id(value)))


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
  """Parses YAML 1.2 ``text`` (one document); errors name ``source`` (a file or an override) and the line.

  Raises:
    ValueError: invalid YAML, a duplicate key, a tag's value it cannot hold (``!!int abc``), an
      unknown tag, more than one document, or a collection that contains itself.
  """
  try:
    value = _reader().load(text)
  except YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e)
    raise ValueError(f"{source}{where}: {problem}") from None
  except (ValueError, TypeError, OverflowError) as e:  # a tag's constructor on text it cannot read
    raise ValueError(f"{source}: {type(e).__name__}: {e}") from None
  _check_acyclic(value, source)
  return value


def parse_value(raw: str, key: str = "") -> Any:
  """YAML 1.2 value syntax (``load_yaml``); quoted values (``'1e3'``) are strings. The value's type
  is then checked by the schema (strict: ``workdir=1e3`` or ``sample_prompt=true`` are refused, not
  turned into strings; ``workdir=nan`` is the string ``nan``, as YAML 1.2 reads it).

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
  if _drops_a_comment(raw):
    raise ValueError(
      f"{where}: YAML reads the text after ' #' as a comment and drops it; quote the value "
      f"({key or 'key'}='...') to keep it"
    )
  return value


def _drops_a_comment(raw: str) -> bool:
  """Whether YAML reads part of ``raw`` as a comment (a `` #`` or a leading ``#`` outside quotes)."""
  yaml = YAML(typ="rt", pure=True)  # the round-trip reader keeps comments: a comment token = dropped text
  try:
    for token in yaml.scan(raw):
      if type(token).__name__ == "CommentToken" or getattr(token, "comment", None):
        return True
  except YAMLError:  # pragma: no cover (parsed by load_yaml first)
    return False
  return False


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


__all__ = ["dump_flow", "load_yaml", "load_yaml_file", "parse_value", "read_text"]
