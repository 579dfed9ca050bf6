"""YAML numbers with an exponent (``3e-4``) are floats in config files, overrides and flow collections.

PyYAML reads YAML 1.1, where ``3e-4``, ``1e4`` and ``1.0e5`` (no dot, or no exponent sign) are strings,
which the strict schema refused as "Input should be a valid number"; the expected values are Python's
own ``float`` of the same text.
"""

import pytest

from jaxpe.train.config import load_config
from jaxpe.train.yaml_text import load_yaml


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
