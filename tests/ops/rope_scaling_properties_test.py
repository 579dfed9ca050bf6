"""jaxpe.ops.rope_scaling's closed forms and properties, without transformers: every type reduces to
the default at factor 1, dynamic NTK is stateless and traceable, static NTK equals dynamic at its
length, YaRN's attention factor. Parity with transformers: rope_scaling_test.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.ops import rope
from jaxpe.ops.rope_scaling import ntk_aware_base, rope_frequencies


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


def test_yarn_attention_factor_closed_form():
  _, att = rope_frequencies(
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}, head_dim=16
  )
  assert att == pytest.approx(0.1 * math.log(16.0) + 1.0, rel=1e-15)
