"""The config keys from the command line (issue 37, item 6): ``--print-config`` (every key, its
value, default and description, from the schema), the key listing in ``--help``, the YAML configs'
comments checked against the schema, and validation errors that name only the offending key."""

from __future__ import annotations

import re

import pydantic
import pytest

from jaxpe.model.config import MESH_AXES
from jaxpe.model.encodings import REGISTRY
from jaxpe.train import cli, config, config_keys
from jaxpe.train.yaml_text import load_yaml

TRAINING_CONFIGS = sorted(p for p in cli.CONFIGS.glob("*.yaml") if not p.stem.startswith("study"))
KEYS = {k.name: k for k in config_keys.config_keys()}


def _schema_leaves(schema: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
  """The leaf keys of ``schema``, walked independently of ``config_keys``."""
  out = set()
  for name, field in schema.model_fields.items():
    ann = field.annotation
    if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
      out |= _schema_leaves(ann, f"{prefix}{name}.")
    else:
      out.add(prefix + name)
  return out


def test_every_key_is_listed_with_a_description():
  assert set(KEYS) == _schema_leaves(config.TrainConfig)
  assert not [k for k in KEYS.values() if not k.description]
  assert KEYS["model.d_model"].default == config.TrainConfig().model.d_model
  assert KEYS["model.remat"].choices == ("none", "full", "dots_saveable")


def test_print_config_reads_back_as_the_same_config(capsys, tmp_path):
  """--print-config's YAML, read by --config, is the config it printed (values, not defaults);
  each line carries the key's description, and a changed value its default (main: no such option)."""
  assert cli.main(["--config", "tiny", "--print-config", "model.pos_encoding=alibi", "seed=3"]) == 0
  out = capsys.readouterr().out
  (tmp_path / "printed.yaml").write_text(out)
  printed = config.load_config(tmp_path / "printed.yaml")
  assert printed == config.load_config(cli.resolve_config("tiny"), ["model.pos_encoding=alibi", "seed=3"])
  assert re.search(r"^  pos_encoding: alibi +# default rope; ", out, re.M), out
  assert re.search(r"^seed: 3 +# default 0; initialisation, batch and sampling seed$", out, re.M), out
  assert re.search(r"^  remat: none +# none \| full \| dots_saveable; ", out, re.M), out
  assert len([line for line in out.splitlines() if "#" in line]) == len(KEYS)


def test_help_lists_every_key(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert "--print-config" in out
  for name in KEYS:
    assert f"\n  {name} (" in out, name
  assert "\n  model.d_model (128): " in out


def _comments(path) -> list[tuple[str, object, str]]:
  """(dotted key, value, comment) for each ``key: value  # comment`` line of a YAML config."""
  out, stack = [], []
  for line in path.read_text().splitlines():
    m = re.match(r"^( *)([A-Za-z_]\w*):(.*?)(?:\s+#\s*(.*))?$", line)
    if not m:
      continue
    depth = len(m[1]) // 2
    stack = stack[:depth] + [m[2]]
    if m[3].strip():
      out.append((".".join(stack), load_yaml(m[3], path.name), m[4] or ""))
  return out


def _listed(comment: str) -> set[str] | None:
  """The words of an ``a | b (note) | c`` list in a comment, or None."""
  m = re.search(r"\w+(?: \([^)]*\))?(?: \| \w+(?: \([^)]*\))?)+", comment)
  return None if m is None else {re.sub(r" \(.*", "", w) for w in m[0].split(" | ")}


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.name)
def test_config_comments_match_the_schema(path):
  """Every key exists; a comment's ``a | b | c`` list is exactly the key's accepted values (main:
  default.yaml's and tiny.yaml's pos_encoding lists lacked cope, attn_implementation's lacked flash);
  a mesh_shape comment names the mesh's axes and the value has all four (main: 3 of 4)."""
  lines = _comments(path)
  assert lines
  bad = []
  for key, value, comment in lines:
    if key in ("logical_rules", "distributed") and value == {}:
      continue  # a section left at its defaults
    if key not in KEYS:
      bad.append(f"{key}: not a config key")
      continue
    choices = set(REGISTRY) if key == "model.pos_encoding" else set(map(str, KEYS[key].choices))
    listed = _listed(comment)
    if listed is not None and listed != choices:
      bad.append(f"{key}: the comment lists {sorted(listed)}, the schema accepts {sorted(choices)}")
    if key == "mesh_shape":
      axes = re.search(r"\(([a-z, ]+)\)", comment)
      if len(value) != len(MESH_AXES) or axes is None or tuple(axes[1].split(", ")) != MESH_AXES:
        bad.append(f"mesh_shape: {value} with comment {comment!r}; the axes are {MESH_AXES}")
  assert not bad, f"{path.name}:\n" + "\n".join(bad)


def test_default_yaml_names_every_key():
  """default.yaml is the annotated full config: every key of the schema but the sections it gives as
  {} (logical_rules, distributed; see --print-config)."""
  named = {key for key, _, _ in _comments(cli.CONFIGS / "default.yaml")}
  missing = {k for k in KEYS if k not in named and not k.startswith(("logical_rules.", "distributed."))}
  assert not missing, sorted(missing)


@pytest.mark.parametrize(
  "override, words",
  [
    ("model.num_heads=3", "model: d_model (128) must be divisible by num_heads (3)"),
    ("model.head_dim=3", "model: head_dim must be even"),
    ("model.vocab_size=100", "config: model.vocab_size (100) must be >= 256"),
  ],
)
def test_a_validation_error_names_the_key_not_the_whole_model(capsys, override, words):
  """A section's validator gets the whole section: main printed it (``(got {'vocab_size': 256,
  'd_model': ...})``, every key of the model)."""
  assert cli.main([override, "--print-config"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"train.py: error: {words}"), err
  assert "'vocab_size': 256" not in err and "Value error" not in err and "\n" not in err, err
