"""Exact RoPE phases (jaxpe.ops.exact_phases): cos/sin of p * theta against the phase reduced
in exact rational arithmetic, relative invariance at any shift below 2^31, and the custom JVP's
first and second derivatives in the frequencies and float positions."""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.ops import rope


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


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
