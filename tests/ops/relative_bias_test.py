"""T5, Kerple and FIRE biases against float64 numpy transcriptions of their papers' formulas and
HF transformers' T5 bucket function; jitted, with gradients against finite differences / the
references' analytic gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.ops import fire, relative_bias

RNG = np.random.default_rng(0)
Q_POS = np.array([[0, 1, 2, 3, 4, 9, 40, 300], [5, 6, 7, 8, 200, 201, 1000, 4000]], np.int32)
K_POS = np.array(
  [[0, 1, 2, 3, 4, 5, 9, 40, 130, 299, 300], [0, 5, 6, 7, 8, 150, 200, 201, 700, 1000, 3999]], np.int32
)


def t5_bucket_np(rel, bidirectional, num_buckets, max_distance):
  """Mesh TensorFlow / HF's bucket rule written out in numpy (float32 log as theirs)."""
  rel = np.asarray(rel, np.int64)
  out = np.zeros(rel.shape, np.int64)
  n = num_buckets
  if bidirectional:
    n //= 2
    out += (rel > 0) * n
    rel = np.abs(rel)
  else:
    rel = -np.minimum(rel, 0)
  max_exact = n // 2
  with np.errstate(divide="ignore", invalid="ignore"):
    large = max_exact + (
      np.log(rel.astype(np.float32) / np.float32(max_exact))
      / np.float32(math.log(max_distance / max_exact))
      * np.float32(n - max_exact)
    ).astype(np.int64)
  return out + np.where(rel < max_exact, rel, np.minimum(large, n - 1))


@pytest.mark.parametrize(
  "bidirectional, num_buckets, max_distance",
  [(True, 32, 128), (False, 32, 128), (True, 16, 40), (False, 64, 256), (False, 2, 8)],
)
def test_t5_buckets_equal_transformers(bidirectional, num_buckets, max_distance):
  rel = np.arange(-5000, 5001, dtype=np.int32)
  fn = jax.jit(
    lambda r: relative_bias.t5_relative_position_bucket(
      r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
  )
  got = np.asarray(fn(rel))
  import torch  # here, not at collection
  from transformers.models.t5.modeling_t5 import T5Attention

  hf = T5Attention._relative_position_bucket(
    torch.tensor(rel, dtype=torch.long),
    bidirectional=bidirectional,
    num_buckets=num_buckets,
    max_distance=max_distance,
  ).numpy()
  np.testing.assert_array_equal(got, hf)
  np.testing.assert_array_equal(got, t5_bucket_np(rel, bidirectional, num_buckets, max_distance))
  assert got.min() >= 0 and got.max() == num_buckets - 1  # every bucket range reached


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_and_gradient(bidirectional):
  table = RNG.normal(size=(32, 3)).astype(np.float32)
  fn = jax.jit(
    lambda t: relative_bias.t5_bias(t, Q_POS, K_POS, bidirectional=bidirectional, max_distance=128)
  )
  got = np.asarray(fn(table))
  rel = K_POS[:, None, :] - Q_POS[:, :, None]
  buckets = t5_bucket_np(rel, bidirectional, 32, 128)
  ref = np.moveaxis(table.astype(np.float64)[buckets], 3, 1)
  assert got.shape == (2, 3, 8, 11) and got.dtype == np.float32
  np.testing.assert_array_equal(got, ref)
  # d(sum(w * bias)) / d table[b, h] = sum of w over the pairs in bucket b of head h
  w = RNG.normal(size=got.shape).astype(np.float32)
  grad = np.asarray(jax.jit(jax.grad(lambda t: jnp.sum(fn(t) * w)))(table))
  ref_grad = np.zeros((32, 3))
  for h in range(3):
    np.add.at(ref_grad[:, h], buckets, w[:, h].astype(np.float64))
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5)


def kerple_np(kind, r1, r2, q, k):
  d = np.abs(q[:, :, None].astype(np.float64) - k[:, None, :])[:, None]
  r1, r2 = np.asarray(r1, np.float64)[None, :, None, None], np.asarray(r2, np.float64)[None, :, None, None]
  if kind == "log":
    bias = -r1 * np.log(1 + r2 * d)
    d_r1, d_r2 = -np.log(1 + r2 * d), -r1 * d / (1 + r2 * d)
  else:
    bias = -r1 * d**r2
    d_r1 = -(d**r2)
    d_r2 = -r1 * np.where(d > 0, d**r2 * np.log(np.where(d > 0, d, 1)), 0)
  return bias, d_r1, d_r2


@pytest.mark.parametrize("kind", ["log", "power"])
def test_kerple_against_formula(kind):
  op = relative_bias.kerple_log_bias if kind == "log" else relative_bias.kerple_power_bias
  r1 = np.array([0.01, 0.5, 1.7], np.float32)
  r2 = np.array([0.01, 0.9, 2.0 if kind == "power" else 3.0], np.float32)
  fn = jax.jit(lambda a, b: op(a, b, Q_POS, K_POS))
  got = np.asarray(fn(r1, r2))
  ref, d_r1, d_r2 = kerple_np(kind, r1, r2, Q_POS, K_POS)
  assert got.shape == (2, 3, 8, 11) and got.dtype == np.float32
  np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6)
  assert np.all(got[0, :, 0, 0] == 0)  # distance 0 (row 0: positions 0 and 0)
  w = RNG.normal(size=got.shape)
  g1, g2 = jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b) * w.astype(np.float32)), argnums=(0, 1)))(r1, r2)
  np.testing.assert_allclose(g1, np.sum(d_r1 * w, axis=(0, 2, 3)), rtol=1e-4)
  np.testing.assert_allclose(g2, np.sum(d_r2 * w, axis=(0, 2, 3)), rtol=1e-4)
  assert np.all(np.isfinite(g2))  # no log(0) at distance 0


def test_kerple_errors():
  with pytest.raises(ValueError, match="r2 of Kerple's power bias must be in"):
    relative_bias.kerple_power_bias(np.ones(2, np.float32), np.full(2, 2.5, np.float32), Q_POS, K_POS)
  with pytest.raises(ValueError, match="r1 must be finite and > 0"):
    relative_bias.kerple_log_bias(np.zeros(2, np.float32), np.ones(2, np.float32), Q_POS, K_POS)
  with pytest.raises(ValueError, match="r1 and r2 must both be"):
    relative_bias.kerple_log_bias(np.ones(2, np.float32), np.ones(3, np.float32), Q_POS, K_POS)
  with pytest.raises(TypeError, match="q_positions must be an integer"):
    relative_bias.kerple_log_bias(np.ones(2, np.float32), np.ones(2, np.float32), Q_POS * 1.0, K_POS)
  with pytest.raises(ValueError, match="max_distance must be >"):
    relative_bias.t5_relative_position_bucket(
      np.arange(3), bidirectional=True, num_buckets=32, max_distance=8
    )
  with pytest.raises(ValueError, match="num_buckets must be >= 4"):
    relative_bias.t5_relative_position_bucket(np.arange(3), bidirectional=True, num_buckets=2)


def fire_np(q, k, w1, b1, w2, b2, c, threshold, eps=1e-6):
  """The paper's eq. (3) with its listing's |c x| and eps, float64."""
  q, k = q.astype(np.float64), k.astype(np.float64)
  rel = q[:, :, None] - k[:, None, :]
  norm = np.maximum(q, abs(threshold))[:, :, None]
  x = np.log(np.abs(c * rel) + 1) / (np.log(np.abs(c * norm) + 1) + eps)
  hidden = np.maximum(x[..., None] * w1 + b1, 0)
  return np.moveaxis(hidden @ w2 + b2, 3, 1), x


def test_fire_interpolation_threshold_and_bias():
  w1, b1 = RNG.normal(size=6), RNG.normal(size=6)
  w2, b2 = RNG.normal(size=(6, 3)), RNG.normal(size=3)
  params = dict(w1=w1, b1=b1, w2=w2, b2=b2, c=0.1, threshold=64.0)
  p32 = {name: np.asarray(v, np.float32) for name, v in params.items()}
  fn = jax.jit(lambda p: fire.fire_bias(Q_POS, K_POS, **p))
  got = np.asarray(fn(p32))
  ref, x_ref = fire_np(Q_POS, K_POS, **params)
  assert got.shape == (2, 3, 8, 11)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  x = np.asarray(
    jax.jit(lambda: fire.fire_interpolation(Q_POS, K_POS, c=np.float32(0.1), threshold=np.float32(64)))()
  )
  np.testing.assert_allclose(x, x_ref, rtol=1e-5, atol=1e-6)
  causal = K_POS[:, None, :] <= Q_POS[:, :, None]
  assert np.all(x[causal] >= 0) and np.all(x[causal] <= 1)
  # below the threshold every query shares the denominator psi(L): x depends on i - j only
  np.testing.assert_allclose(x[0, 1, 1], np.log(0.1 * 0 + 1) / (np.log(0.1 * 64 + 1) + 1e-6))
  np.testing.assert_allclose(x[0, 4, 0], np.log(0.1 * 4 + 1) / (np.log(0.1 * 64 + 1) + 1e-6), rtol=1e-6)
  # above it (position 300, 1000, 4000) the query's own position: psi(i - 0) / psi(i) ~ 1
  np.testing.assert_allclose(x[1, 7, 0], np.log(0.1 * 4000 + 1) / (np.log(0.1 * 4000 + 1) + 1e-6), rtol=1e-6)


def test_fire_gradients_match_finite_differences():
  params = {
    "w1": RNG.normal(size=4),
    "b1": RNG.normal(size=4),
    "w2": RNG.normal(size=(4, 2)),
    "b2": RNG.normal(size=2),
    "c": np.float64(0.3),
    "threshold": np.float64(20.0),
  }
  q, k = Q_POS[:, :5], K_POS[:, :6]
  w = RNG.normal(size=(2, 2, 5, 6))

  def loss64(p):
    return float(np.sum(fire_np(q, k, **p)[0] * w))

  grads = jax.jit(jax.grad(lambda p: jnp.sum(fire.fire_bias(q, k, **p) * w.astype(np.float32))))(
    {n: np.asarray(v, np.float32) for n, v in params.items()}
  )
  for name, value in params.items():
    value = np.asarray(value, np.float64)
    fd = np.zeros(value.shape)
    for idx in np.ndindex(value.shape):
      h = 1e-6 * max(1.0, abs(value[idx]))
      up, down = value.copy(), value.copy()
      up[idx] += h
      down[idx] -= h
      fd[idx] = (loss64({**params, name: up}) - loss64({**params, name: down})) / (2 * h)
    np.testing.assert_allclose(grads[name], fd, rtol=2e-3, atol=2e-4, err_msg=name)
