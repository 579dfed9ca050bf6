"""jaxpe.ops.rope_scaling against HF transformers' RoPE initialisation (the reference) and closed forms.

The dict's spelling, keys and values: rope_parameters_test.py."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.ops import rope
from jaxpe.ops.rope_scaling import rope_frequencies

MAX_POS = 16384
HEAD_DIMS = (32, 64, 96, 128, 256)
BASES = (10000.0, 500000.0, 1e6)
PARTIAL = (1.0, 0.5, 0.25)


def _hf():
  """transformers' ``LlamaConfig``, ``ROPE_INIT_FUNCTIONS`` and ``LlamaRotaryEmbedding``, imported at
  the first call (not when the file is collected: transformers and torch take seconds)."""
  import transformers
  from transformers import LlamaConfig
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

  transformers.logging.set_verbosity_error()
  return LlamaConfig, ROPE_INIT_FUNCTIONS, LlamaRotaryEmbedding


def hf_reference(params, head_dim, max_pos=MAX_POS, seq_len=None):
  """HF's (inv_freq, attention_factor) for the same dict, via a LlamaConfig."""
  LlamaConfig, ROPE_INIT_FUNCTIONS, LlamaRotaryEmbedding = _hf()
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


def default_f64(rotary_dim, base):
  return base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


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

  LlamaConfig, _, LlamaRotaryEmbedding = _hf()

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
  jq = rope.apply_rope(
    jnp.asarray(q), jnp.asarray(pos, jnp.int32), inv_freq=inv, layout="half", attention_factor=att
  )
  jk = rope.apply_rope(
    jnp.asarray(k), jnp.asarray(pos, jnp.int32), inv_freq=inv, layout="half", attention_factor=att
  )
  # Both compute float32 phases p * inv_freq (p < 3000); inv_freq differ by < 1e-6 relative.
  np.testing.assert_allclose(jq, hq.numpy(), atol=2e-3, rtol=0)
  np.testing.assert_allclose(jk, hk.numpy(), atol=2e-3, rtol=0)
  # And the case is not vacuous: scaled frequencies differ from the default ones.
  if params["rope_type"] != "default":
    default_q = rope.apply_rope(jnp.asarray(q), jnp.asarray(pos, jnp.int32), layout="half")
    assert float(jnp.abs(default_q - hq.numpy()).max()) > 0.1
