"""YAML numbers with an exponent (``3e-4``) are floats in config files, overrides and flow collections.

PyYAML reads YAML 1.1, where ``3e-4``, ``1e4`` and ``1.0e5`` (no dot, or no exponent sign) are strings,
which the strict schema refused as "Input should be a valid number"; the expected values are Python's
own ``float`` of the same text.
"""

import re

import pytest

from jaxpe.train import config_keys
from jaxpe.train.config import load_config
from jaxpe.train.yaml_text import load_yaml, load_yaml_file, parse_value


@pytest.mark.parametrize("text", ["3e-4", "1e4", "1.0e5", "-2E+3", ".5e-1", "1_0e2", "+7e0"])
def test_exponent_numbers_are_floats(text):
  assert load_yaml(f"x: {text}", "test") == {"x": float(text.replace("_", ""))}
  assert load_yaml(f"x: [{text}]", "test") == {"x": [float(text.replace("_", ""))]}


@pytest.mark.parametrize("text", ["'3e-4'", '"1e4"', "e5", "1e", "1e4x", "0x1e4", "12", "v1e4"])
def test_other_scalars_keep_their_yaml_types(text):
  import yaml

  assert load_yaml(f"x: {text}", "test") == yaml.safe_load(f"x: {text}")


def test_config_file_and_nested_overrides(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("learning_rate: 3e-4\nmodel:\n  d_model: 32\n  num_heads: 2\n  rope_theta: 1e4\n")
  cfg = load_config(path, ["model.rope_scaling={rope_type: linear, factor: 2e0}", "weight_decay=1e-2"])
  assert (cfg.learning_rate, cfg.model.rope_theta, cfg.weight_decay) == (3e-4, 1e4, 1e-2)
  assert cfg.model.rope_scaling.factor == 2.0


# Issue 48 kinds 1-3: jaxpe promises YAML 1.2 and read YAML 1.1 (PyYAML). The expected values are the
# YAML 1.2 core schema's (spec section 10.3.2), written out here.
YAML_12 = {
  "010": 10,  # YAML 1.1: octal 8 (num_steps=010 trained 8 steps)
  "0o10": 8,
  "0x1F": 31,
  "+12": 12,
  "1e4": 10000.0,
  ".inf": float("inf"),
  "true": True,
  "yes": "yes",  # YAML 1.1: True
  "on": "on",
  "off": "off",
  "nan": "nan",  # was the float NaN (Python's float() of the string)
  "inf": "inf",
  "Infinity": "Infinity",
  "2024-01-01": "2024-01-01",  # YAML 1.1: a date (no timestamps in YAML 1.2)
  "1:20": "1:20",  # YAML 1.1: sexagesimal 80
  "null": None,
}


@pytest.mark.parametrize("text, value", YAML_12.items())
def test_scalars_read_as_yaml_1_2(text, value, tmp_path):
  assert load_yaml(f"x: {text}", "test") == {"x": value}
  assert parse_value(text, "x") == value
  path = tmp_path / "c.yaml"
  path.write_text(f"x: {text}\n")
  assert load_yaml_file(path) == {"x": value}


def test_octal_looking_steps_and_string_keys_in_configs(tmp_path):
  assert load_config(None, ["num_steps=010"]).num_steps == 10  # main: 8
  for word in ("nan", "inf", "2024-01-01", "yes"):  # main: nan refused as a float
    assert load_config(None, [f"workdir={word}"]).workdir == word
  path = tmp_path / "c.yaml"
  path.write_text("num_steps: 010\nworkdir: nan\n")
  cfg = load_config(path)
  assert (cfg.num_steps, cfg.workdir) == (10, "nan")


def test_merge_keys_and_anchors(tmp_path):
  # Kind 2: a merge key was refused by the loader's own constructor (the duplicate-key check).
  path = tmp_path / "c.yaml"
  path.write_text(
    "base: &b {d_model: 32, num_heads: 2, num_layers: 1}\n"
    "model:\n  <<: *b\n  num_layers: 3\n"  # a merged key the mapping overrides: not a duplicate
  )
  assert load_yaml_file(path)["model"] == {"d_model": 32, "num_heads": 2, "num_layers": 3}
  path.write_text("model: &m {d_model: 32, num_heads: 2}\nnum_steps: 5\n")
  assert load_config(path).model.d_model == 32
  with pytest.raises(ValueError, match=r"line 2 column 3: duplicate key 'd_model' \(first given on line 1\)"):
    load_yaml("model: {d_model: 1, num_heads: 2,\n  d_model: 3}", "test")


@pytest.mark.parametrize(
  "text, message",
  [
    ("x: !!int abc", "test: ValueError: invalid literal for int"),
    ("x: !!float x", "test: ValueError: could not convert string to float"),
    ("x: &a [*a]", "test: an alias refers to a collection that contains it"),
    ("x: !custom 1", "test line 1 column 4: could not determine a constructor for the tag '!custom'"),
    ("x: *nothing", "test line 1 column 4: found undefined alias 'nothing'"),
    ("a: 1\n---\nb: 2", "test line 2 column 1: but found another document"),
  ],
)
def test_loader_errors_are_value_errors_naming_the_source(text, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    load_yaml(text, "test")


@pytest.mark.parametrize("prompt", ["1e4", "010", "nan", "yes", "2024-01-01", "null", "1:20", "0o7", "true"])
def test_a_printed_config_reads_back(prompt, tmp_path):
  # Kind 3: --print-config wrote strings YAML 1.2 reads as other types (PyYAML quoted only YAML 1.1's).
  cfg = load_config(None, [f"sample_prompt='{prompt}'", f"workdir='{prompt}'"])
  path = tmp_path / "printed.yaml"
  path.write_text(config_keys.format_config(cfg))
  assert load_config(path) == cfg
