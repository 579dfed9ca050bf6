"""RoPE-emulated ALiBi (issue 4): weights and bounds, the solver, higher order, the augmented form,
the precision policy (jaxpe.emulation.bounds, solver, ops).

References are independent of the code under test: exact ALiBi ``-m (i - j)`` in numpy float64, the
Taylor conditions on the weights and ``sin`` in float64. The base-constrained mode is in
base_constrained_test.py, attention with the emulation in tests/attention/emulated_test.py.
"""

import math

import chex
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jaxpe import emulation


def paper_slopes(n):
  """ALiBi slopes for a power-of-two head count, 2^(-8h/n), written out."""
  return np.asarray([2.0 ** (-8.0 * h / n) for h in range(1, n + 1)])


def scores(qa, ka, head_dim):
  """float32 ``q.k / sqrt(H)`` as the attention path computes it: ``[B, N, T, S]`` float64 copy."""
  if ka.shape[2] != qa.shape[2]:
    ka = jnp.repeat(ka, qa.shape[2] // ka.shape[2], axis=2)
  out = jnp.einsum("BTNH,BSNH->BNTS", qa, ka, preferred_element_type=jnp.float32)
  return np.asarray(out * jnp.float32(1.0 / math.sqrt(head_dim)), np.float64)


def normal(seed, shape):
  """Standard-normal float32 test data from numpy's generator (a jax.random draw compiles once per
  shape: 1-3 s of CPU each)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def alibi_reference(slopes, qpos, kpos):
  """Exact ALiBi ``-m (i - j)`` in float64, ``[B, N, T, S]``, and the distances ``[B, 1, T, S]``."""
  d = np.asarray(qpos, np.float64)[:, None, :, None] - np.asarray(kpos, np.float64)[:, None, None, :]
  return -np.asarray(slopes, np.float64)[None, :, None, None] * d, d


def zeros_qk(n, h, t, s, kv=1, dtype=jnp.float32):
  return jnp.zeros((1, t, n, h), dtype), jnp.zeros((1, s, kv, h), dtype)


def sample_queries(length, count):
  return np.unique(np.concatenate([np.linspace(0, length - 1, count).astype(np.int64), [length - 1]]))


def bias_deviation(slopes, h, length, *, theta, order, out_dtype=jnp.float32, nq=8, augmented=False):
  """Measured |emulated bias - ALiBi| for queries spread over the context and every key j <= i."""
  qpos = sample_queries(length, nq)
  kpos = np.arange(length)
  q, k = zeros_qk(len(slopes), h, len(qpos), length)
  qp, kp = jnp.asarray(qpos[None], jnp.int32), jnp.asarray(kpos[None], jnp.int32)
  if augmented:
    qa, ka = emulation.apply_augmented_alibi(q, k, qp, kp, slopes=slopes, out_dtype=out_dtype)
  else:
    qa, ka = emulation.apply_rope_alibi(
      q, k, qp, kp, slopes=slopes, theta=theta, order=order, out_dtype=out_dtype
    )
  ref, d = alibi_reference(slopes, qpos[None], kpos[None])
  dev = np.where(d >= 0, np.abs(scores(qa, ka, h) - ref), 0.0)[0]  # [N, T, S]
  return dev, np.maximum(d[0, 0], 0.0), qpos


# ---------------------------------------------------------------- theory


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_weights_cancel_the_taylor_terms(order):
  w = emulation.emulation_weights(order)
  r = np.arange(1, order + 1, dtype=np.float64)
  np.testing.assert_allclose(np.sum(w * r), 1.0, rtol=1e-13)  # slope 1 at x = 0
  for p in range(1, order):  # x^3 .. x^(2k-1) cancel
    np.testing.assert_allclose(
      np.sum(w * r ** (2 * p + 1)), 0.0, atol=1e-10 * np.sum(np.abs(w) * r ** (2 * p + 1))
    )
  assert abs(np.sum(w * r ** (2 * order + 1))) > 1e-3  # and the next one does not


def test_published_weights():
  np.testing.assert_allclose(emulation.emulation_weights(1), [1.0])
  np.testing.assert_allclose(emulation.emulation_weights(2), [8 / 6, -1 / 6], rtol=1e-15)
  # (8 sin x - sin 2x)/6 = x - x^5/30 + ...; relative error 3.3e-6 at x = 0.1 (DESIGN.md section 3)
  x = 0.1
  rel = (x - (8 * math.sin(x) - math.sin(2 * x)) / 6) / x
  np.testing.assert_allclose(emulation.truncation_error_bound(x, order=2) / x, rel, rtol=5e-3)
  np.testing.assert_allclose(rel, 3.3e-6, rtol=0.02)


@pytest.mark.parametrize("order", [1, 2, 3])
def test_truncation_bound_holds_and_is_tight(order):
  w = emulation.emulation_weights(order)
  r = np.arange(1, order + 1)
  x = np.linspace(0.05, 1.5, 300)  # float64 cancellation is harmless here
  exact = np.abs(x - np.sum(w[:, None] * np.sin(r[:, None] * x[None, :]), axis=0))
  bound = emulation.truncation_error_bound(x, order=order)
  assert np.all(exact <= bound)
  # tight where the leading term dominates: within 1% at x = 0.05
  np.testing.assert_allclose(bound[0], exact[0], rtol=1e-2)
  coefficient = {1: 1 / 6, 2: 1 / 30, 3: 1 / 140}[order]
  np.testing.assert_allclose(emulation.leading_error_coefficient(order), coefficient, rtol=1e-12)


def test_design_reference_numbers():
  # k = 1: relative bias error (d theta)^2/6 = 1.7e-3 at phase 0.1, 3.9e-5 at d = 10000, 3.9e-7 at 1000
  plan = emulation.solve_emulation([2**-0.5], head_dim=64, max_len=65536, max_phase=0.1)
  np.testing.assert_allclose(plan.theta[0], 0.1 / 65536, rtol=1e-7)
  np.testing.assert_allclose(plan.amplitudes[0], 3.707e6, rtol=1e-3)
  for dist, rel in [(65535, 1.7e-3), (10000, 3.9e-5), (1000, 3.9e-7)]:
    trunc = plan.bound_at(dist, dist) - plan.bound_at(0, dist)  # rounding part depends on i, j only
    np.testing.assert_allclose(trunc[0] / (2**-0.5 * dist), rel, rtol=0.05)


# ---------------------------------------------------------------- solver: measured <= predicted


@settings(max_examples=15, deadline=None)
@given(
  num_heads=st.integers(1, 6),
  log_slopes=st.lists(st.floats(-10.0, 0.5), min_size=6, max_size=6),
  length=st.integers(2, 4000),
  order=st.integers(1, 3),
  max_phase=st.floats(0.01, 1.4),
  head_dim=st.sampled_from([2, 8, 64]),
)
def test_measured_deviation_never_exceeds_the_predicted_bound(
  num_heads, log_slopes, length, order, max_phase, head_dim
):
  slopes = np.exp2(np.asarray(log_slopes[:num_heads]))
  plan = emulation.solve_emulation(
    slopes, head_dim=head_dim, max_len=length, order=order, max_phase=max_phase
  )
  dev, d, qpos = bias_deviation(slopes, head_dim, length, theta=plan.theta, order=order)
  pointwise = plan.bound_at(d, qpos[:, None])  # [N, T, S]
  assert np.all(dev <= pointwise), float(np.max(dev - pointwise))
  assert np.all(dev.max(axis=(1, 2)) <= plan.bound)


@settings(max_examples=6, deadline=None)
@given(
  num_heads=st.integers(1, 8),
  length=st.integers(64, 4096),
  order=st.integers(1, 3),
  log_target=st.floats(-2.5, 1.0),
)
def test_target_error_mode_meets_the_target(num_heads, length, order, log_target):
  target = 10.0**log_target
  slopes = paper_slopes(8)[:num_heads]
  plan = emulation.solve_emulation(slopes, head_dim=16, max_len=length, order=order, target_error=target)
  assert np.all(plan.bound <= target * (1 + 1e-9))
  assert np.all(plan.max_phase <= 1.0 + 1e-6)
  dev, _, _ = bias_deviation(slopes, 16, length, theta=plan.theta, order=order, nq=4)
  assert dev.max() <= target


def test_per_head_theta_keys_repeat_per_group():
  slopes = paper_slopes(4)
  plan = emulation.solve_emulation(
    slopes, head_dim=8, max_len=512, order=2, target_error=0.01, shared_theta=False
  )
  assert len(set(plan.theta.tolist())) == 4  # smaller slope, larger theta allowed
  assert np.all(np.diff(plan.theta) > 0)
  q = jnp.zeros((1, 3, 4, 8))
  k = jnp.zeros((1, 512, 2, 8))
  qpos = jnp.asarray([[0, 300, 511]], jnp.int32)
  kpos = jnp.arange(512, dtype=jnp.int32)[None]
  qa, ka = emulation.apply_rope_alibi(q, k, qpos, kpos, slopes=slopes, theta=plan.theta, order=2)
  chex.assert_shape((qa, ka), [(1, 3, 4, 12), (1, 512, 4, 12)])
  ref, d = alibi_reference(slopes, qpos, kpos)
  dev = np.where(d >= 0, np.abs(scores(qa, ka, 8) - ref), 0)
  assert dev.max() <= 0.01


# ---------------------------------------------------------------- higher order


def test_order_two_is_100x_closer_than_order_one_at_phase_0_1():
  slopes, h, length = paper_slopes(8), 64, 4096
  worst = {}
  for order in (1, 2):
    plan = emulation.solve_emulation(slopes, head_dim=h, max_len=length, order=order, max_phase=0.1)
    dev, _, _ = bias_deviation(slopes, h, length, theta=plan.theta, order=order, nq=4)
    worst[order] = dev.max(axis=(1, 2))  # per head
  assert np.all(worst[1] >= 100 * worst[2]), worst[1] / worst[2]
  # and in exact arithmetic the ratio is (x^3/6)/(x^5/30) = 5/x^2 = 500 at x = 0.1
  x = 0.1 * (length - 1) / length
  exact1 = x - math.sin(x)
  exact2 = x - (8 * math.sin(x) - math.sin(2 * x)) / 6
  assert exact1 / exact2 > 490


class OpsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_higher_order_pairs_rotate_at_r_theta(self):
    n, h, order = 2, 4, 3
    slopes, theta = paper_slopes(2), 1e-3
    q = normal(0, (2, 3, n, h))
    k = normal(1, (2, 5, n, h))
    qp = jnp.asarray([[0, 7, 900], [3, 3, 3]], jnp.int32)
    kp = jnp.asarray([[0, 1, 2, 800, 900], [0, 1, 2, 3, 4]], jnp.int32)
    fn = self.variant(lambda *a: emulation.apply_rope_alibi(*a, slopes=slopes, theta=theta, order=order))
    qa, ka = fn(q, k, qp, kp)
    chex.assert_shape((qa, ka), [(2, 3, n, h + 2 * order), (2, 5, n, h + 2 * order)])
    np.testing.assert_array_equal(qa[..., :h], q)
    np.testing.assert_array_equal(ka[..., :h], k)
    w = np.asarray([1.5, -0.3, 1 / 30])  # written out (k = 3)
    big_n = slopes * math.sqrt(h) / theta
    for r in range(order):
      ph_q = np.asarray(qp, np.float64)[:, :, None] * (r + 1) * theta
      ph_k = np.asarray(kp, np.float64)[:, :, None] * (r + 1) * theta
      rot_q = np.stack([np.cos(ph_q), np.sin(ph_q)], -1)  # [B, T, 1, 2]
      want_q = -w[r] * big_n[None, None, :, None] * rot_q  # [B, T, N, 2]
      np.testing.assert_allclose(
        qa[..., h + 2 * r : h + 2 * r + 2], want_q, rtol=1e-5, atol=1e-6 * big_n.max()
      )
      want_k = np.stack([-np.sin(ph_k), np.cos(ph_k)], -1)
      np.testing.assert_allclose(
        ka[..., h + 2 * r : h + 2 * r + 2], np.broadcast_to(want_k, (2, 5, n, 2)), atol=1e-6
      )

  @chex.variants(with_jit=True, without_jit=True)
  def test_padding_keeps_scores_and_attention(self):
    n, kv, h, t = 4, 2, 6, 12
    slopes = paper_slopes(4)
    q = normal(2, (2, t, n, h))
    k = normal(3, (2, t, kv, h))
    v = normal(4, (2, t, kv, h))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 100, (2, t))
    theta = emulation.emulation_theta(max_phase=0.1, max_len=256)
    qa, ka = emulation.apply_rope_alibi(q, k, pos, pos, slopes=slopes, theta=theta, order=2)
    fn = self.variant(
      lambda q, k: emulation.apply_rope_alibi(
        q, k, pos, pos, slopes=slopes, theta=theta, order=2, pad_multiple=8
      )
    )
    qp8, kp8 = fn(q, k)
    chex.assert_shape((qp8, kp8), [(2, t, n, 16), (2, t, kv, 16)])
    np.testing.assert_array_equal(qp8[..., : h + 4], qa)
    np.testing.assert_array_equal(qp8[..., h + 4 :], 0.0)
    np.testing.assert_array_equal(emulation.pad_head_dim(v, multiple=8)[..., h:], 0.0)
    assert emulation.pad_head_dim(qa, multiple=5).shape[-1] == 10


# ---------------------------------------------------------------- exact augmented form


def test_augmented_form_is_exact_up_to_rounding_and_keeps_content():
  slopes, h = paper_slopes(4), 8
  q = normal(5, (1, 4, 4, h))
  k = normal(6, (1, 6, 2, h))
  qp = jnp.asarray([[5, 1000, 40000, 65535]], jnp.int32)
  kp = jnp.asarray([[0, 5, 999, 39000, 65000, 65535]], jnp.int32)
  qa, ka = emulation.apply_augmented_alibi(q, k, qp, kp, slopes=slopes)
  chex.assert_shape((qa, ka), [(1, 4, 4, h + 2), (1, 6, 2, h + 2)])
  np.testing.assert_array_equal(qa[..., :h], q)
  np.testing.assert_array_equal(ka[..., :h], k)
  content = np.einsum(
    "BTNH,BSNH->BNTS", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, axis=2)
  ) / math.sqrt(h)
  ref, d = alibi_reference(slopes, qp, kp)
  dev = np.abs(scores(qa, ka, h) - (content + ref))
  i = np.asarray(qp, np.float64)[:, None, :, None]
  bound = emulation.emulation_error_bound(
    slopes, theta=1.0, distance=np.abs(d[0, 0]), position=np.maximum(i, i - d)[0, 0], order=None
  )
  assert np.all(dev[0] <= bound + 1e-5), np.max(dev[0] - bound)


def test_augmented_vs_rotated_precision_at_long_context():
  # No truncation error, and the rounding error grows with position like the rotated form's.
  # Slopes 2^-0.5 .. 2^-3.5 (16-head slopes): with power-of-two slopes and H = 64, m sqrt(H) is a
  # power of two and the augmented products are exact in float32.
  slopes, h, length = paper_slopes(16)[[0, 2, 4, 6]], 64, 65536
  dev_aug, d, qpos = bias_deviation(slopes, h, length, theta=None, order=None, nq=3, augmented=True)
  plan = emulation.solve_emulation(slopes, head_dim=h, max_len=length, order=3, max_phase=0.1)
  dev_rot, _, _ = bias_deviation(slopes, h, length, theta=plan.theta, order=3, nq=3)
  bound = emulation.emulation_error_bound(slopes, theta=1.0, distance=d, position=qpos[:, None], order=None)
  assert np.all(dev_aug <= bound)
  assert dev_aug.max() < dev_rot.max()
  assert 1e-4 < dev_aug.max() < 0.1  # float32 rounding at position 65535: ~4e-3 logits


# ---------------------------------------------------------------- precision policy


def test_policy_float32_dims_for_bf16_inputs_and_bf16_would_lose_logits():
  slopes, h, length = paper_slopes(4), 64, 4096
  theta = emulation.emulation_theta(max_phase=0.1, max_len=length)
  q, k = zeros_qk(4, h, 2, 2, dtype=jnp.bfloat16)
  pos = jnp.asarray([[0, 1]], jnp.int32)
  qa, ka = emulation.apply_rope_alibi(q, k, pos, pos, slopes=slopes, theta=theta)
  assert qa.dtype == ka.dtype == jnp.float32
  dev32, d, qpos = bias_deviation(slopes, h, length, theta=theta, order=2, nq=4)
  dev16, _, _ = bias_deviation(slopes, h, length, theta=theta, order=2, nq=4, out_dtype=jnp.bfloat16)
  assert dev16.max() > 1.0  # whole logits lost when the dims are carried in bf16
  assert dev16.max() > 1000 * dev32.max()
  bf16_bound = emulation.emulation_error_bound(
    slopes, theta=theta, distance=d, position=qpos[:, None], order=2, dtype="bfloat16"
  )
  assert np.all(dev16 <= bf16_bound)


def test_float16_is_refused_where_n_overflows():
  slopes = paper_slopes(4)
  with pytest.raises(ValueError, match="not representable in float16"):
    emulation.solve_emulation(slopes, head_dim=64, max_len=65536, max_phase=0.1, dtype="float16")
  q, k = zeros_qk(4, 64, 1, 1, dtype=jnp.float16)
  pos = jnp.zeros((1, 1), jnp.int32)
  with pytest.raises(ValueError, match="not representable in float16"):
    emulation.apply_rope_alibi(q, k, pos, pos, slopes=slopes, theta=1e-6, out_dtype=jnp.float16)
  # a large theta keeps N = m sqrt(H) / theta = 0.5 * 8 / 0.01 = 400 in range
  plan = emulation.solve_emulation(slopes, head_dim=64, max_len=16, max_phase=0.16, dtype="float16")
  assert plan.amplitudes.max() < 65504


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(max_phase=math.pi / 2), r"max_phase must be in \(0, pi/2\)"),
    (dict(max_phase=2.0), r"choose a smaller max_phase"),
    (dict(slopes=[0.5, 0.0]), "slopes must be finite and > 0"),
    (dict(slopes=[-0.5]), "slopes must be finite and > 0"),
    (dict(target_error=1e-9, max_len=65536), "below the float32 rounding floor"),
    (dict(max_phase=0.1, target_error=1.0), "exactly one of max_phase"),
    (dict(order=0), "order must be a positive integer"),
    (dict(order=9), "order must be in 1..8"),
    (dict(max_len=2**24 + 1), "max_len must be <= 2\\^24"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(slopes=None), "exactly one of slopes"),
  ],
)
def test_solver_rejects_what_cannot_work(kwargs, match):
  args = dict(slopes=[0.5, 0.25], head_dim=64, max_len=2048, max_phase=0.1)
  args.update(kwargs)
  if "target_error" in kwargs and "max_phase" not in kwargs:
    args.pop("max_phase")
  with pytest.raises(ValueError, match=match):
    emulation.solve_emulation(**args)


def test_op_rejects_bad_input():
  q, k = zeros_qk(2, 8, 1, 1)
  pos = jnp.zeros((1, 1), jnp.int32)
  with pytest.raises(ValueError, match="one entry per head"):
    emulation.apply_rope_alibi(q, k, pos, pos, slopes=[0.5], theta=1e-3)
  with pytest.raises(ValueError, match="theta must be"):
    emulation.apply_rope_alibi(q, k, pos, pos, slopes=[0.5, 0.25], theta=-1.0)
  with pytest.raises(TypeError, match="integer array of token indices"):
    emulation.apply_rope_alibi(q, k, pos.astype(jnp.float32), pos, slopes=[0.5, 0.25], theta=1e-3)
  with pytest.raises(ValueError, match="< 2\\^24"):
    emulation.apply_rope_alibi(q, k, pos + 2**24, pos, slopes=[0.5, 0.25], theta=1e-3)
  with pytest.raises(ValueError, match="multiple must be a positive integer"):
    emulation.pad_head_dim(q, multiple=0)
  with pytest.raises(ValueError, match="rotary_dim must be even"):
    emulation.solve_base_constrained(
      num_heads=2, head_dim=8, rotary_dim=7, max_len=64, max_phase=0.1, layout="interleaved"
    )
  with pytest.raises(ValueError, match="raise the base"):
    emulation.solve_base_constrained(
      num_heads=2, head_dim=8, rotary_dim=4, base=10.0, max_len=4096, max_phase=0.1, layout="interleaved"
    )
