"""Configuration validation: keys a pos_encoding does not use, length limits, training-only
restrictions, and override parsing."""

import pydantic
import pytest

from jaxpe.model.config import ModelConfig
from jaxpe.train.config import load_config, parse_overrides


@pytest.mark.parametrize("pe", ["none", "learned", "sinusoidal", "alibi", "rope_alibi"])
def test_rotary_dim_without_rotary_encoding_is_an_error(pe):
  with pytest.raises(pydantic.ValidationError, match="rotary_dim"):
    ModelConfig(pos_encoding=pe, rotary_dim=4)


@pytest.mark.parametrize("pe", ["rope", "xpos"])
def test_rotary_dim_is_accepted_for_rotary_encodings(pe):
  assert ModelConfig(pos_encoding=pe, rotary_dim=4).rotary_dim == 4


@pytest.mark.parametrize(
  "scaling",
  [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 256},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 512},
    {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16},
    {
      "rope_type": "longrope",
      "short_factor": [1.0] * 16,
      "long_factor": [2.0] * 16,
      "original_max_position_embeddings": 256,
    },
  ],
)
def test_length_dependent_scaling_needs_original_length_below_max_len(scaling):
  with pytest.raises(pydantic.ValidationError, match="rope_scaling.original_max_position_embeddings"):
    ModelConfig(pos_encoding="rope", max_len=256, rope_scaling=scaling)
  ok = {**scaling, "original_max_position_embeddings": 128}
  assert (
    ModelConfig(pos_encoding="rope", max_len=256, rope_scaling=ok).rope_scaling.rope_type
    == scaling["rope_type"]
  )


def test_rope_scaling_accepts_hf_v5_dicts_and_legacy_names():
  """ModelConfig takes the dicts transformers v5 writes (rope_theta and partial_rotary_factor
  inside), the legacy "su" and factors below 1 for linear; frequencies equal rope_frequencies on the
  same dict (the reference for the formulas is rope_scaling_test / hf_rope_test)."""
  import numpy as np

  from jaxpe.ops.rope_scaling import rope_frequencies

  llama3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
    "rope_theta": 500000.0,
  }
  partial = {"rope_type": "default", "partial_rotary_factor": 0.5, "rope_theta": 1e6}
  su = {
    "type": "su",
    "short_factor": [1.0] * 16,
    "long_factor": [2.0] * 16,
    "original_max_position_embeddings": 128,
  }
  for scaling, kind in (
    (llama3, "llama3"),
    (partial, "default"),
    (su, "longrope"),
    ({"type": "linear", "factor": 0.5}, "linear"),
  ):
    cfg = ModelConfig(pos_encoding="rope", max_len=256, rope_scaling=scaling)
    assert cfg.rope_scaling.rope_type == kind
    inv, att = cfg.rope_frequencies()
    ref_inv, ref_att = rope_frequencies(
      scaling, head_dim=32, max_position_embeddings=256, seq_len=256, dtype=np.float64
    )
    np.testing.assert_array_equal(inv, ref_inv)
    assert att == ref_att
  assert ModelConfig(pos_encoding="rope", rope_scaling=partial).rope_frequencies()[0].shape == (8,)
  with pytest.raises(pydantic.ValidationError, match="rope_theta .* differ"):
    ModelConfig(
      pos_encoding="rope", rope_theta=1e4, rope_scaling=llama3 | {"original_max_position_embeddings": 64}
    )
  with pytest.raises(pydantic.ValidationError, match="disagrees"):
    ModelConfig(pos_encoding="rope", rotary_dim=8, rope_scaling=partial)
  with pytest.raises(pydantic.ValidationError, match="factor.*dynamic"):
    ModelConfig(pos_encoding="rope", rope_scaling={"rope_type": "dynamic", "factor": 0.5})


def test_rope_theta_inside_rope_scaling_is_the_config_base_and_round_trips():
  """A v5 dict's rope_theta is the base the model uses: ModelConfig.rope_theta reports it, and a
  dumped config (the trainer's config.json) validates again instead of finding two bases."""
  from jaxpe.train.config import TrainConfig

  v5 = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
  cfg = ModelConfig(pos_encoding="rope", rope_scaling=v5)
  assert cfg.rope_theta == 500000.0
  assert ModelConfig.model_validate(cfg.model_dump()) == cfg
  train = TrainConfig(model=cfg)
  assert TrainConfig.model_validate_json(train.model_dump_json()) == train
  with pytest.raises(pydantic.ValidationError, match="rope_theta .* differ"):
    ModelConfig(pos_encoding="rope", rope_theta=1e4, rope_scaling=v5)


def test_xpos_max_len_limit():
  assert ModelConfig(pos_encoding="xpos", max_len=65536).max_len == 65536
  with pytest.raises(pydantic.ValidationError, match="max_len"):
    ModelConfig(pos_encoding="xpos", max_len=65537)
  assert ModelConfig(pos_encoding="rope", max_len=65537).max_len == 65537  # only xpos is limited


def test_rope_alibi_seq_len_must_fit_the_emulation_context():
  base = ["model.pos_encoding=rope_alibi", "model.max_len=64"]
  assert load_config(None, [*base, "seq_len=64"]).seq_len == 64
  with pytest.raises(pydantic.ValidationError, match="rope_alibi_context"):
    load_config(None, [*base, "seq_len=65"])
  with pytest.raises(pydantic.ValidationError, match="rope_alibi_context"):
    load_config(None, [*base, "seq_len=64", "model.rope_alibi_context=32"])
  assert load_config(None, ["model.pos_encoding=rope", "model.max_len=64", "seq_len=128"]).seq_len == 128


def test_training_refuses_rope_alibi_in_projection():
  inproj = ["model.pos_encoding=rope_alibi", "model.use_bias=true", "seq_len=64", "model.max_len=64"]
  assert ModelConfig(pos_encoding="rope_alibi", use_bias=True, rope_alibi_in_projection=True)
  load_config(None, inproj)  # the same run without the in-projection form is fine
  with pytest.raises(pydantic.ValidationError, match="rope_alibi_in_projection"):
    load_config(None, [*inproj, "model.rope_alibi_in_projection=true"])


def test_empty_sample_prompt_needs_sample_len_zero():
  with pytest.raises(ValueError, match=r"override sample_prompt='' has no value; write sample_prompt=null"):
    load_config(None, ["sample_prompt="])  # an empty override is refused, not read as null
  with pytest.raises(pydantic.ValidationError, match="sample_prompt"):
    load_config(None, ["sample_prompt=''"])
  assert load_config(None, ["sample_prompt=''", "sample_len=0"]).sample_prompt == ""


def test_quoted_overrides_stay_strings():
  assert load_config(None, ["sample_prompt='1e3'"]).sample_prompt == "1e3"
  assert load_config(None, ['sample_prompt="42"']).sample_prompt == "42"
  assert parse_overrides(["a='1e-2'", "b=1e-2", "c=3", "d='3'", "e=abc"]) == {
    "a": "1e-2",
    "b": 0.01,
    "c": 3,
    "d": "3",
    "e": "abc",
  }
  assert load_config(None, ["learning_rate=1e-2"]).learning_rate == 0.01


def test_learned_positions_need_room_for_the_sample():
  base = ["model.pos_encoding=learned", "model.max_len=8", "seq_len=8"]
  assert load_config(None, [*base, "sample_prompt=abcdefg"]).sample_prompt == "abcdefg"
  with pytest.raises(pydantic.ValidationError, match="sample_prompt"):
    load_config(None, [*base, "sample_prompt=abcdefgh"])
  assert load_config(None, [*base, "sample_prompt=abcdefgh", "sample_len=0"]).sample_len == 0


def test_rope_alibi_needs_room_for_the_sample_within_its_context():
  base = ["model.pos_encoding=rope_alibi", "model.max_len=64", "model.rope_alibi_context=8", "seq_len=8"]
  assert load_config(None, [*base, "sample_prompt=abcdefg"]).sample_prompt == "abcdefg"
  with pytest.raises(
    pydantic.ValidationError, match=r"sample_prompt \(8 bytes\) must be shorter than model.rope_alibi_context"
  ):
    load_config(None, [*base, "sample_prompt=abcdefgh"])


@pytest.mark.parametrize(
  "override",
  [
    "learning_rate=.inf",
    "learning_rate=.nan",
    "max_seconds=.inf",
    "grad_clip=-.inf",
    "model.rope_theta=.inf",
  ],
)
def test_rates_and_other_floats_must_be_finite(override):
  with pytest.raises(
    pydantic.ValidationError, match=rf"{override.split('=')[0].split('.')[-1]}\n.*finite number"
  ):
    load_config(None, [override])


@pytest.mark.parametrize("vocab", [1, 100, 255])
def test_byte_data_needs_vocab_of_at_least_256(vocab):
  with pytest.raises(pydantic.ValidationError, match=rf"model.vocab_size \({vocab}\) must be >= 256.*bytes"):
    load_config(None, [f"model.vocab_size={vocab}"])
  assert load_config(None, ["model.vocab_size=300"]).model.vocab_size == 300


def test_yaml_files_with_duplicate_keys_or_bad_syntax_are_named(tmp_path):
  dup = tmp_path / "dup.yaml"
  dup.write_text("num_steps: 3\nmodel:\n  d_model: 64\n  d_model: 32\n")
  with pytest.raises(
    ValueError,
    match=rf"config file '{dup}' line 4 column 3: duplicate key 'd_model' \(first given on line 3\)",
  ):
    load_config(dup)
  bad = tmp_path / "bad.yaml"
  bad.write_text("num_steps: 3\nseq_len: 32\n  x: 2\n")
  with pytest.raises(
    ValueError, match=rf"config file '{bad}' line 3 column 4: mapping values are not allowed here"
  ):
    load_config(bad)
  with pytest.raises(ValueError, match=r"override mesh_shape='\[1' line 1 column 3: "):
    parse_overrides(["mesh_shape=[1"])
  binary = tmp_path / "binary.yaml"  # was "'utf-8' codec can't decode byte 0xff in position 13" (no file)
  binary.write_bytes(b"num_steps: 3\n\xff\xfe\x00model: x\n")
  with pytest.raises(ValueError, match=rf"config file '{binary}' line 2: not UTF-8 text \(byte 0xff\)"):
    load_config(binary)
  ok = tmp_path / "ok.yaml"
  ok.write_text("num_steps: 3\nmodel:\n  d_model: 64\ndata:\n  max_bytes: 64\n")  # same key in two sections
  assert load_config(ok).model.d_model == 64


def test_old_attention_impl_key_is_read_as_attn_implementation_with_a_warning(tmp_path):
  """attention_impl (the key before attn_implementation) still works in keyword arguments, YAML
  files, overrides and the saved config of an older run, with a FutureWarning (shown by default)."""
  import json

  from jaxpe.train.config import TrainConfig
  from jaxpe.train.run_checks import check_resume_config

  with pytest.warns(FutureWarning, match="attention_impl is renamed attn_implementation"):
    assert ModelConfig(attention_impl="cudnn").attn_implementation == "cudnn"
  old = tmp_path / "old.yaml"
  old.write_text("model:\n  attention_impl: auto\n")
  with pytest.warns(FutureWarning, match="attn_implementation"):
    assert load_config(old).model.attn_implementation == "auto"
  with pytest.warns(FutureWarning, match="attn_implementation"):
    assert load_config(None, ["model.attention_impl=splash"]).model.attn_implementation == "splash"
  new = tmp_path / "new.yaml"
  new.write_text("model:\n  attn_implementation: xla\n")  # as the built-in default.yaml does
  with pytest.warns(FutureWarning, match="attn_implementation"):  # the user's old key still wins
    assert load_config(new, ["model.attention_impl=auto"]).model.attn_implementation == "auto"
  saved = TrainConfig().model_dump(mode="json")
  saved["model"] = {
    ("attention_impl" if k == "attn_implementation" else k): v for k, v in saved["model"].items()
  }
  with pytest.warns(FutureWarning, match="attn_implementation"):
    restored = TrainConfig.model_validate_json(json.dumps(saved))
  assert restored == TrainConfig()
  with pytest.warns(FutureWarning, match="attn_implementation"):
    check_resume_config(json.dumps(saved), TrainConfig())  # an older run resumes
  with pytest.raises(pydantic.ValidationError, match="give attn_implementation only"):
    ModelConfig(attention_impl="xla", attn_implementation="xla")
  with pytest.raises(pydantic.ValidationError, match="attn_implementation"):
    ModelConfig(attn_implementation="triton")
