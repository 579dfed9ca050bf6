"""RoPE (both layouts, partial rotary, attention factor), xPos and sinusoidal encodings against
independent float64 numpy references: Meta's complex formula, HF's rotate-half formula,
torchscale's xPos, Vaswani et al.'s sinusoids."""

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpe import rope, rope_scaling, sinusoidal, xpos

# ---------------------------------------------------------------- references (numpy float64)


def inv_freq_f64(rotary_dim, base=10000.0):
  return base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def meta_complex_rope(x, positions, inv_freq):
  """facebookresearch/llama model.py: precompute_freqs_cis + apply_rotary_emb, in float64 numpy.

  freqs_cis = polar(1, outer(t, freqs)); xq_ = view_as_complex(xq.reshape(..., -1, 2));
  out = view_as_real(xq_ * freqs_cis).flatten(3). Dims past 2 * len(inv_freq) pass through.
  """
  x = np.asarray(x, np.float64)
  r = 2 * len(inv_freq)
  freqs_cis = np.exp(1j * np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64))
  xc = x[..., :r].reshape(*x.shape[:-1], r // 2, 2)
  z = (xc[..., 0] + 1j * xc[..., 1]) * freqs_cis[:, :, None, :]
  out = np.stack([z.real, z.imag], axis=-1).reshape(*x.shape[:-1], r)
  return np.concatenate([out, x[..., r:]], axis=-1)


def hf_rotate_half_rope(x, positions, inv_freq, attention_scaling=1.0):
  """HF LlamaRotaryEmbedding + apply_rotary_pos_emb (+ partial rotary split), float64 numpy."""
  x = np.asarray(x, np.float64)
  r = 2 * len(inv_freq)
  freqs = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
  emb = np.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = np.cos(emb) * attention_scaling, np.sin(emb) * attention_scaling
  xr = x[..., :r]
  rotated = np.concatenate([-xr[..., r // 2 :], xr[..., : r // 2]], axis=-1)
  return np.concatenate([xr * cos + rotated * sin, x[..., r:]], axis=-1)


def pair_norms(x, r, layout):
  x = np.asarray(x, np.float64)
  a, b = (x[..., 0:r:2], x[..., 1:r:2]) if layout == "interleaved" else (x[..., : r // 2], x[..., r // 2 : r])
  n = np.sqrt(a**2 + b**2)
  if layout == "interleaved":
    return np.repeat(n, 2, axis=-1)
  return np.concatenate([n, n], axis=-1)


def phase_bound(positions, inv_freq32, r, layout):
  """Per-dim bound on the float32 phase error: half an ulp of p*theta plus cos/sin error."""
  phase = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq32, np.float64)
  err = 0.5 * np.spacing(phase.astype(np.float32)).astype(np.float64) * 1.01 + 3e-7
  err = err[:, :, None, :]
  if layout == "interleaved":
    return np.repeat(err, 2, axis=-1)
  return np.concatenate([err, err], axis=-1)


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _positions(seed, shape, high):
  return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)


# ---------------------------------------------------------------- RoPE parity


class RopeParityTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(
    layout=("interleaved", "half"), dtype=("float32", "bfloat16"), rotary_dim=(64, 32), base=(1e4, 5e5)
  )
  def test_matches_meta_and_rotate_half_up_to_131072(self, layout, dtype, rotary_dim, base):
    dtype = jnp.dtype(dtype)
    x = _rand(0, (2, 16, 3, 64), dtype)
    pos = _positions(1, (2, 16), 131073).at[0, 0].set(131072).at[0, 1].set(0)
    inv = rope.rope_inv_freq(64, base=base, rotary_dim=rotary_dim)
    out = self.variant(lambda x, p: rope.apply_rope(x, p, inv_freq=inv, layout=layout))(x, pos)
    assert out.dtype == dtype and out.shape == x.shape
    ref_fn = meta_complex_rope if layout == "interleaved" else hf_rotate_half_rope
    # Reference in float64 from the float32 inv_freq (the documented precision contract) and the
    # same (rounded) inputs; the independent float64 inv_freq differs by < 1 float32 ulp.
    np.testing.assert_allclose(inv, inv_freq_f64(rotary_dim, base), rtol=1.2e-7)
    ref = ref_fn(np.asarray(x, np.float64), pos, np.asarray(inv, np.float64))
    bound = np.zeros(x.shape)
    bound[..., :rotary_dim] = pair_norms(x, rotary_dim, layout) * phase_bound(pos, inv, rotary_dim, layout)
    bound += 1e-6 * np.abs(ref)
    if dtype == jnp.bfloat16:
      bound += np.abs(ref) * 2.0**-8  # final rounding to bf16
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(err <= bound), float(np.max(err - bound))
    # Pass-through dims are bit-exact.
    np.testing.assert_array_equal(out[..., rotary_dim:], x[..., rotary_dim:])

  @chex.variants(with_jit=True, without_jit=True)
  def test_attention_factor_scales_like_hf(self):
    params = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}
    inv, att = rope_scaling.rope_frequencies(params, head_dim=32)
    x = _rand(2, (1, 7, 2, 32))
    pos = _positions(3, (1, 7), 4000)
    out = self.variant(lambda x, p: rope.apply_rope(x, p, inv_freq=inv, layout="half", scale=att))(x, pos)
    ref = hf_rotate_half_rope(x, pos, np.asarray(inv, np.float64), attention_scaling=att)
    np.testing.assert_allclose(out, ref, atol=3e-4, rtol=0)

  def test_phase_precision_matters_at_long_positions(self):
    # The reference test above can fail: a bf16 inv_freq (what a model in bf16 might hold)
    # moves phases by radians at position 131072.
    inv = rope.rope_inv_freq(64)
    inv_bf16 = inv.astype(jnp.bfloat16).astype(jnp.float32)
    x = _rand(4, (1, 1, 1, 64))
    pos = jnp.asarray([[131072]], jnp.int32)
    good = rope.apply_rope(x, pos, inv_freq=inv)
    bad = rope.apply_rope(x, pos, inv_freq=inv_bf16)
    ref = meta_complex_rope(x, pos, np.asarray(inv, np.float64))
    assert np.max(np.abs(good - ref)) < 0.05
    assert np.max(np.abs(bad - ref)) > 0.5


# ---------------------------------------------------------------- RoPE properties (Hypothesis)

_ROT = jax.jit(rope.apply_rope, static_argnames=("layout",))


@settings(max_examples=25, deadline=None)
@given(
  q=hnp.arrays(np.float32, (1, 1, 1, 16), elements=st.floats(-4, 4, width=32)),
  k=hnp.arrays(np.float32, (1, 1, 1, 16), elements=st.floats(-4, 4, width=32)),
  p=st.integers(0, 4000),
  s=st.integers(0, 4000),
  shift=st.integers(0, 4000),
  layout=st.sampled_from(["interleaved", "half"]),
)
def test_relative_position_invariance(q, k, p, s, shift, layout):
  def score(a, b):
    rq = _ROT(jnp.asarray(q), jnp.asarray([[a]], jnp.int32), layout=layout)
    rk = _ROT(jnp.asarray(k), jnp.asarray([[b]], jnp.int32), layout=layout)
    return float(jnp.sum(rq.astype(jnp.float32) * rk.astype(jnp.float32)))

  # Float32 phases at positions <= 8000: error ~ |q||k| * 8000 * 6e-8 per pair.
  scale = float(np.linalg.norm(q) * np.linalg.norm(k))
  assert abs(score(p, s) - score(p + shift, s + shift)) <= 2e-3 * scale + 1e-5


@settings(max_examples=25, deadline=None)
@given(
  x=hnp.arrays(np.float32, (2, 3, 2, 16), elements=st.floats(-100, 100, width=32)),
  pos=hnp.arrays(np.int32, (2, 3), elements=st.integers(0, 131072)),
  layout=st.sampled_from(["interleaved", "half"]),
)
def test_norm_preservation(x, pos, layout):
  out = _ROT(jnp.asarray(x), jnp.asarray(pos), layout=layout)
  np.testing.assert_allclose(
    np.linalg.norm(np.asarray(out, np.float64), axis=-1),
    np.linalg.norm(x.astype(np.float64), axis=-1),
    rtol=2e-6,
    atol=1e-4,
  )


# ---------------------------------------------------------------- RoPE errors


def test_rope_errors_name_the_argument():
  x = jnp.zeros((1, 4, 2, 8))
  p = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="x must have shape"):
    rope.apply_rope(jnp.zeros((4, 2, 8)), p)
  with pytest.raises(ValueError, match="positions must have shape"):
    rope.apply_rope(x, jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="head_dim.*even"):
    rope.apply_rope(jnp.zeros((1, 4, 2, 7)), p)
  with pytest.raises(ValueError, match="positions must be >= 0"):
    rope.apply_rope(x, p.at[0, 1].set(-1))
  with pytest.raises(TypeError, match="positions must be an integer"):
    rope.apply_rope(x, p.astype(jnp.float32))
  with pytest.raises(TypeError, match="x must be a float"):
    rope.apply_rope(x.astype(jnp.int32), p)
  with pytest.raises(ValueError, match="positions shape"):
    rope.apply_rope(x, jnp.zeros((1, 5), jnp.int32))
  with pytest.raises(ValueError, match="rotary_dim must be <= head_dim"):
    rope.apply_rope(x, p, inv_freq=jnp.ones((5,), jnp.float32))
  with pytest.raises(ValueError, match="layout"):
    rope.apply_rope(x, p, layout="neox")
  with pytest.raises(ValueError, match="rotary_dim must be even"):
    rope.rope_inv_freq(8, rotary_dim=3)
  with pytest.raises(ValueError, match="scale must broadcast"):
    rope.apply_rope(x, p, scale=jnp.ones((1, 4, 2, 3), jnp.float32))
  with pytest.raises(ValueError, match="scale must be finite"):
    rope.apply_rope(x, p, scale=float("nan"))
  with pytest.raises(ValueError, match="inv_freq must have shape"):
    rope.rope_phases(p, jnp.ones((2, 2), jnp.float32))
  with pytest.raises(TypeError, match="positions must be an integer"):
    rope.rope_phases(p.astype(jnp.float32), jnp.ones((2,), jnp.float32))
  with pytest.raises(TypeError, match="inv_freq must be a float"):
    rope.apply_rope(x, p, inv_freq=jnp.ones((4,), jnp.int32))


# ---------------------------------------------------------------- xPos


def torchscale_xpos(x, positions, kind, scale_base=512.0, offset=0):
  """torchscale XPOS (rotate_every_two layout) in float64 numpy, at explicit positions.

  scale = ((arange(0, H, 2) + 0.4 H) / (1.4 H)) ** (pos / scale_base), duplicated per pair;
  queries multiply by it, keys by its inverse (downscale=True).
  """
  x = np.asarray(x, np.float64)
  h = x.shape[-1]
  zeta = (np.arange(0, h, 2) + 0.4 * h) / (1.4 * h)
  pos = np.asarray(positions, np.float64) - offset
  scale = zeta ** (pos[..., None] / scale_base)  # [B, T, H/2]
  if kind == "key":
    scale = 1.0 / scale
  inv = 1.0 / 10000 ** (np.arange(0, h // 2) / (h // 2))  # torchscale fixed_pos_embedding
  ang = np.asarray(positions, np.float64)[..., None] * inv
  cos = (np.cos(ang) * scale)[:, :, None, :]
  sin = (np.sin(ang) * scale)[:, :, None, :]
  x1, x2 = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = x1 * cos - x2 * sin
  out[..., 1::2] = x1 * sin + x2 * cos
  return out


class XposTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("query", "key")
  def test_matches_torchscale(self, kind):
    x = _rand(5, (2, 9, 2, 32))
    pos = _positions(6, (2, 9), 3000)
    out = self.variant(lambda x, p: xpos.apply_xpos(x, p, kind=kind, offset=1500))(x, pos)
    ref = torchscale_xpos(x, pos, kind, offset=1500)
    np.testing.assert_allclose(out, ref, atol=5e-4 * np.abs(ref).max(), rtol=1e-4)

  @chex.variants(with_jit=True, without_jit=True)
  def test_score_depends_only_on_distance_and_decays(self):
    q = _rand(7, (1, 1, 1, 32))
    k = _rand(8, (1, 1, 1, 32))

    def score(a, b):
      rq = xpos.apply_xpos(q, jnp.asarray([[a]], jnp.int32), kind="query", offset=2000)
      rk = xpos.apply_xpos(k, jnp.asarray([[b]], jnp.int32), kind="key", offset=2000)
      return jnp.sum(rq * rk)

    f = self.variant(score)
    np.testing.assert_allclose(f(1100, 1000), f(3100, 3000), rtol=2e-3, atol=1e-4)
    # The scale of a query and a key at the same position cancels exactly (up to rounding).
    s_q = xpos.xpos_scale(jnp.asarray([[777]], jnp.int32), rotary_dim=32, kind="query")
    s_k = xpos.xpos_scale(jnp.asarray([[777]], jnp.int32), rotary_dim=32, kind="key")
    np.testing.assert_allclose(s_q * s_k, 1.0, rtol=1e-6)
    # zeta < 1: the product of scales decays with distance, faster for low pairs.
    d = np.asarray(
      xpos.xpos_scale(jnp.asarray([[1000]], jnp.int32), rotary_dim=32, kind="query")
      * xpos.xpos_scale(jnp.asarray([[0]], jnp.int32), rotary_dim=32, kind="key")
    ).ravel()
    zeta = (np.arange(0, 32, 2) / 32 + 0.4) / 1.4
    np.testing.assert_allclose(d, zeta ** (1000 / 512), rtol=1e-5)

  def test_errors(self):
    p = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="kind"):
      xpos.xpos_scale(p, rotary_dim=8, kind="value")
    with pytest.raises(ValueError, match="rotary_dim must be even"):
      xpos.xpos_scale(p, rotary_dim=7, kind="query")
    with pytest.raises(ValueError, match="scale_base"):
      xpos.xpos_scale(p, rotary_dim=8, kind="query", scale_base=0)
    with pytest.raises(ValueError, match="gamma"):
      xpos.xpos_zeta(8, gamma=-0.1)
    with pytest.raises(ValueError, match="positions must be >= 0"):
      xpos.apply_xpos(jnp.zeros((1, 3, 1, 8)), p.at[0, 0].set(-2), kind="key")
    with pytest.raises(ValueError, match="offset"):
      xpos.xpos_scale(p, rotary_dim=8, kind="query", offset=1.5)


# ---------------------------------------------------------------- sinusoidal


class SinusoidalTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("interleaved", "concat")
  def test_matches_vaswani(self, layout):
    pos = _positions(9, (2, 11), 2000)
    out = self.variant(lambda p: sinusoidal.sinusoidal_embedding(p, d_model=32, layout=layout))(pos)
    p = np.asarray(pos, np.float64)[..., None]
    i = np.arange(16)
    ang = p / 10000 ** (2 * i / 32)
    ref = np.zeros((2, 11, 32))
    if layout == "interleaved":
      ref[..., 0::2], ref[..., 1::2] = np.sin(ang), np.cos(ang)
    else:
      ref[..., :16], ref[..., 16:] = np.sin(ang), np.cos(ang)
    np.testing.assert_allclose(out, ref, atol=3e-4)
    assert out.dtype == jnp.float32

  def test_dtype_and_errors(self):
    pos = jnp.zeros((1, 3), jnp.int32)
    assert sinusoidal.sinusoidal_embedding(pos, d_model=8, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="d_model must be even"):
      sinusoidal.sinusoidal_embedding(pos, d_model=7)
    with pytest.raises(ValueError, match="positions must have shape"):
      sinusoidal.sinusoidal_embedding(jnp.zeros((3,), jnp.int32), d_model=8)
    with pytest.raises(TypeError, match="positions must be an integer"):
      sinusoidal.sinusoidal_embedding(pos.astype(jnp.float32), d_model=8)
    with pytest.raises(ValueError, match="layout"):
      sinusoidal.sinusoidal_embedding(pos, d_model=8, layout="split")
