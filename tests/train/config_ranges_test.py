"""Config values the ops cannot use are refused when the config is read, naming the dotted key and
the accepted range (issue 39, kind 5): every float key of every config section is a usable float32
(at most ~3.4e38 in magnitude; a key declared > 0 at least ~1.2e-38, not a subnormal XLA flushes to
0), and the int keys that reach an op's bound take that bound, read from the op's own constant
(``jaxpe.ops.checks``, ``jaxpe.emulation``), which the op itself is checked to enforce here."""

import os
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pydantic
import pytest

from jaxpe import ops
from jaxpe.emulation import MAX_POSITION as EMULATION_MAX_POSITION
from jaxpe.model.config import LogicalRules, ModelConfig, RopeScalingConfig
from jaxpe.ops import checks
from jaxpe.train import cli
from jaxpe.train.config import DataConfig, DistributedConfig, TrainConfig, load_config

SECTIONS = (TrainConfig, ModelConfig, RopeScalingConfig, DataConfig, DistributedConfig, LogicalRules)


def _takes_float(annotation) -> bool:
  if annotation is float:
    return True
  return any(_takes_float(a) for a in typing.get_args(annotation))


def _float_keys():
  for cls in SECTIONS:
    for name, field in cls.model_fields.items():
      if _takes_float(field.annotation):
        yield pytest.param(cls, name, id=f"{cls.__name__}.{name}")


FLOAT_KEYS = list(_float_keys())


def _errors(cls, values):
  """``{loc: message}`` of validating ``values`` (other required keys may fail too; only the asked
  key's entry is read)."""
  try:
    cls.model_validate(values)
  except pydantic.ValidationError as e:
    return {".".join(map(str, err["loc"])): err["msg"] for err in e.errors()}
  return {}


def test_the_float_keys_are_enumerated_from_the_schemas():
  names = {p.id for p in FLOAT_KEYS}
  assert len(names) >= 25, names
  for key in ("ModelConfig.fire_init_L", "ModelConfig.layernorm_eps", "TrainConfig.learning_rate"):
    assert key in names


@pytest.mark.parametrize("cls, name", FLOAT_KEYS)
def test_every_float_key_refuses_what_float32_makes_inf(cls, name):
  # main: 1e39 is finite in Python (pydantic's allow_inf_nan=False let it through) and inf in float32
  field = cls.model_fields[name]
  value = (1e39,) if "tuple" in str(field.annotation) else 1e39
  errors = _errors(cls, {name: value})
  key = name if name in errors else f"{name}.0"
  assert key in errors, errors
  bounded = any(hasattr(m, "le") or hasattr(m, "lt") for m in field.metadata)  # b1 < 1: its own range
  assert bounded or ("float32" in errors[key] and "3.402823e+38" in errors[key]), errors
  assert 1e39 > float(np.finfo(np.float32).max)  # the reason, independently: inf in float32


@pytest.mark.parametrize("cls, name", FLOAT_KEYS)
def test_every_positive_float_key_refuses_a_subnormal(cls, name):
  field = cls.model_fields[name]
  positive = any(getattr(m, "gt", -1) >= 0 or getattr(m, "ge", 0) > 0 for m in field.metadata)
  errors = _errors(cls, {name: 1e-39})
  if positive:
    assert name in errors and "smallest normal float32" in errors[name], errors
  else:
    assert name not in errors or "float32" not in errors[name], errors
  assert 0 < np.float32(1e-39) < np.finfo(np.float32).tiny  # subnormal, independently


INT_BOUNDS = [
  # (section, key, the op's largest accepted value, the op's own check of that bound or None)
  *[(ModelConfig, k, checks.MAX_DIM, None) for k in ("d_model", "num_kv_heads", "head_dim", "rotary_dim")],
  (ModelConfig, "num_heads", checks.MAX_DIM, lambda n: ops.alibi_slopes(n)),
  (ModelConfig, "alibi_heads", checks.MAX_DIM, None),
  (
    ModelConfig,
    "relative_attention_num_buckets",
    checks.MAX_DIM,
    lambda n: ops.t5_relative_position_bucket(np.zeros(1, np.int32), bidirectional=False, num_buckets=n),
  ),
  (ModelConfig, "max_len", checks.MAX_POSITION, None),
  (ModelConfig, "cope_npos_max", checks.MAX_POSITION, None),
  (ModelConfig, "relative_attention_max_distance", checks.MAX_POSITION, None),
  (ModelConfig, "rope_alibi_context", EMULATION_MAX_POSITION, None),
  (RopeScalingConfig, "original_max_position_embeddings", checks.MAX_POSITION, None),
  (TrainConfig, "seq_len", checks.MAX_POSITION - 1, None),
  (TrainConfig, "num_steps", 2**31 - 1, None),
  (TrainConfig, "warmup_steps", 2**31 - 1, None),
  (TrainConfig, "stop_at", 2**31 - 1, None),
]


@pytest.mark.parametrize(
  "cls, name, bound, op", INT_BOUNDS, ids=[f"{c.__name__}.{k}" for c, k, _, _ in INT_BOUNDS]
)
def test_int_keys_take_the_bound_of_the_op_they_reach(cls, name, bound, op):
  # main: relative_attention_num_buckets=2000000 was accepted and failed 21 s later in the op
  assert name not in _errors(cls, {name: bound})
  errors = _errors(cls, {name: bound + 1})
  assert name in errors and (
    f"equal to {bound}" in errors[name] or f"less than {bound + 1}" in errors[name]
  ), errors
  if op is not None:  # the op refuses what the key refuses, and takes the bound
    with pytest.raises(ValueError, match=f"<= {bound}"):
      op(bound + 1)


def test_fire_initial_scale_times_its_longest_distance_stays_finite_in_float32():
  ModelConfig(pos_encoding="fire", fire_init_c=1e30, max_len=256)
  with pytest.raises(
    pydantic.ValidationError, match=r"fire_init_c x max\(fire_init_L, max_len\) must be <= 3.402823e\+38"
  ):
    ModelConfig(pos_encoding="fire", fire_init_c=1e37, max_len=256)  # 2.56e39: log(c x + 1) = inf
  assert 1e37 * 256 > float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
  "override, key",
  [
    ("model.relative_attention_num_buckets=2000000", "model.relative_attention_num_buckets"),
    ("model.fire_init_L=1e39", "model.fire_init_L"),
    ("learning_rate=1e39", "learning_rate"),
    ("model.layernorm_eps=1e-40", "model.layernorm_eps"),
  ],
)
def test_the_command_line_refuses_at_once_in_one_line_naming_the_dotted_key(override, key, capsys, tmp_path):
  status = cli.main(["--config", "tiny", f"workdir={tmp_path / 'run'}", "model.pos_encoding=t5", override])
  err = capsys.readouterr().err.strip()
  assert status == 2 and len(err.splitlines()) == 1, err
  assert f"error: {key}: " in err, err
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    load_config(None, [override])


def _takes_int(annotation) -> bool:
  if annotation is int:
    return True
  return any(_takes_int(a) for a in typing.get_args(annotation))


INT_KEYS = [
  pytest.param(cls, name, id=f"{cls.__name__}.{name}")
  for cls in SECTIONS
  for name, field in cls.model_fields.items()
  if _takes_int(field.annotation)
]


@pytest.mark.parametrize("cls, name", INT_KEYS)
def test_every_int_key_refuses_what_a_64_bit_integer_cannot_hold(cls, name):
  # data.max_bytes=<400 digits> passed the config and died in load_corpus with a raw OverflowError
  # (a key with its own upper bound is refused by it; every other key by the 64-bit bound)
  listed = "tuple" in str(cls.model_fields[name].annotation)  # mesh_shape, no_rope_layers: one entry
  for value, said in ((10**400, "a 401-digit integer"), (2**63, str(2**63))):
    message = _errors(cls, {name: (1, value, 1) if listed else value}).get(name, "")
    assert "less than" in message or (f"2^63 - 1 = {2**63 - 1}" in message and said in message), message
  assert "2^63" not in _errors(cls, {name: 2**63 - 1}).get(name, "")


def test_the_int_keys_are_enumerated_from_the_schemas():
  names = {p.id for p in INT_KEYS}
  assert {"DataConfig.max_bytes", "TrainConfig.eval_every", "TrainConfig.batch_size"} <= names, names


def test_max_bytes_past_int64_is_one_line_naming_the_key(capsys, tmp_path):
  status = cli.main(["--config", "tiny", f"workdir={tmp_path / 'run'}", "data.max_bytes=1" + "0" * 400])
  err = capsys.readouterr().err.strip()
  assert status == 2 and len(err.splitlines()) == 1 and "error: data.max_bytes: " in err, err


def test_a_cpu_device_count_the_mesh_cannot_use_is_refused_before_xla_makes_the_devices(tmp_path):
  # main: cpu_devices=1000000 set jax_num_cpu_devices and the run hung while XLA made the devices
  train = Path(__file__).resolve().parents[2] / "train" / "train.py"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  done = subprocess.run(
    [sys.executable, str(train), "--config", "tiny", f"workdir={tmp_path / 'run'}", "cpu_devices=1000000"],
    env={**env, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=90,
  )
  assert done.returncode == 2, done.stderr[-2000:]
  line = done.stderr.strip().splitlines()[-1]
  assert line.startswith("train.py: error: cpu_devices=1000000 does not fit this run's mesh or batch"), line
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "name, value", [("JAXPE_CPU_FLASH", "disabled"), ("JAXPE_CPU_FLASH_BUILD_TIMEOUT", "abc")]
)
def test_a_bad_kernel_setting_is_refused_before_the_run_makes_anything(
  name, value, monkeypatch, capsys, tmp_path
):
  # it was refused at the first attention call: after the workdir, its lock and metrics were made
  monkeypatch.setenv(name, value)
  status = cli.main(["--config", "tiny", f"workdir={tmp_path / 'run'}", "num_steps=1", "sample_len=0"])
  err = capsys.readouterr().err.strip()
  assert status == 2 and len(err.splitlines()) == 1 and f"error: {name}" in err, err
  assert not (tmp_path / "run").exists()
