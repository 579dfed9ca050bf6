"""RoPE (both layouts, partial rotary, attention factor, mRoPE) against independent float64 numpy
references: Meta's complex formula, HF's rotate-half formula. Exact phases: exact_phases_test.py;
xPos: xpos_test.py; sinusoids: sinusoidal_test.py."""

import re

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpe.ops import rope, rope_scaling

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
  """Standard-normal test data from numpy's generator (a jax.random draw compiles once per shape: 1-3 s
  of CPU each, the largest cost of these small tests)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype))


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
    out = self.variant(lambda x, p: rope.apply_rope(x, p, inv_freq=inv, layout="half", attention_factor=att))(
      x, pos
    )
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
  with pytest.raises(ValueError, match="attention_factor must broadcast"):
    rope.apply_rope(x, p, attention_factor=jnp.ones((1, 4, 2, 3), jnp.float32), layout="interleaved")
  with pytest.raises(ValueError, match="attention_factor must be finite"):
    rope.apply_rope(x, p, attention_factor=float("nan"), layout="interleaved")
  with pytest.raises(ValueError, match="inv_freq must have shape"):
    rope.rope_phases(p, jnp.ones((2, 2), jnp.float32))
  with pytest.raises(TypeError, match="positions must be an integer"):
    rope.rope_phases(p.astype(jnp.float32), jnp.ones((2,), jnp.float32))
  with pytest.raises(TypeError, match="inv_freq must be a float"):
    rope.apply_rope(x, p, inv_freq=jnp.ones((4,), jnp.int32), layout="interleaved")


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
