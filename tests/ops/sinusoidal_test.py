"""Sinusoidal embeddings (jaxpe.ops.sinusoidal) against each convention's source: tensor2tensor,
fairseq, Vaswani et al.; exact phases at large positions."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxpe.ops import sinusoidal


def _positions(seed, shape, high):
  return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)


def t2t_timing_signal(positions, channels, min_timescale=1.0, max_timescale=1.0e4):
  """tensor2tensor common_attention.get_timing_signal_1d, in float64 numpy (at given positions)."""
  num_timescales = channels // 2
  log_timescale_increment = math.log(max_timescale / min_timescale) / max(num_timescales - 1, 1)
  inv_timescales = min_timescale * np.exp(np.arange(num_timescales) * -log_timescale_increment)
  scaled_time = np.asarray(positions, np.float64)[..., None] * inv_timescales
  return np.concatenate([np.sin(scaled_time), np.cos(scaled_time)], axis=-1)


def fairseq_sinusoidal(positions, embedding_dim):
  """fairseq SinusoidalPositionalEmbedding.get_embedding (even dim), float64 numpy."""
  half_dim = embedding_dim // 2
  emb = math.log(10000) / (half_dim - 1)
  emb = np.exp(np.arange(half_dim) * -emb)
  emb = np.asarray(positions, np.float64)[..., None] * emb
  return np.concatenate([np.sin(emb), np.cos(emb)], axis=-1)


def vaswani_table(positions, d_model, concat=False):
  """Vaswani et al. 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
  ang = np.asarray(positions, np.float64)[..., None] / 10000 ** (2 * np.arange(d_model // 2) / d_model)
  if concat:
    return np.concatenate([np.sin(ang), np.cos(ang)], axis=-1)
  out = np.zeros((*ang.shape[:-1], d_model))
  out[..., 0::2], out[..., 1::2] = np.sin(ang), np.cos(ang)
  return out


class SinusoidalTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("vaswani", "tensor2tensor", "concat")
  def test_each_convention_matches_its_source(self, convention):
    rows = _positions(9, (2, 11), 2**31).at[0, 0].set(0).at[0, 1].set(17780)
    shared = jnp.broadcast_to(rows[0], (3, 11))  # every row equal: computed once and broadcast
    for pos in (rows, shared):
      out = self.variant(lambda p: sinusoidal.sinusoidal_embedding(p, d_model=32, convention=convention))(pos)
      if convention == "vaswani":
        refs = [vaswani_table(pos, 32)]
      elif convention == "concat":
        refs = [vaswani_table(pos, 32, concat=True)]
      else:
        refs = [t2t_timing_signal(pos, 32), fairseq_sinusoidal(pos, 32)]
      for ref in refs:  # float64 tables (their own phase rounding: <= 1.2e-7 at 2^31)
        np.testing.assert_allclose(out, ref, atol=3e-7, rtol=0)
      assert out.dtype == jnp.float32 and out.shape == (*pos.shape, 32)

  def test_tensor2tensor_frequencies_are_not_the_papers(self):
    np.testing.assert_allclose(
      sinusoidal.sinusoidal_frequencies(8, convention="tensor2tensor"),
      [1, 0.046416, 0.0021544, 1e-4],
      rtol=1e-4,
    )
    np.testing.assert_allclose(sinusoidal.sinusoidal_frequencies(8), [1, 0.1, 0.01, 0.001], rtol=1e-12)
    pos = jnp.arange(200, dtype=jnp.int32)[None, :]
    t2t = sinusoidal.sinusoidal_embedding(pos, d_model=8, convention="tensor2tensor")
    concat = sinusoidal.sinusoidal_embedding(pos, d_model=8, convention="concat")
    assert float(jnp.max(jnp.abs(t2t - concat))) > 1.5
    # D = 2: t2t's max(D/2 - 1, 1) guard gives the single frequency 1.
    np.testing.assert_allclose(
      sinusoidal.sinusoidal_embedding(pos, d_model=2, convention="tensor2tensor"),
      t2t_timing_signal(pos, 2),
      atol=3e-7,
    )

  def test_dtype_shapes_and_errors(self):
    pos = jnp.zeros((1, 3), jnp.int32)
    assert sinusoidal.sinusoidal_embedding(pos, d_model=8, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    assert sinusoidal.sinusoidal_embedding(jnp.arange(3), d_model=8).shape == (3, 8)  # [T]
    with pytest.raises(ValueError, match="d_model must be even"):
      sinusoidal.sinusoidal_embedding(pos, d_model=7)
    with pytest.raises(TypeError, match="positions must be an integer or float"):
      sinusoidal.sinusoidal_embedding(pos.astype(bool), d_model=8)
    with pytest.raises(ValueError, match="convention"):
      sinusoidal.sinusoidal_embedding(pos, d_model=8, convention="split")
    with pytest.raises(ValueError, match=r"positions must be < 2\^31"):
      sinusoidal.sinusoidal_embedding(np.asarray([[2**31]], np.int64), d_model=8)
    with pytest.raises(ValueError, match="float32 cannot hold"):
      sinusoidal.sinusoidal_embedding(np.asarray([[2.0**25 + 1]]), d_model=8)


def test_sinusoidal_phases_are_exact_at_large_positions():
  # Sinusoids at large positions against the paper's formula in float64.
  spos = jnp.asarray([[2**31 - 1, 2**30 + 12345, 17780]], jnp.int32)
  emb = jax.jit(lambda p: sinusoidal.sinusoidal_embedding(p, d_model=64))(spos)
  ang = np.asarray(spos, np.float64)[..., None] / 10000 ** (np.arange(32) * 2 / 64)
  np.testing.assert_allclose(emb[..., 0::2], np.sin(ang), atol=3e-7)
  np.testing.assert_allclose(emb[..., 1::2], np.cos(ang), atol=3e-7)
