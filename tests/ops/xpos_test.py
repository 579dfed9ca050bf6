"""xPos (jaxpe.ops.xpos) against torchscale's XPOS in float64: scales, distance decay, far
positions with an offset, the window refused (eager) or NaN (under jit)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxpe.ops import xpos


def _rand(seed, shape, dtype=jnp.float32):
  """Standard-normal test data from numpy's generator (a jax.random draw compiles once per shape: 1-3 s
  of CPU each, the largest cost of these small tests)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype))


def _positions(seed, shape, high):
  return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)


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


def test_xpos_phases_are_exact_near_2_pow_30():
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
