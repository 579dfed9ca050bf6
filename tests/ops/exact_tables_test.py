"""Exact phases on every frequency table: ``rope_frequencies(..., dtype=np.float64)`` for every HF
rope type and ``p_rope_inv_freq(..., dtype=np.float64)`` against numpy float64 transcriptions of
their formulas, rotated at far positions (131000-131071, and near 2^31) through the exact phases;
the model uses those tables; CoPE's positions are the float64 sums rounded once."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.ops import cope
from jaxpe.ops.rope_scaling import p_rope_inv_freq, rope_frequencies

H = 128
FAR = np.r_[np.arange(131000, 131072), np.arange(2**31 - 8, 2**31)]
BASE = 500000.0
ORIG = 8192


def _pos_freqs(rotary_dim, base=BASE):
  return base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _yarn(factor, beta_fast=32.0, beta_slow=1.0):
  """transformers' ``_compute_yarn_parameters`` (truncate=True) in float64."""

  def correction_dim(rotations):
    return (H * math.log(ORIG / (rotations * 2 * math.pi))) / (2 * math.log(BASE))

  low = max(math.floor(correction_dim(beta_fast)), 0)
  high = min(math.ceil(correction_dim(beta_slow)), H - 1)
  ramp = np.clip((np.arange(H // 2) - low) / (high - low), 0, 1)
  keep = 1 - ramp
  return 1 / (factor * _pos_freqs(H)) * (1 - keep) + 1 / _pos_freqs(H) * keep


def _llama3(factor=8.0, low=1.0, high=4.0):
  """Meta's ``apply_scaling`` (llama-models) in float64."""
  inv = 1 / _pos_freqs(H)
  wavelen = 2 * math.pi / inv
  out = np.where(wavelen > ORIG / low, inv / factor, inv)
  smooth = (ORIG / wavelen - low) / (high - low)
  medium = (wavelen >= ORIG / high) & (wavelen <= ORIG / low)
  return np.where(medium, (1 - smooth) * out / factor + smooth * out, out)


SHORT = np.linspace(1.0, 1.5, H // 2)
LONG = np.linspace(1.0, 6.0, H // 2)
CASES = {
  "default": ({"rope_type": "default"}, lambda: 1 / _pos_freqs(H)),
  "linear": ({"rope_type": "linear", "factor": 4.0}, lambda: 1 / _pos_freqs(H) / 4.0),
  "ntk": ({"rope_type": "ntk", "factor": 4.0}, lambda: 1 / _pos_freqs(H, BASE * 4.0 ** (H / (H - 2)))),
  "dynamic": (
    {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": ORIG},
    lambda: 1 / _pos_freqs(H, BASE * (4.0 * 4 * ORIG / ORIG - 3.0) ** (H / (H - 2))),
  ),
  "yarn": (
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": ORIG},
    lambda: _yarn(16.0),
  ),
  "longrope": (
    {
      "rope_type": "longrope",
      "short_factor": SHORT.tolist(),
      "long_factor": LONG.tolist(),
      "factor": 4.0,
      "original_max_position_embeddings": ORIG,
    },
    lambda: 1 / (LONG * _pos_freqs(H)),
  ),  # fmt: skip
  "llama3": (
    {
      "rope_type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": ORIG,
    },
    lambda: _llama3(),
  ),  # fmt: skip
  "proportional": (
    {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    lambda: np.r_[1 / BASE ** (np.arange(0, 32, 2) / H), np.zeros(H // 2 - 16)],
  ),
}


def _phase_error(inv_freq, ref):
  cos, sin = jaxpe.rope_cos_sin(jnp.asarray(FAR, jnp.int32)[None], inv_freq)
  angle = FAR[:, None].astype(np.float64) * ref[None]  # float64 phases: exact to ~1e-16 rad relative
  return max(
    np.abs(np.asarray(cos[0], np.float64) - np.cos(angle)).max(),
    np.abs(np.asarray(sin[0], np.float64) - np.sin(angle)).max(),
  )


@pytest.mark.parametrize("rope_type", sorted(CASES))
def test_float64_tables_give_exact_phases_at_far_positions(rope_type):
  params, formula = CASES[rope_type]
  ref = formula()
  table, factor = rope_frequencies(
    params, head_dim=H, rope_theta=BASE, max_position_embeddings=4 * ORIG, seq_len=4 * ORIG, dtype=np.float64
  )
  assert isinstance(table, np.ndarray) and table.dtype == np.float64
  np.testing.assert_allclose(table, ref, rtol=1e-13, atol=0)
  f32, factor32 = rope_frequencies(
    params, head_dim=H, rope_theta=BASE, max_position_embeddings=4 * ORIG, seq_len=4 * ORIG
  )
  np.testing.assert_array_equal(np.asarray(f32), table.astype(np.float32))  # the same table, rounded once
  assert factor == factor32
  assert _phase_error(table, ref) < 1e-6


@pytest.mark.parametrize("factor", [1.0, 8.0])
def test_p_rope_float64_at_h128_near_131072(factor):
  table = p_rope_inv_freq(H, proportion=0.75, factor=factor, dtype=np.float64)
  rotating = int(0.75 * H // 2)
  ref = np.r_[10000.0 ** (-np.arange(0, 2 * rotating, 2) / H), np.zeros(H // 2 - rotating)] / factor
  np.testing.assert_allclose(table, ref, rtol=1e-14, atol=0)
  assert _phase_error(table, ref) < 1e-6
  # the float32 table, rounded from the same numbers, is a different table at these positions
  assert _phase_error(p_rope_inv_freq(H, proportion=0.75, factor=factor), ref) > 1e-3


def test_the_model_rotates_at_the_float64_tables():
  pytest.importorskip("flax")
  from jaxpe.model.config import ModelConfig

  for cfg in (
    ModelConfig(pos_encoding="rope", rope_proportion=0.75),
    ModelConfig(pos_encoding="rope", rope_scaling={"rope_type": "linear", "factor": 2.0}),
  ):
    table, _ = cfg.rope_frequencies()
    assert isinstance(table, np.ndarray) and table.dtype == np.float64


def test_cope_positions_are_the_float64_sums_rounded_once():
  t_len = 4096
  logits = jax.random.normal(jax.random.key(0), (2, 1, t_len))
  got = np.asarray(cope.cope_positions(logits, npos_max=t_len + 1), np.float64)
  gates = np.asarray(jax.nn.sigmoid(logits), np.float64)
  ref = np.cumsum(gates[..., ::-1], -1)[..., ::-1]
  err = np.abs(got - ref)
  assert err.max() <= 1.2e-4  # a float32 cumsum: 3.8e-4
  assert np.all(err <= np.spacing(ref.astype(np.float32)).astype(np.float64))  # within an ulp everywhere
  # the derivative is the suffix sum of the gates' derivative
  tangent = jax.random.normal(jax.random.key(1), logits.shape)
  _, d = jax.jvp(lambda z: cope.cope_positions(z, npos_max=t_len + 1), (logits,), (tangent,))
  d_gates = np.asarray(tangent, np.float64) * gates * (1 - gates)
  np.testing.assert_allclose(d, np.cumsum(d_gates[..., ::-1], -1)[..., ::-1], atol=2e-3, rtol=1e-4)
