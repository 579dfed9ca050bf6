"""Every key of ``TrainConfig`` from its pydantic schema: the dotted name, the default, the
accepted choices and the one-line description; ``jaxpe-train --print-config`` and ``--help`` show
them, and tests/train/config_keys_test.py checks the YAML configs' comments against them.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from jaxpe.train import yaml_text
from jaxpe.train.config import TrainConfig

__all__ = ["Key", "config_keys", "format_config", "help_listing"]


@dataclass(frozen=True)
class Key:
  """One config key: ``name`` dotted (``model.d_model``), ``default`` (JSON-like: tuples as lists),
  ``choices`` (the values a ``Literal`` accepts, else ``()``) and ``description`` (one line; ``""``
  where the schema has none)."""

  name: str
  default: Any
  choices: tuple[Any, ...]
  description: str


def _choices(annotation: Any) -> tuple[Any, ...]:
  """The ``Literal`` values within ``annotation`` (through unions, ``Annotated`` and ``Optional``)."""
  if typing.get_origin(annotation) is Literal:
    return typing.get_args(annotation)
  return tuple(dict.fromkeys(c for arg in typing.get_args(annotation) for c in _choices(arg)))


def _is_section(annotation: Any) -> bool:
  return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _plain(value: Any) -> Any:
  return json.loads(json.dumps(value, default=lambda v: v.model_dump(mode="json"), allow_nan=False))


def config_keys(schema: type[pydantic.BaseModel] = TrainConfig, prefix: str = "") -> list[Key]:
  """Every leaf key of ``schema`` (default ``TrainConfig``), in the schema's order, sections
  (``model``, ``data``, ``logical_rules``, ``distributed``) flattened to dotted names."""
  keys = []
  for name, field in schema.model_fields.items():
    if _is_section(field.annotation):
      keys += config_keys(field.annotation, f"{prefix}{name}.")
      continue
    description = " ".join((field.description or "").split())
    keys.append(Key(prefix + name, _plain(field.default), _choices(field.annotation), description))
  return keys


def _yaml_value(value: Any) -> str:
  """``value`` in YAML 1.2 flow style as ``--config`` and ``key=value`` read it back
  (``yaml_text.dump_flow``: strings that would read as numbers are quoted)."""
  return yaml_text.dump_flow(value)


def format_config(cfg: TrainConfig) -> str:
  """``cfg`` as YAML that ``--config`` reads back: every key with its value, then a comment with
  its default (when the value differs), its choices and its description."""
  values = cfg.model_dump(mode="json")
  lines, section = [], ()
  for key in config_keys():
    *path, leaf = key.name.split(".")
    for depth in range(len(path)):
      if tuple(path[: depth + 1]) != section[: depth + 1]:
        lines.append(f"{'  ' * depth}{path[depth]}:")
    section = tuple(path)
    value = values
    for part in key.name.split("."):
      value = value.get(part, key.default)  # init_from: null is left out of dumps
    notes = [] if value == key.default else [f"default {_yaml_value(key.default)}"]
    if key.choices:
      notes.append(" | ".join(map(str, key.choices)))
    notes += [key.description] if key.description else []
    text = f"{'  ' * len(path)}{leaf}: {_yaml_value(value)}"
    lines.append(f"{text:<40} # {'; '.join(notes)}" if notes else text)
  return "\n".join(lines)


def help_listing() -> str:
  """``--help``'s list of keys: ``name (default): description``, one line each."""
  lines = ["config keys (key=value; --print-config shows a config's values):"]
  for key in config_keys():
    choices = f" [{' | '.join(map(str, key.choices))}]" if key.choices else ""
    lines.append(f"  {key.name} ({_yaml_value(key.default)}){choices}: {key.description}")
  return "\n".join(lines)
