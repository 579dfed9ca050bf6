"""jaxpe.rope_scaling against HF transformers' RoPE initialisation (the reference) and closed forms."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.ops import rope, rope_scaling
from jaxpe.ops.rope_scaling import ntk_aware_base, rope_frequencies

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

MAX_POS = 16384
HEAD_DIMS = (32, 64, 96, 128, 256)
BASES = (10000.0, 500000.0, 1e6)
PARTIAL = (1.0, 0.5, 0.25)


def hf_reference(params, head_dim, max_pos=MAX_POS, seq_len=None):
  """HF's (inv_freq, attention_factor) for the same dict, via a LlamaConfig."""
  config = LlamaConfig(
    hidden_size=2 * head_dim,
    num_attention_heads=2,
    head_dim=head_dim,
    max_position_embeddings=max_pos,
    rope_parameters=dict(params),
  )
  rope_type = config.rope_parameters["rope_type"]
  if rope_type == "default":
    if config.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
      # Llama's default init ignores partial_rotary_factor; HF's linear init at factor 1 honours it.
      config.rope_parameters["factor"] = 1.0
      inv, att = ROPE_INIT_FUNCTIONS["linear"](config, None)
    else:
      inv, att = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
  else:
    inv, att = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
  return inv.double().numpy(), float(att)


def cases(rotary_dim, rng):
  """(dict, seq_len) pairs per rope type, covering every key."""
  long_f = lambda hi: [float(v) for v in rng.uniform(1.0, hi, rotary_dim // 2)]  # noqa: E731
  return {
    "default": [({"rope_type": "default"}, None)],
    "linear": [({"rope_type": "linear", "factor": 4.0}, None), ({"type": "linear", "factor": 2.5}, None)],
    "dynamic": [
      ({"rope_type": "dynamic", "factor": 2.0}, 10000),
      ({"rope_type": "dynamic", "factor": 8.0}, 70000),
      ({"type": "dynamic", "factor": 4.0}, None),
    ],
    "yarn": [
      ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}, None),
      (
        {
          "rope_type": "yarn",
          "factor": 40.0,
          "original_max_position_embeddings": 4096,
          "mscale": 1.0,
          "mscale_all_dim": 0.707,
          "beta_fast": 16,
          "beta_slow": 2,
        },
        None,
      ),
      (
        {
          "rope_type": "yarn",
          "factor": 4.0,
          "original_max_position_embeddings": 2048,
          "truncate": False,
          "attention_factor": 0.9,
        },
        None,
      ),
      ({"rope_type": "yarn", "factor": 8.0}, None),  # original defaults to max_position_embeddings
    ],
    "longrope": [
      (
        {
          "rope_type": "longrope",
          "short_factor": long_f(3.0),
          "long_factor": long_f(40.0),
          "original_max_position_embeddings": 4096,
        },
        9000,
      ),
      (
        {
          "rope_type": "longrope",
          "short_factor": long_f(3.0),
          "long_factor": long_f(40.0),
          "original_max_position_embeddings": 4096,
          "factor": 8.0,
        },
        100,
      ),
      (
        {
          "rope_type": "longrope",
          "short_factor": long_f(3.0),
          "long_factor": long_f(40.0),
          "original_max_position_embeddings": 2048,
          "attention_factor": 1.3,
        },
        None,
      ),
    ],
    "llama3": [
      (
        {
          "rope_type": "llama3",
          "factor": 8.0,
          "low_freq_factor": 1.0,
          "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192,
        },
        None,
      ),
      (
        {
          "rope_type": "llama3",
          "factor": 4.0,
          "low_freq_factor": 1.0,
          "high_freq_factor": 2.0,
          "original_max_position_embeddings": 2048,
        },
        None,
      ),
    ],
    # Large factors: HF's float32 smoothing amplifies rounding, see test_llama3_large_factor_...
    "llama3_large": [
      (
        {
          "rope_type": "llama3",
          "factor": 32.0,
          "low_freq_factor": 1.0,
          "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192,
        },
        None,
      ),
      (
        {
          "rope_type": "llama3",
          "factor": 32.0,
          "low_freq_factor": 2.0,
          "high_freq_factor": 8.0,
          "original_max_position_embeddings": 2048,
        },
        None,
      ),
    ],
  }


def rel_dev(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b) / np.abs(b)))


@pytest.mark.parametrize("rope_type", ["default", "linear", "dynamic", "yarn", "longrope", "llama3"])
def test_parity_with_hf(rope_type):
  rng = np.random.default_rng(0)
  worst_inv = worst_att = 0.0
  n = 0
  for head_dim, base, prf in itertools.product(HEAD_DIMS, BASES, PARTIAL):
    rotary_dim = int(head_dim * prf)
    for params, seq_len in cases(rotary_dim, rng)[rope_type]:
      params = dict(params, rope_theta=base, partial_rotary_factor=prf)
      ref_inv, ref_att = hf_reference(params, head_dim, seq_len=seq_len)
      inv, att = rope_frequencies(params, head_dim=head_dim, max_position_embeddings=MAX_POS, seq_len=seq_len)
      assert inv.dtype == jnp.float32 and inv.shape == (rotary_dim // 2,)
      worst_inv = max(worst_inv, rel_dev(inv, ref_inv))
      worst_att = max(worst_att, abs(att - ref_att) / ref_att)
      n += 1
  print(f"{rope_type}: {n} configs, max rel dev inv_freq {worst_inv:.2e}, attention_factor {worst_att:.2e}")
  assert worst_inv <= 1e-6
  assert worst_att <= 1e-6


def llama3_condition(inv, factor, low, high, orig):
  """Relative condition number of Llama-3 smoothing w.r.t. inv_freq (1 outside the medium band).

  In the band, out = inv ((1 - s) / f + s) with s = (orig inv / 2 pi - low) / (high - low), so
  d log(out) / d log(inv) = 1 + (s + low / (high - low)) (1 - 1/f) / ((1 - s) / f + s).
  """
  s = (orig * inv / (2 * np.pi) - low) / (high - low)
  band = (s >= 0) & (s <= 1)
  kappa = 1 + (s + low / (high - low)) * (1 - 1 / factor) / ((1 - s) / factor + s)
  return np.where(band, kappa, 1.0)


def test_llama3_large_factor_parity_within_float32_conditioning():
  """At factor 32 HF's float32 inv_freq (a few ulp off) is amplified up to ~11x by the smoothing.

  jaxpe evaluates in float64, so the deviation is HF's float32 rounding (inv_freq, then the
  wavelength, the division and the subtraction in s: each about 1 ulp, 6e-8) times the condition
  number: bound it by 10 ulp (6e-7) times kappa per frequency, never tighter than 1e-6.
  """
  worst = worst_scaled = 0.0
  rng = np.random.default_rng(0)
  for head_dim, base, prf in itertools.product(HEAD_DIMS, BASES, PARTIAL):
    rotary_dim = int(head_dim * prf)
    for params, _ in cases(rotary_dim, rng)["llama3_large"]:
      params = dict(params, rope_theta=base, partial_rotary_factor=prf)
      ref_inv, _ = hf_reference(params, head_dim)
      inv, att = rope_frequencies(params, head_dim=head_dim)
      dev = np.abs(np.asarray(inv, np.float64) - ref_inv) / ref_inv
      kappa = llama3_condition(
        base ** -(np.arange(0, rotary_dim, 2) / rotary_dim),
        params["factor"],
        params["low_freq_factor"],
        params["high_freq_factor"],
        params["original_max_position_embeddings"],
      )
      assert np.all(dev <= np.maximum(6e-7 * kappa, 1e-6)), (head_dim, base, prf)
      assert att == 1.0
      worst = max(worst, dev.max())
      worst_scaled = max(worst_scaled, (dev / kappa).max())
  print(f"llama3 factor 32: max rel dev {worst:.2e}, max rel dev / kappa {worst_scaled:.2e}")


def test_llama3_equal_low_and_high_freq_factor_matches_hf():
  """Llama-4 Scout / Maverick ship llama3 scaling with low_freq_factor == high_freq_factor == 1 (no
  smoothing band: wavelengths above original / 1 are divided by factor, the others kept).
  transformers computes it (its band is empty); jaxpe must not refuse it."""
  params = {
    "rope_type": "llama3",
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
  }
  ref_inv, ref_att = hf_reference(params, 128, max_pos=10485760)
  inv, att = rope_frequencies(params, head_dim=128, max_position_embeddings=10485760)
  assert np.all(np.isfinite(ref_inv)) and rel_dev(inv, ref_inv) <= 1e-6 and att == ref_att == 1.0
  plain = 500000.0 ** -(np.arange(0, 128, 2) / 128)  # closed form: a step at wavelength 8192
  np.testing.assert_allclose(inv, np.where(2 * np.pi / plain > 8192, plain / 16, plain), rtol=3e-7)


def test_parity_rotary_dim_argument_equals_partial_factor():
  params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
  a, fa = rope_frequencies(dict(params, partial_rotary_factor=0.5), head_dim=64)
  b, fb = rope_frequencies(params, head_dim=64, rotary_dim=32)
  np.testing.assert_array_equal(a, b)
  assert fa == fb


# ------------------------------------------------------------------ closed forms and properties


def default_f64(rotary_dim, base):
  return base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


@pytest.mark.parametrize(
  "params",
  [
    {"rope_type": "linear", "factor": 1.0},
    {"rope_type": "dynamic", "factor": 1.0},
    {"rope_type": "ntk", "factor": 1.0},
    {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512},
    {
      "rope_type": "llama3",
      "factor": 1.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 512,
    },
    {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 16, "factor": 1.0},
  ],
)
def test_every_type_reduces_to_default_at_factor_one(params):
  # HF's dynamic NTK keeps growing the base past max_position_embeddings even at factor 1
  # (base * (s / L) ** (R / (R - 2))): it reduces to default only up to L.
  lengths = (None, 100, 512) if params["rope_type"] == "dynamic" else (None, 100, 100000)
  for seq_len in lengths:
    inv, att = rope_frequencies(
      params, head_dim=32, rope_theta=5e5, max_position_embeddings=512, seq_len=seq_len
    )
    np.testing.assert_allclose(inv, default_f64(32, 5e5), rtol=2e-7)
    assert att == 1.0


def test_default_is_rope_inv_freq_and_closed_form():
  inv, att = rope_frequencies(None, head_dim=48, rotary_dim=24, rope_theta=1234.5)
  np.testing.assert_allclose(inv, default_f64(24, 1234.5), rtol=2e-7)
  np.testing.assert_array_equal(inv, rope.rope_inv_freq(48, base=1234.5, rotary_dim=24))
  assert att == 1.0


def test_dynamic_is_stateless():
  params = {"rope_type": "dynamic", "factor": 4.0}
  kw = dict(head_dim=64, max_position_embeddings=2048)
  first, _ = rope_frequencies(params, **kw, seq_len=1000)
  long, _ = rope_frequencies(params, **kw, seq_len=50000)
  again, _ = rope_frequencies(params, **kw, seq_len=1000)
  np.testing.assert_array_equal(first, again)  # no cache of the longest length seen
  np.testing.assert_allclose(first, default_f64(64, 10000.0), rtol=2e-7)  # short: unscaled
  # Closed form: base * (f s / L - (f - 1)) ** (R / (R - 2)).
  new_base = 10000.0 * (4.0 * 50000 / 2048 - 3.0) ** (64 / 62)
  np.testing.assert_allclose(long, default_f64(64, new_base), rtol=5e-7)


def test_dynamic_and_longrope_under_jit_with_traced_seq_len():
  short = [1.0 + 0.1 * i for i in range(16)]
  long = [2.0 + i for i in range(16)]
  for params in (
    {"rope_type": "dynamic", "factor": 4.0},
    {
      "rope_type": "longrope",
      "short_factor": short,
      "long_factor": long,
      "original_max_position_embeddings": 2048,
    },
  ):
    traced = jax.jit(
      lambda s, p=params: rope_frequencies(p, head_dim=32, max_position_embeddings=2048, seq_len=s)[0]
    )
    for s in (100, 2048, 2049, 30000):
      np.testing.assert_allclose(
        traced(jnp.int32(s)),
        rope_frequencies(params, head_dim=32, max_position_embeddings=2048, seq_len=s)[0],
        rtol=3e-6,
      )


def test_static_ntk_equals_dynamic_at_its_length():
  f, length, r = 4.0, 1000, 64
  inv_ntk, _ = rope_frequencies({"rope_type": "ntk", "factor": f}, head_dim=r)
  # dynamic's base factor (f s / L - f + 1) equals f at s = L (2f - 1) / f.
  s = length * (2 * f - 1) / f
  assert s == int(s)
  inv_dyn, _ = rope_frequencies(
    {"rope_type": "dynamic", "factor": f}, head_dim=r, max_position_embeddings=length, seq_len=int(s)
  )
  np.testing.assert_allclose(inv_ntk, inv_dyn, rtol=2e-7)
  assert ntk_aware_base(10000.0, factor=f, rotary_dim=r) == pytest.approx(10000.0 * f ** (64 / 62), rel=1e-15)
  # The highest frequency is unchanged, the lowest is stretched by exactly f (the NTK-aware property).
  base_inv = default_f64(r, 10000.0)
  ntk_low = default_f64(r, ntk_aware_base(10000.0, factor=f, rotary_dim=r))[-1]
  assert inv_ntk[0] == 1.0
  np.testing.assert_allclose(base_inv[-1] / ntk_low, f ** ((r - 2) / r * r / (r - 2)), rtol=1e-12)


def test_factor_below_one_linear_and_yarn_match_hf():
  """Compression (factor < 1) where the formula allows it: linear is inv_freq / factor, YaRN's ramp
  with factor < 1 and attention factor 1; both against transformers' init functions."""
  inv, att = rope_frequencies({"rope_type": "linear", "factor": 0.5}, head_dim=64)
  np.testing.assert_allclose(inv, default_f64(64, 10000.0) * 2.0, rtol=2e-7)
  for params in (
    {"rope_type": "linear", "factor": 0.25},
    {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096},
    {
      "rope_type": "yarn",
      "factor": 0.5,
      "original_max_position_embeddings": 4096,
      "mscale": 1,
      "mscale_all_dim": 1,
    },
  ):
    inv, att = rope_frequencies(params, head_dim=64, max_position_embeddings=MAX_POS)
    ref_inv, ref_att = hf_reference(params, 64)
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-6)
    assert att == ref_att == 1.0


@pytest.mark.parametrize(
  "params",
  [
    {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0},
    {"rope_type": "proportional", "partial_rotary_factor": 0.3, "factor": 0.5},
    {"rope_type": "proportional"},
  ],
)
def test_proportional_matches_hf(params):
  """Gemma-4's proportional RoPE: H/2 frequencies, base ** (-2i/H) on the rotated share, zeros after."""
  for head_dim in (64, 256):
    inv, att = rope_frequencies(params, head_dim=head_dim)
    ref_inv, ref_att = hf_reference(params, head_dim)
    assert inv.shape == (head_dim // 2,) and att == ref_att == 1.0
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-6, atol=0)
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    assert np.all(np.asarray(inv)[angles:] == 0) and np.all(np.asarray(inv)[:angles] > 0)
  with pytest.raises(ValueError, match="rotary_dim must be None or head_dim"):
    rope_frequencies(params, head_dim=64, rotary_dim=32)


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
  assert rope_scaling.normalize_rope_parameters({"type": "su"}) == {"rope_type": "longrope"}
  assert rope_scaling.normalize_rope_parameters({"type": "yarn", "rope_type": "yarn"}) == {
    "rope_type": "yarn"
  }


def test_yarn_attention_factor_closed_form():
  _, att = rope_frequencies(
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}, head_dim=16
  )
  assert att == pytest.approx(0.1 * math.log(16.0) + 1.0, rel=1e-15)


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
  assert set(rope_scaling.ROPE_TYPES) >= {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}


# ------------------------------------------------------------------ end to end with HF's module


@pytest.mark.parametrize(
  "params",
  [
    {"rope_type": "default"},
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256},
    {
      "rope_type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 256,
    },
    {
      "rope_type": "longrope",
      "short_factor": [1.0 + 0.05 * i for i in range(32)],
      "long_factor": [1.0 + 0.5 * i for i in range(32)],
      "original_max_position_embeddings": 256,
    },
  ],
  ids=lambda p: p["rope_type"],
)
def test_rotated_q_k_match_hf_llama_rotary_embedding(params):
  """jaxpe apply_rope (rotate-half layout, attention factor) vs HF's LlamaRotaryEmbedding +
  apply_rotary_pos_emb on the same q, k; dynamic/longrope at seq_len = max(position) + 1 (what HF's
  dynamic_rope_update sees), from a fresh HF module."""
  import torch
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

  head_dim, max_pos = 64, 1024
  config = LlamaConfig(
    hidden_size=2 * head_dim,
    num_attention_heads=2,
    head_dim=head_dim,
    max_position_embeddings=max_pos,
    rope_parameters=dict(params, rope_theta=10000.0),
  )
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 9, 3, head_dim)).astype(np.float32)  # [B, T, N, H]
  k = rng.normal(size=(2, 9, 1, head_dim)).astype(np.float32)
  pos = np.sort(rng.integers(0, 3000, (2, 9)), axis=1).astype(np.int64)
  module = LlamaRotaryEmbedding(config)
  cos, sin = module(torch.from_numpy(q), torch.from_numpy(pos))
  hq, hk = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin, unsqueeze_dim=2)
  inv, att = rope_frequencies(
    params, head_dim=head_dim, max_position_embeddings=max_pos, seq_len=int(pos.max()) + 1
  )
  jq = rope.apply_rope(jnp.asarray(q), jnp.asarray(pos, jnp.int32), inv_freq=inv, layout="half", scale=att)
  jk = rope.apply_rope(jnp.asarray(k), jnp.asarray(pos, jnp.int32), inv_freq=inv, layout="half", scale=att)
  # Both compute float32 phases p * inv_freq (p < 3000); inv_freq differ by < 1e-6 relative.
  np.testing.assert_allclose(jq, hq.numpy(), atol=2e-3, rtol=0)
  np.testing.assert_allclose(jk, hk.numpy(), atol=2e-3, rtol=0)
  # And the case is not vacuous: scaled frequencies differ from the default ones.
  if params["rope_type"] != "default":
    default_q = rope.apply_rope(jnp.asarray(q), jnp.asarray(pos, jnp.int32), layout="half")
    assert float(jnp.abs(default_q - hq.numpy()).max()) > 0.1


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
  from transformers import modeling_rope_utils

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
