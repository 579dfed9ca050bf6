"""Hostile inputs against the RoPE scaling and HF config contracts (docs/contracts.md, section
"Ops"): rope_frequencies, normalize_rope_parameters, ntk_aware_base, p_rope_inv_freq,
rope_from_hf_config.

One row per (entry point, argument, bad value): the expected exception and a regex of its message,
which must name the argument. Values are wrong in type, dtype, shape, rank, sign, NaN/inf, zero,
huge, empty, or of the right type but out of range. Issue 17.
"""

import jax.numpy as jnp
import pytest

from jaxpe import (
  normalize_rope_parameters,
  ntk_aware_base,
  p_rope_inv_freq,
  rope_frequencies,
  rope_from_hf_config,
)

F32 = jnp.float32
I32 = jnp.int32
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}
HUGE = 2**40
NAN = float("nan")

# (id, call, exception, regex of the message)
CASES = [
  # ---------------------------------------------------------------- rope_scaling
  (
    "norm-not-mapping",
    lambda: normalize_rope_parameters([("rope_type", "linear")]),
    TypeError,
    "rope_scaling must",
  ),
  (
    "norm-unknown-key",
    lambda: normalize_rope_parameters({"factr": 2.0}),
    ValueError,
    r"unknown keys \['factr'\]",
  ),
  (
    "norm-type-differ",
    lambda: normalize_rope_parameters({"type": "linear", "rope_type": "yarn"}),
    ValueError,
    "differ",
  ),
  (
    "norm-type-bogus",
    lambda: normalize_rope_parameters({"rope_type": "bogus"}),
    ValueError,
    "rope_type'] must be",
  ),
  ("norm-type-int", lambda: normalize_rope_parameters({"rope_type": 3}), ValueError, "rope_type'] must be"),
  (
    "norm-type-list",
    lambda: normalize_rope_parameters({"rope_type": ["yarn"]}),
    ValueError,
    "rope_type'] must be",
  ),
  ("norm-key-int", lambda: normalize_rope_parameters({1: 2}), ValueError, "unknown keys"),
  ("freq-H-0", lambda: rope_frequencies(None, head_dim=0), ValueError, "head_dim must be a positive integer"),
  (
    "freq-H-str",
    lambda: rope_frequencies(None, head_dim="64"),
    TypeError,
    "head_dim must be a positive integer",
  ),
  ("freq-H-huge", lambda: rope_frequencies(None, head_dim=HUGE), ValueError, "head_dim must be <="),
  (
    "freq-theta-0",
    lambda: rope_frequencies(None, head_dim=8, rope_theta=0),
    ValueError,
    "rope_theta must be",
  ),
  (
    "freq-theta-nan",
    lambda: rope_frequencies({"rope_theta": NAN}, head_dim=8),
    ValueError,
    "rope_theta'] must be",
  ),
  (
    "freq-R-odd",
    lambda: rope_frequencies(None, head_dim=8, rotary_dim=5),
    ValueError,
    "rotary_dim must be even",
  ),
  (
    "freq-R-big",
    lambda: rope_frequencies(None, head_dim=8, rotary_dim=10),
    ValueError,
    "rotary_dim must be <=",
  ),
  (
    "freq-mpe-0",
    lambda: rope_frequencies(None, head_dim=8, max_position_embeddings=0),
    ValueError,
    "max_position",
  ),
  (
    "freq-mpe-float",
    lambda: rope_frequencies(None, head_dim=8, max_position_embeddings=1.5),
    TypeError,
    "max_pos",
  ),
  ("freq-seq-neg", lambda: rope_frequencies(None, head_dim=8, seq_len=-1), ValueError, "seq_len must be"),
  ("freq-seq-float", lambda: rope_frequencies(None, head_dim=8, seq_len=1.5), TypeError, "seq_len must be"),
  (
    "freq-seq-arr",
    lambda: rope_frequencies(None, head_dim=8, seq_len=jnp.ones(2, I32)),
    ValueError,
    "seq_len must",
  ),
  (
    "freq-seq-farr",
    lambda: rope_frequencies(None, head_dim=8, seq_len=jnp.float32(3)),
    TypeError,
    "seq_len must",
  ),
  (
    "freq-yarn-nofactor",
    lambda: rope_frequencies({"rope_type": "yarn"}, head_dim=8, max_position_embeddings=64),
    ValueError,
    r"rope_type='yarn' is missing required keys \['factor'\]",
  ),
  ("ntk-factor-lt1", lambda: ntk_aware_base(1e4, factor=0.5, rotary_dim=8), ValueError, "factor must be"),
  ("ntk-factor-nan", lambda: ntk_aware_base(1e4, factor=NAN, rotary_dim=8), ValueError, "factor must be"),
  ("ntk-factor-str", lambda: ntk_aware_base(1e4, factor="2", rotary_dim=8), TypeError, "factor must be"),
  ("ntk-R-2", lambda: ntk_aware_base(1e4, factor=2.0, rotary_dim=2), ValueError, "rotary_dim must be > 2"),
  ("ntk-base-neg", lambda: ntk_aware_base(-1.0, factor=2.0, rotary_dim=8), ValueError, "base must be"),
  # ---------------------------------------------------------------- hf_rope
  # ---------------------------------------------------------------- p_rope_inv_freq
  ("prope-head-odd", lambda: p_rope_inv_freq(7, proportion=0.5), ValueError, "head_dim must be even"),
  ("prope-head-0", lambda: p_rope_inv_freq(0, proportion=0.5), ValueError, "head_dim must be"),
  ("prope-head-bool", lambda: p_rope_inv_freq(True, proportion=0.5), TypeError, "head_dim must be"),
  ("prope-p-0", lambda: p_rope_inv_freq(8, proportion=0), ValueError, r"proportion must be in \(0, 1\]"),
  ("prope-p-big", lambda: p_rope_inv_freq(8, proportion=1.5), ValueError, "proportion must be"),
  ("prope-p-nan", lambda: p_rope_inv_freq(8, proportion=NAN), ValueError, "proportion must be"),
  ("prope-p-bool", lambda: p_rope_inv_freq(8, proportion=True), TypeError, "proportion must be"),
  (
    "prope-theta-0",
    lambda: p_rope_inv_freq(8, proportion=0.5, rope_theta=0),
    ValueError,
    "rope_theta must be",
  ),
  ("prope-factor-0", lambda: p_rope_inv_freq(8, proportion=0.5, factor=0), ValueError, "^factor must be"),
  ("prope-factor-nan", lambda: p_rope_inv_freq(8, proportion=0.5, factor=NAN), ValueError, "^factor must be"),
  ("prope-factor-str", lambda: p_rope_inv_freq(8, proportion=0.5, factor="2"), TypeError, "^factor must be"),
  ("hf-config-list", lambda: rope_from_hf_config([1, 2]), TypeError, "config must be"),
  ("hf-config-none", lambda: rope_from_hf_config(None), TypeError, "config must be"),
  (
    "hf-heads-0",
    lambda: rope_from_hf_config({**LLAMA, "num_attention_heads": 0}),
    ValueError,
    "num_attention_heads",
  ),
  ("hf-hidden-str", lambda: rope_from_hf_config({**LLAMA, "hidden_size": "64"}), ValueError, "hidden_size"),
  (
    "hf-yarn-nofactor",
    lambda: rope_from_hf_config({**LLAMA, "rope_scaling": {"rope_type": "yarn"}}),
    ValueError,
    r"missing required keys \['factor'\]",
  ),
  ("hf-layer-type", lambda: rope_from_hf_config(LLAMA, layer_type="sliding"), ValueError, "layer_type"),
  ("hf-freq-seq-neg", lambda: rope_from_hf_config(LLAMA).frequencies(-1), ValueError, "seq_len must be"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
