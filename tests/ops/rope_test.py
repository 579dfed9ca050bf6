"""RoPE (both layouts, partial rotary, attention factor), xPos and sinusoidal encodings against
independent float64 numpy references: Meta's complex formula, HF's rotate-half formula,
torchscale's xPos, Vaswani et al.'s sinusoids."""

import math
import re
from fractions import Fraction

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpe.ops import rope, rope_scaling, sinusoidal, xpos

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
    # Exact phases: cos and sin each within 3e-7 of the float64 value (float32 phases would need
    # half an ulp of p * theta here, up to 3.9e-3 rad; see test_float32_phases_match_engines).
    bound[..., :rotary_dim] = pair_norms(x, rotary_dim, layout) * 6e-7
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

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("interleaved", "half")
  def test_float32_phases_match_engines(self, layout):
    # phase_precision="float32": the phase float32(p) * float32(theta), rounded as HF / Meta do.
    x = _rand(0, (2, 16, 3, 64))
    pos = _positions(1, (2, 16), 131073).at[0, 0].set(131072)
    inv = rope.rope_inv_freq(64)
    out = self.variant(
      lambda x, p: rope.apply_rope(x, p, inv_freq=inv, layout=layout, phase_precision="float32")
    )(x, pos)
    f32_phase = (np.asarray(pos, np.float32)[..., None] * np.asarray(inv, np.float32)).astype(np.float64)
    # Rotate with the float32-rounded phases in float64 (cos/sin of float32 argument: 3e-7).
    xr = np.asarray(x, np.float64)
    a, b = (xr[..., 0::2], xr[..., 1::2]) if layout == "interleaved" else (xr[..., :32], xr[..., 32:])
    z = (a + 1j * b) * np.exp(1j * f32_phase)[:, :, None, :]
    want = np.empty_like(xr)
    if layout == "interleaved":
      want[..., 0::2], want[..., 1::2] = z.real, z.imag
    else:
      want[..., :32], want[..., 32:] = z.real, z.imag
    np.testing.assert_allclose(out, want, atol=2e-6 * np.abs(xr).max())
    exact = rope.apply_rope(x, pos, inv_freq=inv, layout=layout)
    assert np.max(np.abs(np.asarray(out) - np.asarray(exact))) > 1e-3  # they differ at 131072

  def test_phase_precision_matters_at_long_positions(self):
    # The reference test above can fail: a bf16 inv_freq (what a model in bf16 might hold)
    # moves phases by radians at position 131072.
    inv = rope.rope_inv_freq(64)
    inv_bf16 = inv.astype(jnp.bfloat16).astype(jnp.float32)
    x = _rand(4, (1, 1, 1, 64))
    pos = jnp.asarray([[131072]], jnp.int32)
    good = rope.apply_rope(x, pos, inv_freq=inv, layout="interleaved")
    bad = rope.apply_rope(x, pos, inv_freq=inv_bf16, layout="interleaved")
    ref = meta_complex_rope(x, pos, np.asarray(inv, np.float64))
    assert np.max(np.abs(good - ref)) < 0.05
    assert np.max(np.abs(bad - ref)) > 0.5


# ---------------------------------------------------------------- exact phases

# 2 pi as an exact fraction from 75 digits of pi (OEIS A000796), independent of jaxpe's constant.
_TWO_PI = 2 * Fraction("3.141592653589793238462643383279502884197169399375105820974944592307816")


def exact_cos_sin(positions, inv_freq):
  """cos/sin of p * theta with the phase reduced modulo 2 pi in exact rational arithmetic (the
  float64 frequency's exact value times the integer position), then math.cos / math.sin."""
  positions, inv_freq = np.asarray(positions).ravel(), np.asarray(inv_freq, np.float64)
  cos = np.empty((positions.size, inv_freq.size))
  sin = np.empty_like(cos)
  for j, theta in enumerate(inv_freq):
    t = Fraction(float(theta))
    for i, p in enumerate(positions.tolist()):
      phase = p * t
      r = float(phase - round(phase / _TWO_PI) * _TWO_PI)
      cos[i, j], sin[i, j] = math.cos(r), math.sin(r)
  return cos, sin


def test_17780_case_from_the_issue():
  # Head dim 128, base 1e4, position 17780, pair 1 (dims 2, 3): the float32 product gives
  # sin 0.0987543, cos -0.9951118; the float64 phase 17780 * 1e4 ** (-2 / 128) gives the truth.
  theta = 10000.0 ** (-2.0 / 128.0)
  want_cos, want_sin = math.cos(17780 * theta), math.sin(17780 * theta)
  assert abs(want_sin - 0.0997597) < 1e-7 and abs(want_cos + 0.9950116) < 1e-7
  x = np.zeros((1, 1, 1, 128), np.float32)
  x[..., 2] = 1.0  # pair 1 = 1 + 0j: the output pair is (cos, sin)
  pos = jnp.asarray([[17780]], jnp.int32)
  out = jax.jit(lambda x, p: rope.apply_rope(x, p, layout="interleaved"))(jnp.asarray(x), pos)
  assert abs(float(out[0, 0, 0, 2]) - want_cos) <= 3e-7 and abs(float(out[0, 0, 0, 3]) - want_sin) <= 3e-7
  cos, sin = rope.rope_cos_sin(pos, rope.rope_inv_freq(128, dtype=np.float64))
  assert abs(float(cos[0, 0, 1]) - want_cos) <= 3e-7 and abs(float(sin[0, 0, 1]) - want_sin) <= 3e-7
  f32 = rope.apply_rope(jnp.asarray(x), pos, phase_precision="float32", layout="interleaved")
  assert abs(float(f32[0, 0, 0, 3]) - want_sin) > 5e-4  # today's float32 phases: 0.0987543


@pytest.mark.parametrize("base", [1e4, 5e5])
def test_exact_phases_below_2_pow_31_every_frequency(base):
  rng = np.random.default_rng(int(base))
  pos = rng.integers(0, 2**31, 300)
  pos[:4] = [0, 1, 2**31 - 1, 2**24 + 1]
  inv64 = rope.rope_inv_freq(128, base=base, dtype=np.float64)  # all 64 frequencies
  want_cos, want_sin = exact_cos_sin(pos, inv64)
  f = jax.jit(lambda p: rope.rope_cos_sin(p, inv64))  # positions traced
  cos, sin = (np.asarray(a, np.float64) for a in f(jnp.asarray(pos, jnp.int32)))
  assert np.max(np.abs(cos - want_cos)) <= 3e-7 and np.max(np.abs(sin - want_sin)) <= 3e-7
  # Against the plain float64 value cos(float64(p) * theta) too (its own rounding: <= 1.2e-7).
  naive = np.asarray(pos, np.float64)[:, None] * inv64
  assert np.max(np.abs(cos - np.cos(naive))) <= 3e-7 and np.max(np.abs(sin - np.sin(naive))) <= 3e-7
  # A float32 inv_freq is the exact number it holds; traced, it is converted in the graph.
  inv32 = np.asarray(inv64, np.float32)
  want_cos, want_sin = exact_cos_sin(pos, inv32)
  g = jax.jit(lambda p, inv: rope.rope_cos_sin(p, inv))
  cos, sin = (np.asarray(a, np.float64) for a in g(jnp.asarray(pos, jnp.int32), jnp.asarray(inv32)))
  assert np.max(np.abs(cos - want_cos)) <= 3e-7 and np.max(np.abs(sin - want_sin)) <= 3e-7
  # The float32 products are off by up to 2 here.
  cos32, _ = rope.rope_cos_sin(jnp.asarray(pos, jnp.int32), inv64, phase_precision="float32")
  assert np.max(np.abs(np.asarray(cos32, np.float64) - np.cos(naive))) > 0.5


def test_negative_and_fractional_positions_under_jit():
  # Concrete negative positions are refused; traced ones (not checkable) rotate by p * theta.
  inv = rope.rope_inv_freq(16, dtype=np.float64)
  pos = np.asarray([-1, -77777, -(2**31), 5], np.int32)
  cos, sin = jax.jit(lambda p: rope.rope_cos_sin(p, inv))(jnp.asarray(pos))
  want_cos, want_sin = exact_cos_sin(pos, inv)
  np.testing.assert_allclose(cos, want_cos, atol=3e-7)
  np.testing.assert_allclose(sin, want_sin, atol=3e-7)
  # Float positions: fractional phases, the float32 value of the position taken exactly.
  fpos = np.asarray([0.5, 3.25, 1000.75, 2.0**23 + 0.5, 123456.0], np.float32)
  cos, sin = jax.jit(lambda p: rope.rope_cos_sin(p, inv))(jnp.asarray(fpos))
  phase = fpos.astype(np.float64)[:, None] * inv
  np.testing.assert_allclose(cos, np.cos(phase), atol=3e-7)
  np.testing.assert_allclose(sin, np.sin(phase), atol=3e-7)


def _score(q, k, i, j, **kw):
  rq = rope.apply_rope(q, jnp.asarray([i], jnp.int32), **kw)
  rk = rope.apply_rope(k, jnp.asarray([j], jnp.int32), **kw)
  return float(jnp.sum(rq.astype(jnp.float32) * rk.astype(jnp.float32)))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_relative_invariance_up_to_2_pow_30(layout):
  q, k = _rand(20, (1, 1, 1, 64)), _rand(21, (1, 1, 1, 64))
  qk = float(np.sum(np.abs(np.asarray(q)) * np.abs(np.asarray(k))))
  shifts = [1, 4096, 131072, 2**24 + 3, 2**29 + 12345, 2**30 - 1, 2**30]
  for i, j in [(10, 13), (5000, 17), (0, 0)]:
    base_score = _score(q, k, i, j, layout=layout)
    for s in shifts:
      # cos/sin within 3e-7 each plus float32 rounding of the 64-term sum: ~1e-6 of sum |q||k|.
      assert abs(_score(q, k, i + s, j + s, layout=layout) - base_score) <= 2e-6 * qk, (i, j, s)
  # The float32 phases break it (issue 8: -15.56 against -11.50 at s = 2^25).
  f32 = dict(layout=layout, phase_precision="float32")
  drift = max(abs(_score(q, k, 10 + s, 13 + s, **f32) - _score(q, k, 10, 13, **f32)) for s in shifts[-3:])
  assert drift > 0.05 * qk


def test_bf16_error_does_not_grow_with_position():
  # bf16 activations: the output rounding (2^-9 relative per element) is the whole error, at any
  # position, and the float64 truth is the same score at every shift.
  q = _rand(22, (1, 1, 8, 64), jnp.bfloat16)
  k = _rand(23, (1, 1, 8, 64), jnp.bfloat16)
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  inv = rope.rope_inv_freq(64, dtype=np.float64)
  truth = np.einsum("bthd,bthd->h", meta_complex_rope(q64, [[3]], inv), meta_complex_rope(k64, [[1]], inv))
  errors = []
  for s in [0, 4096, 2**20, 2**27 + 5, 2**30]:
    rq = rope.apply_rope(q, jnp.asarray([3 + s], jnp.int32), layout="interleaved")
    rk = rope.apply_rope(k, jnp.asarray([1 + s], jnp.int32), layout="interleaved")
    score = np.einsum("bthd,bthd->h", np.asarray(rq, np.float64), np.asarray(rk, np.float64))
    errors.append(np.max(np.abs(score - truth)))
  bound = 2 * 2.0**-8 * np.max(np.sum(np.abs(q64) * np.abs(k64), axis=-1))
  assert max(errors) <= bound, (errors, bound)
  assert max(errors) <= 4 * max(errors[0], bound / 16), errors  # no growth with the shift


def test_xpos_and_sinusoidal_phases_are_exact():
  # xPos at positions near 2^30 (scales centred by offset) against torchscale's formula in float64.
  x = _rand(24, (1, 4, 2, 32))
  pos = jnp.asarray([[2**30 + 3, 2**30 + 999, 2**30 - 7, 2**30 - 1000]], jnp.int32)
  offset = 2**30
  for kind in ("query", "key"):
    out = jax.jit(
      lambda x, p, kind=kind: xpos.apply_xpos(x, p, kind=kind, offset=offset, layout="interleaved")
    )(x, pos)
    ref = torchscale_xpos(x, np.asarray(pos, np.int64), kind, offset=offset)
    np.testing.assert_allclose(out, ref, atol=2e-6 * np.abs(ref).max(), rtol=0)
  # Sinusoids at large positions against the paper's formula in float64.
  spos = jnp.asarray([[2**31 - 1, 2**30 + 12345, 17780]], jnp.int32)
  emb = jax.jit(lambda p: sinusoidal.sinusoidal_embedding(p, d_model=64))(spos)
  ang = np.asarray(spos, np.float64)[..., None] / 10000 ** (np.arange(32) * 2 / 64)
  np.testing.assert_allclose(emb[..., 0::2], np.sin(ang), atol=3e-7)
  np.testing.assert_allclose(emb[..., 1::2], np.cos(ang), atol=3e-7)


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
    rope.apply_rope(jnp.zeros((4, 2, 8)), p, layout="interleaved")
  with pytest.raises(ValueError, match="positions must have shape"):
    rope.apply_rope(x, jnp.zeros((5,), jnp.int32), layout="interleaved")
  with pytest.raises(ValueError, match="positions must have shape"):
    rope.apply_rope(jnp.zeros((3, 4, 2, 8)), jnp.zeros((2, 4), jnp.int32), layout="interleaved")
  with pytest.raises(ValueError, match=r"positions must be < 2\^31"):
    rope.apply_rope(x, np.full((1, 4), 2**31, np.int64), layout="interleaved")
  with pytest.raises(ValueError, match="float32 cannot hold"):
    rope.apply_rope(x, np.full((1, 4), 2.0**24 + 1.0), layout="interleaved")
  with pytest.raises(ValueError, match="finite"):
    rope.apply_rope(x, np.full((1, 4), np.inf, np.float32), layout="interleaved")
  with pytest.raises(ValueError, match="rotated_slice"):
    rope.apply_rope(x, p, rotated_slice="last", layout="interleaved")
  with pytest.raises(ValueError, match="phase_precision"):
    rope.apply_rope(x, p, phase_precision="float64", layout="interleaved")
  with pytest.raises(ValueError, match="mrope_section must sum"):
    rope.apply_rope(x, jnp.zeros((3, 1, 4), jnp.int32), mrope_section=[1, 1, 1], layout="interleaved")
  with pytest.raises(ValueError, match=r"positions must have shape \[3, \.\.\.\]"):
    rope.apply_rope(x, jnp.zeros((2, 1, 4), jnp.int32), mrope_section=[2, 1, 1], layout="interleaved")
  with pytest.raises(ValueError, match="head_dim.*even"):
    rope.apply_rope(jnp.zeros((1, 4, 2, 7)), p, layout="interleaved")
  with pytest.raises(ValueError, match="positions must be >= 0"):
    rope.apply_rope(x, p.at[0, 1].set(-1), layout="interleaved")
  with pytest.raises(TypeError, match="positions must be an integer or float"):
    rope.apply_rope(x, p.astype(bool), layout="interleaved")
  with pytest.raises(TypeError, match="x must be a float"):
    rope.apply_rope(x.astype(jnp.int32), p, layout="interleaved")
  with pytest.raises(ValueError, match="positions must have shape"):
    rope.apply_rope(x, jnp.zeros((1, 5), jnp.int32), layout="interleaved")
  with pytest.raises(ValueError, match="rotary_dim must be <= head_dim"):
    rope.apply_rope(x, p, inv_freq=jnp.ones((5,), jnp.float32), layout="interleaved")
  with pytest.raises(ValueError, match="layout"):
    rope.apply_rope(x, p, layout="neox")
  with pytest.raises(ValueError, match="rotary_dim must be even"):
    rope.rope_inv_freq(8, rotary_dim=3)
  with pytest.raises(ValueError, match="scale must broadcast"):
    rope.apply_rope(x, p, scale=jnp.ones((1, 4, 2, 3), jnp.float32), layout="interleaved")
  with pytest.raises(ValueError, match="scale must be finite"):
    rope.apply_rope(x, p, scale=float("nan"), layout="interleaved")
  with pytest.raises(ValueError, match="inv_freq must have shape"):
    rope.rope_phases(p, jnp.ones((2, 2), jnp.float32))
  with pytest.raises(TypeError, match="positions must be an integer"):
    rope.rope_phases(p.astype(jnp.float32), jnp.ones((2,), jnp.float32))
  with pytest.raises(TypeError, match="inv_freq must be a float"):
    rope.apply_rope(x, p, inv_freq=jnp.ones((4,), jnp.int32), layout="interleaved")


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
    out = self.variant(lambda x, p: xpos.apply_xpos(x, p, kind=kind, offset=1500, layout="interleaved"))(
      x, pos
    )
    ref = torchscale_xpos(x, pos, kind, offset=1500)
    np.testing.assert_allclose(out, ref, atol=5e-4 * np.abs(ref).max(), rtol=1e-4)

  @chex.variants(with_jit=True, without_jit=True)
  def test_score_depends_only_on_distance_and_decays(self):
    q = _rand(7, (1, 1, 1, 32))
    k = _rand(8, (1, 1, 1, 32))

    def score(a, b):
      rq = xpos.apply_xpos(q, jnp.asarray([[a]], jnp.int32), kind="query", offset=2000, layout="interleaved")
      rk = xpos.apply_xpos(k, jnp.asarray([[b]], jnp.int32), kind="key", offset=2000, layout="interleaved")
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
      xpos.apply_xpos(jnp.zeros((1, 3, 1, 8)), p.at[0, 0].set(-2), kind="key", layout="interleaved")
    with pytest.raises(TypeError, match="offset"):
      xpos.xpos_scale(p, rotary_dim=8, kind="query", offset=1.5)


def _xpos_score_f64(q, k, n, m, scale_base=512.0):
  """q.k of xPos in float64, closed form: sum_i (rot(q, n) . rot(k, m))_pair_i * zeta_i^((n - m) / sb)."""
  # torchscale_xpos with offset = own position: the pure rotation (scale 1), in float64.
  rq = torchscale_xpos(q, np.asarray([[n]], np.int64), "query", scale_base, offset=n)
  rk = torchscale_xpos(k, np.asarray([[m]], np.int64), "key", scale_base, offset=m)
  h = rq.shape[-1]
  zeta = (np.arange(0, h, 2) + 0.4 * h) / (1.4 * h)
  pair_dots = (rq * rk).reshape(h // 2, 2).sum(-1)
  return float(np.sum(pair_dots * zeta ** ((n - m) / scale_base)))


def test_xpos_far_positions_score_is_the_float64_distance_decay():
  # Issue 17 item 7: at far positions (up to 2^31 - 1) and large distances, with one offset shared by
  # the query and the key call, q.k is finite and equals the float64 closed form
  # sum_i rot(q, n)_i rot(k, m)_i zeta_i^((n - m) / 512) to float32 accuracy. Eager calls (the
  # offset is a static int; eager ops compile once per shape, a jit would compile once per offset).
  q, k = _rand(31, (1, 1, 1, 32)), _rand(32, (1, 1, 1, 32))
  zeta = (np.arange(0, 32, 2) / 32 + 0.4) / 1.4
  pair_abs = lambda a: np.abs(np.asarray(a, np.float64)).reshape(16, 2).sum(-1)  # noqa: E731
  for far in (10**6, 10**9, 2**31 - 1):
    for distance in (0, 1, 777, 30000, 70000):
      n, m = far, far - distance
      offset = (n + m) // 2
      rq = xpos.apply_xpos(
        q, jnp.asarray([[n]], jnp.int32), kind="query", offset=offset, layout="interleaved"
      )
      rk = xpos.apply_xpos(k, jnp.asarray([[m]], jnp.int32), kind="key", offset=offset, layout="interleaved")
      score = float(jnp.sum(rq * rk))
      truth = _xpos_score_f64(q, k, n, m)
      # Bound: float32 rounding of each term, relative to the sum of |terms| (decays with the distance).
      bound = 1e-5 * np.sum(pair_abs(q) * pair_abs(k) * zeta ** (distance / 512))
      assert math.isfinite(score), (far, distance)
      assert abs(score - truth) <= bound, (far, distance, score, truth, bound)


def test_xpos_depends_only_on_position_minus_offset():
  # Shifting positions and offset together (towards 2^31) gives bit-identical outputs.
  pos = _positions(34, (2, 5), 30000)
  for kind in ("query", "key"):
    near = xpos.xpos_scale(pos, rotary_dim=16, kind=kind, offset=15000)
    shift = 2**31 - 1 - 30000
    far = xpos.xpos_scale(pos + shift, rotary_dim=16, kind=kind, offset=15000 + shift)
    np.testing.assert_array_equal(near, far)


def test_xpos_positions_outside_the_window_are_refused_or_nan_under_jit():
  x = jnp.ones((1, 2, 1, 8), jnp.float32)
  p = jnp.asarray([[10**6, 10**6 + 5]], jnp.int32)
  window = xpos.xpos_window(rotary_dim=8)
  assert window == math.floor(87 * 512 / math.log(1.4 / 0.4))
  for kind in ("query", "key"):
    with pytest.raises(ValueError, match=r"too far from offset=0.*offset=\(min \+ max\) // 2"):
      xpos.apply_xpos(x, p, kind=kind, layout="interleaved")
    out = jax.jit(lambda x, p, kind=kind: xpos.apply_xpos(x, p, kind=kind, layout="interleaved"))(x, p)
    assert np.all(np.isnan(out))  # not a silent 0 or inf
    # The window edge itself is accepted and finite, one past it is refused.
    edge = jnp.asarray([[window]], jnp.int32)
    assert np.all(np.isfinite(xpos.xpos_scale(edge, rotary_dim=8, kind=kind)))
    with pytest.raises(ValueError, match="too far"):
      xpos.xpos_scale(edge + 1, rotary_dim=8, kind=kind)


# ---------------------------------------------------------------- sinusoidal


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


# ---------------------------------------------------------------- library API


def test_positions_broadcast_over_the_batch_and_float_positions():
  x = _rand(30, (2, 5, 3, 16))
  pos = jnp.arange(5, dtype=jnp.int32) + 1000
  full = rope.apply_rope(x, jnp.broadcast_to(pos, (2, 5)), layout="interleaved")
  np.testing.assert_array_equal(rope.apply_rope(x, pos, layout="interleaved"), full)  # [T]
  np.testing.assert_array_equal(rope.apply_rope(x, pos[None], layout="interleaved"), full)  # [1, T]
  int64 = np.asarray(pos, np.int64)  # < 2^31
  np.testing.assert_array_equal(rope.apply_rope(x, int64, layout="interleaved"), full)
  integral = pos.astype(jnp.float32)
  np.testing.assert_array_equal(rope.apply_rope(x, integral, layout="interleaved"), full)
  # Fractional positions rotate by p * theta (float64 reference).
  fpos = np.asarray([0.5, 1.25, 99.75, 1000.5, 4096.125], np.float32)
  out = jax.jit(lambda x, p: rope.apply_rope(x, p, layout="interleaved"))(x, jnp.asarray(fpos))
  ref = meta_complex_rope(x, np.broadcast_to(fpos, (2, 5)), inv_freq_f64(16))
  np.testing.assert_allclose(out, ref, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_trailing_rotated_slice_rotate_the_last_r(layout):
  # MLA-style heads [nope | rope]: rotating the last R dims = rotating the first R of the head with
  # its two parts swapped.
  x = _rand(31, (2, 6, 2, 24))
  pos = _positions(32, (2, 6), 100000)
  inv = rope.rope_inv_freq(24, rotary_dim=8, dtype=np.float64)
  out = rope.apply_rope(x, pos, inv_freq=inv, layout=layout, rotated_slice="trailing")
  swapped = jnp.concatenate([x[..., 16:], x[..., :16]], axis=-1)
  ref_fn = meta_complex_rope if layout == "interleaved" else hf_rotate_half_rope
  ref = ref_fn(swapped, pos, inv)
  ref = np.concatenate([ref[..., 8:], ref[..., :8]], axis=-1)
  np.testing.assert_allclose(out, ref, atol=1e-6 * np.abs(ref).max())
  np.testing.assert_array_equal(out[..., :16], x[..., :16])  # pass-through dims untouched


def test_rope_cos_sin_matches_the_formula():
  inv = inv_freq_f64(32, base=5e5)
  pos = _positions(33, (3, 7), 5000)
  cos, sin = jax.jit(lambda p: rope.rope_cos_sin(p, inv))(pos)  # inv stays float64 (a constant)
  assert cos.shape == sin.shape == (3, 7, 16) and cos.dtype == jnp.float32
  phase = np.asarray(pos, np.float64)[..., None] * inv
  np.testing.assert_allclose(cos, np.cos(phase), atol=3e-7)
  np.testing.assert_allclose(sin, np.sin(phase), atol=3e-7)


def test_mrope_matches_qwen2_vl():
  torch = pytest.importorskip("torch")
  from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
  from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

  section = [4, 6, 6]  # head_dim 32: 16 frequencies
  cfg = Qwen2VLTextConfig(
    hidden_size=64,
    num_attention_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
  )
  rotary = Qwen2VLRotaryEmbedding(cfg)
  rng = np.random.default_rng(34)
  pos = rng.integers(0, 3000, (3, 2, 9))  # [3, B, T]: temporal, height, width
  q, k = rng.standard_normal((2, 2, 9, 32)), rng.standard_normal((2, 2, 9, 32))  # HF: [B, N, T, H]
  cos, sin = rotary(torch.zeros(1, dtype=torch.float64), torch.as_tensor(pos))
  hq, hk = apply_rotary_pos_emb(
    torch.as_tensor(q), torch.as_tensor(k), cos.to(torch.float64), sin.to(torch.float64)
  )
  inv = np.asarray(rotary.inv_freq, np.float32)  # HF's float32 frequencies
  jq = rope.apply_rope(
    jnp.asarray(q.transpose(0, 2, 1, 3), jnp.float32),
    jnp.asarray(pos, jnp.int32),
    inv_freq=inv,
    layout="half",
    mrope_section=section,
  )
  jk = rope.apply_rope(
    jnp.asarray(k.transpose(0, 2, 1, 3), jnp.float32),
    jnp.asarray(pos, jnp.int32),
    inv_freq=inv,
    layout="half",
    mrope_section=section,
  )
  # HF's float32 phases at positions < 3000: error <= half an ulp of 3000 rad (1.2e-4) per pair.
  np.testing.assert_allclose(jq, hq.numpy().transpose(0, 2, 1, 3), atol=5e-4)
  np.testing.assert_allclose(jk, hk.numpy().transpose(0, 2, 1, 3), atol=5e-4)
  # And exactly (3e-7) against the float64 formula with each frequency's own position row.
  axis = np.repeat(np.arange(3), section)
  phase = np.moveaxis(pos, 0, -1)[..., axis] * inv.astype(np.float64)  # [B, T, 16]
  qt = q.transpose(0, 2, 1, 3)
  z = (qt[..., :16] + 1j * qt[..., 16:]) * np.exp(1j * phase)[:, :, None, :]
  np.testing.assert_allclose(jq, np.concatenate([z.real, z.imag], axis=-1), atol=2e-6)
  # One row for all three axes (text tokens) is plain RoPE.
  same = np.broadcast_to(pos[:1], pos.shape)
  np.testing.assert_allclose(
    rope.apply_rope(
      jnp.asarray(qt, jnp.float32),
      jnp.asarray(same, jnp.int32),
      inv_freq=inv,
      layout="half",
      mrope_section=section,
    ),
    rope.apply_rope(
      jnp.asarray(qt, jnp.float32), jnp.asarray(pos[0], jnp.int32), inv_freq=inv, layout="half"
    ),
    atol=1e-6,
  )


def test_gradients_in_frequencies_and_float_positions():
  # The integer reduction has no derivative; the custom JVP gives d/dtheta and d/dp of p * theta.
  # Reference: JAX's own autodiff of cos/sin of the float32 product (small positions, where the
  # two phases agree to float32 rounding).
  x = _rand(35, (1, 5, 2, 8))
  pos = jnp.arange(5, dtype=jnp.int32) + 100
  inv = jnp.asarray([1.0, 0.1, 0.01, 0.001], jnp.float32)

  def loss(inv, p, precision):
    return jnp.sum(
      rope.apply_rope(x, p, inv_freq=inv, phase_precision=precision, layout="interleaved") * x[..., ::-1]
    )

  for argnum, p in ((0, pos), (1, pos.astype(jnp.float32))):
    exact = jax.jit(jax.grad(loss, argnums=argnum), static_argnums=2)(inv, p, "exact")
    f32 = jax.grad(loss, argnums=argnum)(inv, p, "float32")
    np.testing.assert_allclose(exact, f32, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(f32))))


def test_second_derivatives_in_frequencies_and_float_positions():
  # d^2 cos(p theta) / d theta^2 = -p^2 cos(p theta), d^2 sin(p theta) / dp^2 = -theta^2 sin(p theta):
  # closed forms in float64 (the custom JVP's rule must itself be differentiable, not stop at order 1).
  inv = jnp.asarray([1.0, 0.1, 0.01], jnp.float32)
  pos = jnp.asarray([3, 100, 1777], jnp.int32)
  p64, t64 = np.asarray(pos, np.float64)[:, None], np.asarray(inv, np.float64)[None, :]
  h_theta = jax.hessian(lambda t: jnp.sum(rope.rope_cos_sin(pos, t)[0]))(inv)
  np.testing.assert_allclose(np.diag(h_theta), np.sum(-(p64**2) * np.cos(p64 * t64), 0), rtol=1e-4)
  pf = jnp.asarray([3.5, 100.25, 1000.75], jnp.float32)
  pf64 = np.asarray(pf, np.float64)[:, None]
  h_pos = jax.hessian(lambda p: jnp.sum(rope.rope_cos_sin(p, inv)[1]))(pf)
  np.testing.assert_allclose(np.diag(h_pos), np.sum(-(t64**2) * np.sin(pf64 * t64), 1), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_cos_sin_run_once_per_position_not_per_head_in_the_compiled_op(layout):
  # apply_rope's speed rests on XLA not fusing cos/sin into the loop that writes the rotated
  # [B, T, N, H] output, where they would run for every head and both halves of each pair (what
  # XLA did before 2026-11-30: 2N times the work). In the optimized HLO, the fusions that write an
  # output-sized array must call computations without cosine/sine.
  b, t, n, h = 2, 6, 8, 16
  x = jnp.zeros((b, t, n, h), jnp.float32)
  pos = jnp.zeros((b, t), jnp.int32)
  hlo = (
    jax.jit(lambda x, p: rope.apply_rope(x, p, layout=layout, phase_precision="float32"))
    .lower(x, pos)
    .compile()
    .as_text()
  )
  bodies = dict(re.findall(r"^%(\S+) \(.*?\{\n(.*?)^\}", hlo, re.S | re.M))
  assert any(re.search(r" (?:cosine|sine)\(", body) for body in bodies.values()), "no cos/sin found"
  out_fusions = re.findall(rf"= f32\[{b},{t},{n},{h}\]\S* fusion\(.*?calls=%([\w.-]+)", hlo)
  assert out_fusions, "no fusion writes the output"
  for name in out_fusions:
    assert not re.search(r" (?:cosine|sine)\(", bodies[name]), f"cos/sin fused into the output loop {name}"
