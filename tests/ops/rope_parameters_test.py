"""HF rope dicts (jaxpe.ops.rope_parameters): the legacy spellings, every refusal naming the key, and
refusing exactly where transformers' own validation raises or warns (each difference listed)."""

import numpy as np
import pytest

from jaxpe.ops import rope_parameters
from jaxpe.ops.rope_scaling import ntk_aware_base, rope_frequencies


def test_legacy_su_reads_as_longrope():
  params = {"short_factor": [1.0 + i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}
  kw = dict(head_dim=16, max_position_embeddings=4096)
  for seq_len in (None, 5000):
    su = rope_frequencies(
      {**params, "type": "su", "original_max_position_embeddings": 1024}, **kw, seq_len=seq_len
    )
    lr = rope_frequencies(
      {**params, "rope_type": "longrope", "original_max_position_embeddings": 1024}, **kw, seq_len=seq_len
    )
    np.testing.assert_array_equal(su[0], lr[0])
    assert su[1] == lr[1]
  assert rope_parameters.normalize_rope_parameters({"type": "su"}) == {"rope_type": "longrope"}
  assert rope_parameters.normalize_rope_parameters({"type": "yarn", "rope_type": "yarn"}) == {
    "rope_type": "yarn"
  }


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
  "params, kwargs, match",
  [
    ({"rope_type": "cubic"}, {}, "rope_type.*cubic"),
    ({"rope_type": "linear"}, {}, "missing required keys \\['factor'\\]"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, {}, "high_freq_factor"),
    ({"rope_type": "linear", "factor": 2.0, "facotr": 1}, {}, "unknown keys \\['facotr'\\]"),
    (
      {"rope_type": "dynamic", "factor": 0.5},
      {"max_position_embeddings": 64},
      "factor.*>= 1 for rope_type='dynamic'",
    ),
    ({"rope_type": "ntk", "factor": 0.5}, {}, "factor.*>= 1 for rope_type='ntk'"),
    (
      {"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
      {"max_position_embeddings": 64},
      "factor.*>= 1 for rope_type='llama3'.*linear",
    ),
    ({"rope_type": "linear", "factor": 0.0}, {}, "factor.*> 0"),
    ({"rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 64}, {}, "factor.*> 0"),
    ({"type": "su", "rope_type": "linear", "factor": 2.0}, {}, "differ"),
    ({"rope_type": "linear", "factor": "2"}, {}, "factor.*number"),
    # Strings and bools are not numbers, for the base and the factor lists too.
    ({"rope_type": "default", "rope_theta": "500000"}, {}, "rope_theta.*number"),
    ({"rope_type": "default", "rope_theta": True}, {}, "rope_theta.*number"),
    (
      {"rope_type": "longrope", "short_factor": ["1.0"] * 8, "long_factor": [1.0] * 8, "factor": 2.0},
      {"max_position_embeddings": 64},
      "short_factor.*numbers",
    ),
    ({"rope_type": "dynamic", "factor": 2.0}, {}, "max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 2.0}, {}, "original_max_position_embeddings"),
    (
      {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 1,
        "beta_slow": 4,
      },
      {},
      "beta_fast",
    ),
    (
      {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": "yes"},
      {},
      "truncate",
    ),
    (
      {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 4.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
      },
      {},
      "high_freq_factor",
    ),
    (
      {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8, "factor": 2.0},
      {"max_position_embeddings": 64},
      "short_factor.*8 entries",
    ),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, {}, "partial_rotary_factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, {"rotary_dim": 4}, "disagrees"),
    ({"rope_type": "default"}, {"rotary_dim": 7}, "rotary_dim must be even"),
    ({"rope_type": "default"}, {"rotary_dim": 32}, "rotary_dim must be <= head_dim"),
    ({"rope_type": "default", "rope_theta": -1.0}, {}, "rope_theta"),
    ({"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 64, "seq_len": -3}, "seq_len"),
    ({"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 64, "seq_len": 2.5}, "seq_len"),
    ({"type": "linear", "rope_type": "yarn", "factor": 2.0}, {}, "differ"),
  ],
)
def test_errors_name_the_argument(params, kwargs, match):
  with pytest.raises(ValueError, match=match):
    rope_frequencies(params, head_dim=16, **kwargs)


def test_errors_other():
  with pytest.raises(ValueError, match="rope_scaling must be a mapping"):
    rope_frequencies([("rope_type", "linear")], head_dim=16)
  with pytest.raises(ValueError, match="head_dim"):
    rope_frequencies(None, head_dim=0)
  with pytest.raises(ValueError, match="rotary_dim must be > 2"):
    ntk_aware_base(10000.0, factor=2.0, rotary_dim=2)
  with pytest.raises(ValueError, match="factor"):
    ntk_aware_base(10000.0, factor=0.5, rotary_dim=8)
  assert set(rope_parameters.ROPE_TYPES) >= {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}


# ---------------------------------------------------------------- refusals beside transformers' validation

_SHORT = [1.0] * 32  # head_dim 64: 32 pairs
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
_LONG = {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _SHORT, "factor": 4.0}
_LONG = {**_LONG, "original_max_position_embeddings": 1024}
_L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_L3 = {**_L3, "original_max_position_embeddings": 1024}


def _without(d, key):
  return {k: v for k, v in d.items() if k != key}


# (dict, deliberate difference): None where jaxpe refuses exactly when transformers 5.24 raises or warns;
# otherwise "accepts: why" (transformers warns, jaxpe accepts) or "refuses: why" (transformers is
# silent, jaxpe refuses). docs/contracts.md lists the same differences.
VALIDATION_TABLE = [
  ({"rope_type": "default"}, None),
  ({"rope_type": "linear", "factor": 2.0}, None),
  ({"rope_type": "dynamic", "factor": 2.0}, None),
  (_YARN, None),
  (_without(_YARN, "original_max_position_embeddings"), None),  # both default it to max_position_embeddings
  (_LONG, None),
  (_L3, None),
  ({"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4}, None),
  # Missing keys: transformers raises KeyError.
  ({"rope_type": "linear"}, None),
  ({"rope_type": "dynamic"}, None),
  ({"rope_type": "yarn"}, None),  # issue 17: was accepted with default frequencies
  (_without(_YARN, "factor"), None),
  ({**_YARN, "factor": None}, None),
  (_without(_LONG, "short_factor"), None),
  (_without(_LONG, "long_factor"), None),
  (_without(_L3, "factor"), None),
  (_without(_L3, "low_freq_factor"), None),
  (_without(_L3, "high_freq_factor"), None),
  # factor: wrong type, sign, zero, below 1.
  ({"rope_type": "linear", "factor": "2"}, None),
  ({"rope_type": "linear", "factor": 0}, None),
  ({"rope_type": "linear", "factor": -2.0}, None),
  (
    {"rope_type": "linear", "factor": 0.5},
    "accepts: linear compression (positions closer), a defined formula",
  ),
  ({"rope_type": "linear", "factor": True}, "refuses: a bool is not a number"),
  ({"rope_type": "linear", "factor": float("nan")}, "refuses: NaN factor"),
  ({"rope_type": "linear", "factor": float("inf")}, "refuses: infinite factor"),
  ({"rope_type": "dynamic", "factor": 0.5}, None),
  ({**_YARN, "factor": 0.5}, "accepts: yarn compression, as linear"),
  ({**_YARN, "factor": -1.0}, None),
  ({**_LONG, "factor": 0.5}, None),
  ({**_L3, "factor": 0.5}, None),
  # yarn's other keys.
  ({**_YARN, "beta_fast": 1.0, "beta_slow": 32.0}, None),
  ({**_YARN, "beta_fast": "32"}, None),
  ({**_YARN, "attention_factor": -1.0}, None),
  ({**_YARN, "attention_factor": 0.0}, "refuses: attention_factor 0 zeroes every score"),
  ({**_YARN, "attention_factor": 1}, "accepts: an int attention_factor is a number"),
  ({**_YARN, "mscale": float("nan")}, "refuses: NaN mscale"),
  ({**_YARN, "truncate": "yes"}, "refuses: truncate must be a bool"),
  ({**_YARN, "original_max_position_embeddings": 0}, None),
  (
    {**_YARN, "original_max_position_embeddings": 8192},
    "accepts: the explicit factor wins, as in transformers",
  ),
  # longrope's factor lists and lengths.
  ({**_LONG, "short_factor": _SHORT[:31]}, None),
  ({**_LONG, "long_factor": _SHORT + [1.0]}, None),
  ({**_LONG, "short_factor": "abc"}, None),
  ({**_LONG, "long_factor": [float("nan")] * 32}, "refuses: NaN entries"),
  ({**_LONG, "attention_factor": -1.0}, None),
  (_without(_LONG, "factor"), "accepts: Phi-3 configs, factor = max_position_embeddings / original"),
  ({**_without(_LONG, "factor"), "original_max_position_embeddings": 8192}, None),
  # llama3's band and lengths.
  ({**_L3, "high_freq_factor": 1.0}, "accepts: Llama-4's step (low == high), as transformers computes it"),
  ({**_L3, "high_freq_factor": 0.5}, None),
  ({**_L3, "low_freq_factor": "1"}, None),
  ({**_L3, "original_max_position_embeddings": 8192}, None),
  ({**_L3, "original_max_position_embeddings": 1024.5}, None),
  (_without(_L3, "original_max_position_embeddings"), "accepts: original defaults to max, no extension"),
  # proportional.
  ({"rope_type": "proportional", "rope_theta": 1e4}, "accepts: partial_rotary_factor defaults to 1"),
  ({"rope_type": "proportional", "partial_rotary_factor": 1.5}, "refuses: more pairs than the head"),
  # Keys of another type, unknown types, bad theta.
  ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32.0}, None),
  ({"rope_type": "default", "factor": 2.0}, None),
  (
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024},
    "accepts: jaxpe reads it",
  ),
  ({"rope_type": "bogus"}, None),
  ({"rope_type": "default", "rope_theta": -1.0}, "refuses: rope_theta must be > 0"),
  ({"rope_type": "default", "rope_theta": "1e4"}, "refuses: rope_theta must be a number"),
  (
    {"rope_type": "default", "partial_rotary_factor": 0.0},
    "refuses: partial_rotary_factor must be in (0, 1]",
  ),
]


def _transformers_flags(params, max_pos, monkeypatch):
  """Whether transformers 5.24's config validation raises or warns for ``params`` (LlamaConfig)."""
  import transformers  # here, not when the file is collected
  from transformers import LlamaConfig, modeling_rope_utils

  transformers.logging.set_verbosity_error()

  messages = []
  record = lambda msg, *a, **k: messages.append(str(msg))  # noqa: E731
  monkeypatch.setattr(modeling_rope_utils.logger, "warning", record)
  monkeypatch.setattr(modeling_rope_utils.logger, "warning_once", record)
  try:
    LlamaConfig(
      hidden_size=256,
      num_attention_heads=4,
      head_dim=64,
      max_position_embeddings=max_pos,
      rope_parameters=dict(params),
    )
  except Exception as e:  # KeyError for missing keys; TypeError / ZeroDivisionError on bad values
    return f"raises {type(e).__name__}: {e}"
  return f"warns: {messages}" if messages else None


@pytest.mark.parametrize("params,difference", VALIDATION_TABLE)
def test_refuses_exactly_when_transformers_validation_does(params, difference, monkeypatch):
  hf = _transformers_flags(params, 4096, monkeypatch)
  try:
    rope_frequencies(params, head_dim=64, max_position_embeddings=4096)
    ours = None
  except ValueError as e:
    ours = str(e)
    assert "rope_scaling" in ours or "rope_theta" in ours, ours  # names the dict's key
  if difference is None:
    assert (ours is None) == (hf is None), (hf, ours)
  elif difference.startswith("accepts"):
    assert hf is not None and ours is None, (hf, ours)
  else:
    assert difference.startswith("refuses") and hf is None and ours is not None, (hf, ours)
