"""Core ops of issue 2 against independent references (numpy float64, transformers, closed forms)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxpe
from jaxpe import emulation
from jaxpe.ops import alibi, rope

# ---------------------------------------------------------------- references (numpy float64)


def rope_reference(x, positions, base=10000.0, layout="interleaved"):
  """RoFormer rotation written out with cos/sin on real pairs, float64."""
  x = np.asarray(x, np.float64)
  h = x.shape[-1]
  inv = base ** (-np.arange(0, h, 2, dtype=np.float64) / h)
  ang = np.asarray(positions, np.float64)[:, :, None, None] * inv  # [B, T, 1, H/2]
  if layout == "interleaved":
    a, b = x[..., 0::2], x[..., 1::2]
  else:
    a, b = x[..., : h // 2], x[..., h // 2 :]
  ra, rb = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
  out = np.empty_like(x)
  if layout == "interleaved":
    out[..., 0::2], out[..., 1::2] = ra, rb
  else:
    out[..., : h // 2], out[..., h // 2 :] = ra, rb
  return out


def _rand(seed, shape, dtype=jnp.float32):
  """Standard-normal test data from numpy's generator (a jax.random draw compiles once per shape: 1-3 s
  of CPU each, the largest cost of these small tests)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype))


# ---------------------------------------------------------------- RoPE


class RopeTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("interleaved", "half")
  def test_matches_float64_reference(self, layout):
    x = _rand(0, (2, 9, 3, 16))
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 5000, (2, 9)), jnp.int32)
    out = self.variant(lambda x, p: rope.apply_rope(x, p, layout=layout))(x, pos)
    chex.assert_shape(out, x.shape)
    # float32 phases at positions < 5000: absolute error of p * theta is ~ 5000 * 6e-8.
    np.testing.assert_allclose(out, rope_reference(x, pos, layout=layout), atol=2e-3, rtol=0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_preserves_norm(self):
    x = _rand(1, (3, 11, 2, 32))
    pos = jnp.asarray(np.random.default_rng(1).integers(0, 100000, (3, 11)), jnp.int32)
    out = self.variant(lambda x, p: rope.apply_rope(x, p, layout="interleaved"))(x, pos)
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_position_zero_is_identity(self):
    x = _rand(2, (2, 5, 4, 8))
    out = self.variant(lambda x, p: rope.apply_rope(x, p, layout="interleaved"))(
      x, jnp.zeros((2, 5), jnp.int32)
    )
    np.testing.assert_array_equal(out, x)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(1, 7, 100, 4096)
  def test_scores_depend_only_on_distance(self, shift):
    q, k = _rand(3, (1, 6, 2, 16)), _rand(4, (1, 6, 2, 16))
    pos = jnp.asarray([[0, 3, 9, 20, 50, 200]], jnp.int32)
    f = self.variant(
      lambda q, k, p: jnp.einsum(
        "BTNH,BSNH->BNTS",
        rope.apply_rope(q, p, layout="interleaved"),
        rope.apply_rope(k, p, layout="interleaved"),
      )
    )
    base, shifted = f(q, k, pos), f(q, k, pos + shift)
    # A query/key pair changes by < 1e-4 relative even though each vector rotated by shift radians.
    np.testing.assert_allclose(shifted, base, atol=2e-4 * (1 + shift / 1000))
    assert not np.allclose(f(q, k, pos * 2), base, atol=1e-2)  # but distances matter

  @chex.variants(with_jit=True, without_jit=True)
  def test_bf16_in_bf16_out(self):
    x = _rand(5, (2, 7, 2, 16), jnp.bfloat16)
    pos = jnp.asarray(np.random.default_rng(2).integers(0, 2048, (2, 7)), jnp.int32)
    out = self.variant(lambda x, p: rope.apply_rope(x, p, layout="interleaved"))(x, pos)
    assert out.dtype == jnp.bfloat16
    ref = rope_reference(np.asarray(x, np.float64), pos)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=3e-2, rtol=1e-2)

  def test_inv_freq_formula(self):
    inv = rope.rope_inv_freq(64, base=500000.0)
    assert inv.dtype == jnp.float32
    np.testing.assert_allclose(inv, 500000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-7)

  def test_rejects_bad_input(self):
    x = _rand(0, (1, 4, 2, 7))
    pos = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="head_dim"):
      rope.apply_rope(x, pos, layout="interleaved")  # odd head_dim
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, N, H\]"):
      rope.apply_rope(x[0], pos, layout="interleaved")
    with pytest.raises(TypeError, match="positions must be an integer or float"):
      rope.apply_rope(_rand(0, (1, 4, 2, 8)), pos.astype(bool), layout="interleaved")
    with pytest.raises(ValueError, match="positions must be >= 0"):
      rope.apply_rope(_rand(0, (1, 4, 2, 8)), pos - 1, layout="interleaved")
    with pytest.raises(ValueError, match="rotary_dim must be even"):
      rope.rope_inv_freq(8, rotary_dim=3)
    with pytest.raises(ValueError, match="base"):
      rope.rope_inv_freq(8, base=-1.0)


# ---------------------------------------------------------------- ALiBi


@pytest.mark.parametrize("n", [8, 16])
def test_slopes_power_of_two_closed_form(n):
  np.testing.assert_allclose(alibi.alibi_slopes(n), [2.0 ** (-8 * k / n) for k in range(1, n + 1)], rtol=1e-7)


# Other head counts against the paper's code and BLOOM: tests/alibi_test.py.
def test_slopes_six_heads_by_hand():
  # 4 heads: 2^-2, 2^-4, 2^-6, 2^-8; then the odd-indexed slopes of 8 heads: 2^-1, 2^-3.
  np.testing.assert_array_equal(alibi.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


class AlibiBiasTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_bias_is_minus_slope_times_distance(self):
    slopes = alibi.alibi_slopes(4)
    qp = jnp.asarray([[0, 1, 2, 9], [5, 6, 7, 8]], jnp.int32)
    kp = jnp.asarray([[0, 1, 2, 9, 3], [0, 5, 6, 7, 8]], jnp.int32)
    bias = self.variant(alibi.alibi_bias)(slopes, qp, kp)
    chex.assert_shape(bias, (2, 4, 4, 5))
    ref = -np.asarray(slopes, np.float64)[None, :, None, None] * (
      np.asarray(qp)[:, None, :, None] - np.asarray(kp)[:, None, None, :]
    )
    np.testing.assert_allclose(bias, ref, rtol=1e-6)

  def test_rejects_bad_input(self):
    p = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="num_heads"):
      alibi.alibi_slopes(0)
    with pytest.raises(ValueError, match="slopes must be finite and >= 0"):
      alibi.alibi_bias(jnp.asarray([0.5, -1.0]), p, p)
    with pytest.raises(ValueError, match="same batch size"):
      alibi.alibi_bias(alibi.alibi_slopes(2), p, jnp.zeros((2, 3), jnp.int32))


# ---------------------------------------------------------------- RoPE-emulated ALiBi


class EmulationTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_extra_dims_give_minus_n_sin_and_content_is_unchanged(self):
    n_heads, h, ctx = 4, 16, 4096
    slopes = alibi.alibi_slopes_f64(n_heads)
    theta = emulation.emulation_theta(max_phase=0.1, max_len=ctx)
    q, k = _rand(6, (1, 5, n_heads, h)), _rand(7, (1, 5, n_heads, h))
    qp = jnp.asarray([[4095, 3000, 1000, 17, 0]], jnp.int32)
    kp = jnp.asarray([[0, 1, 500, 17, 4000]], jnp.int32)
    qa, ka = self.variant(lambda *a: emulation.apply_rope_alibi(*a, slopes=slopes, theta=theta))(q, k, qp, kp)
    chex.assert_shape((qa, ka), [(1, 5, n_heads, h + 2), (1, 5, n_heads, h + 2)])
    assert qa.dtype == ka.dtype == jnp.float32
    # content dims pass through exactly (frequency 0)
    np.testing.assert_array_equal(qa[..., :h], q)
    np.testing.assert_array_equal(ka[..., :h], k)
    extra = np.einsum(
      "BTNH,BSNH->BNTS", np.asarray(qa[..., h:], np.float64), np.asarray(ka[..., h:], np.float64)
    )
    d = np.asarray(qp, np.float64)[:, None, :, None] - np.asarray(kp, np.float64)[:, None, None, :]
    big_n = slopes * math.sqrt(h) / theta
    ref = -big_n[None, :, None, None] * np.sin(d * theta)
    # float32 rounding of N sin(i theta) terms of size up to N: eps * N.
    np.testing.assert_allclose(extra, ref, atol=4 * 6e-8 * big_n.max())
    # after 1/sqrt(H), within the small-angle bound of -m d: |m d - N/sqrt(H) sin(d theta)| <= m |d| (d theta)^2 / 6
    term = extra / math.sqrt(h)
    alibi_ref = -slopes[None, :, None, None] * d
    bound = slopes[None, :, None, None] * np.abs(d) * (
      d * theta
    ) ** 2 / 6 + 4 * 6e-8 * big_n.max() / math.sqrt(h)
    assert np.all(np.abs(term - alibi_ref) <= bound)

  @chex.variants(with_jit=True, without_jit=True)
  def test_equals_rope_machinery_on_appended_fixed_dims(self):
    """apply_rope_alibi is RoPE with frequency 0 on the content and theta on the (-N, 0)/(0, 1) pair."""
    n_heads, h = 3, 8
    slopes = alibi.alibi_slopes_f64(n_heads)
    theta = emulation.emulation_theta(max_phase=0.3, max_len=512)
    q, k = _rand(11, (2, 4, n_heads, h)), _rand(12, (2, 6, n_heads, h))
    qp = jnp.asarray(np.random.default_rng(3).integers(0, 512, (2, 4)), jnp.int32)
    kp = jnp.asarray(np.random.default_rng(4).integers(0, 512, (2, 6)), jnp.int32)
    qa, ka = self.variant(lambda *a: emulation.apply_rope_alibi(*a, slopes=slopes, theta=theta))(q, k, qp, kp)
    big_n = jnp.asarray(slopes * math.sqrt(h) / theta, jnp.float32)
    q_fixed = jnp.broadcast_to(jnp.stack([-big_n, jnp.zeros_like(big_n)], -1), (2, 4, n_heads, 2))
    k_fixed = jnp.broadcast_to(jnp.asarray([0.0, 1.0]), (2, 6, n_heads, 2))
    inv_freq = jnp.asarray([0.0] * (h // 2) + [theta], jnp.float32)
    q_rope = rope.apply_rope(jnp.concatenate([q, q_fixed], -1), qp, inv_freq=inv_freq, layout="interleaved")
    k_rope = rope.apply_rope(jnp.concatenate([k, k_fixed], -1), kp, inv_freq=inv_freq, layout="interleaved")
    np.testing.assert_allclose(qa, q_rope, rtol=1e-6, atol=1e-6 * float(big_n.max()))
    np.testing.assert_allclose(ka, k_rope, rtol=1e-6, atol=1e-6)

  def test_published_example_amplitude(self):
    theta = emulation.emulation_theta(max_phase=0.1, max_len=65536)
    np.testing.assert_allclose(theta, 0.1 / 65536)
    big_n = emulation.emulation_amplitudes([2**-0.5], head_dim=64, theta=theta)
    np.testing.assert_allclose(big_n, 2**-0.5 * 8 * 65536 / 0.1)  # ~3.707e6


@pytest.mark.parametrize("phase", [math.pi / 2, 2.0, 0.0, -0.1])
def test_emulation_rejects_max_phase_outside_range(phase):
  with pytest.raises(ValueError, match=r"max_phase must be in \(0, pi/2\)"):
    emulation.emulation_theta(max_phase=phase, max_len=1024)


# ---------------------------------------------------------------- attention


class AttentionTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_numpy_softmax_with_bias_and_causal_mask(self):
    b, t, n, kv, h = 2, 5, 4, 2, 8
    q, k, v = _rand(8, (b, t, n, h)), _rand(9, (b, t, kv, h)), _rand(10, (b, t, kv, h))
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    bias = alibi.alibi_bias(alibi.alibi_slopes(n), idx, idx)
    mask = jaxpe.dense_attention_mask(idx, idx)
    out = self.variant(
      lambda q, k, v: jaxpe.dot_product_attention(q, k, v, scale=h**-0.5, bias=bias, mask=mask)
    )(q, k, v)
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    kn, vn = np.repeat(kn, n // kv, axis=2), np.repeat(vn, n // kv, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", qn, kn) * h**-0.5 + np.asarray(bias, np.float64)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("bnts,bsnh->btnh", w, vn), atol=1e-5)

  def test_rejects_mismatched_shapes(self):
    q = _rand(0, (1, 3, 4, 8))
    with pytest.raises(ValueError, match="multiple of kv heads"):
      jaxpe.dot_product_attention(q, _rand(0, (1, 3, 3, 8)), _rand(0, (1, 3, 3, 8)), scale=1.0)
    with pytest.raises(ValueError, match="bias must broadcast"):
      jaxpe.dot_product_attention(q, q, q, scale=1.0, bias=jnp.zeros((1, 4, 3, 2)))


def test_bad_inputs_raise_named_errors_not_nans():
  x = _rand(0, (1, 3, 2, 8))
  pos = jnp.zeros((1, 3), jnp.int32)
  # A list works (partial rotary).
  out = rope.apply_rope(x, pos + 2, inv_freq=[1.0, 0.5], layout="interleaved")
  np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
  with pytest.raises(ValueError, match="inv_freq must be finite"):
    rope.apply_rope(x, pos, inv_freq=jnp.asarray([1.0, jnp.nan]), layout="interleaved")
  with pytest.raises(ValueError, match="scale must be a finite number > 0"):
    jaxpe.dot_product_attention(x, x, x, scale=float("nan"))
  with pytest.raises(TypeError, match="mask must be a bool array"):
    jaxpe.dot_product_attention(x, x, x, scale=1.0, mask=jnp.full((1, 1, 3, 3), 0.5))
  idx = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="same batch size"):
    jaxpe.dense_attention_mask(idx, jnp.zeros((3, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"k_valid must have shape \[1, 3\]"):
    jaxpe.dense_attention_mask(idx, idx, k_valid=jnp.ones((1, 4), bool))
  with pytest.raises(TypeError, match="q_index must be an integer"):
    jaxpe.dense_attention_mask(idx.astype(jnp.float32), idx)
  # any nonzero mask value is a real token
  np.testing.assert_array_equal(jaxpe.positions_from_mask(jnp.asarray([[0, 2, 1]])), [[0, 0, 1]])
  # zero slopes (ALiBi on a subset of heads) are accepted by the distance form
  bias = alibi.alibi_bias(jnp.asarray([0.5, 0.0]), jnp.asarray([[3]]), jnp.asarray([[0, 1, 2, 3]]))
  np.testing.assert_array_equal(bias[0, :, 0], [[-1.5, -1.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_emulation_rejects_traced_parameters_and_phases_past_pi_over_2():
  q = _rand(0, (1, 4, 2, 8))
  pos = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
  slopes = alibi.alibi_slopes_f64(2)
  with pytest.raises(ValueError, match="theta too large for these positions"):
    emulation.apply_rope_alibi(q, q, pos * 1000, pos * 1000, slopes=slopes, theta=1e-3)
  with pytest.raises(ValueError, match="theta must be concrete"):
    jax.jit(lambda t: emulation.apply_rope_alibi(q, q, pos, pos, slopes=slopes, theta=t))(1e-3)
