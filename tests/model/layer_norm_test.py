"""jaxpe's LayerNorm (``jaxpe.model.layers.LayerNorm``): its forward and its closed-form gradient (a
custom VJP) against float64 numpy: the LayerNorm formula and central finite differences of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.layers import LayerNorm


def _reference(x, scale, bias, eps):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def _finite_difference_vjp(x, scale, bias, eps, dy, h=1e-6):
  """``(dx, dscale, dbias)`` of ``sum(dy * LN(x))`` by central differences in float64."""
  args = [np.asarray(a, np.float64) for a in (x, scale, bias)]
  grads = []
  for i, a in enumerate(args):
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
      up, down = [b.copy() for b in args], [b.copy() for b in args]
      up[i][idx] += h
      down[i][idx] -= h
      g[idx] = ((_reference(*up, eps) - _reference(*down, eps)) * dy).sum() / (2 * h)
    grads.append(g)
  return grads


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  d = 8
  # rows far from zero mean (the corrected two-pass variance's case) and ordinary rows
  rows = [rng.normal(size=(1, 3, d)), 100.0 + 1e-2 * rng.normal(size=(1, 3, d))]
  x = np.concatenate(rows).astype(np.float32)
  norm = LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=nnx.Rngs(0))
  norm.scale[...] = jnp.asarray(rng.normal(1.0, 0.3, d), jnp.float32)
  norm.bias[...] = jnp.asarray(rng.normal(0.0, 0.3, d), jnp.float32)
  dy = rng.normal(size=x.shape)
  return norm, x, dy


def test_forward_matches_float64(case):
  norm, x, _ = case
  y = np.asarray(norm(jnp.asarray(x)))
  ref = _reference(x, np.asarray(norm.scale[...]), np.asarray(norm.bias[...]), 1e-5)
  np.testing.assert_allclose(y, ref, rtol=0, atol=5e-5)


def test_gradient_matches_finite_differences(case):
  norm, x, dy = case
  graphdef, params = nnx.split(norm)

  @jax.jit
  def vjp(params, x):
    def f(params, x):
      return (nnx.merge(graphdef, params)(x) * jnp.asarray(dy, jnp.float32)).sum()

    return jax.grad(f, argnums=(0, 1))(params, x)

  g_params, g_x = vjp(params, jnp.asarray(x))
  scale, bias = np.asarray(norm.scale[...]), np.asarray(norm.bias[...])
  dx, dscale, dbias = _finite_difference_vjp(x, scale, bias, 1e-5, dy)
  # float32 gradients: relative to the largest entry (the offset rows' dx is ~1e2 times the others')
  for got, want in ((g_x, dx), (g_params["scale"][...], dscale), (g_params["bias"][...], dbias)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_bfloat16_input_gives_a_bfloat16_gradient(case):
  norm, x, _ = case
  xb = jnp.asarray(x[:1], jnp.bfloat16)
  g = jax.grad(lambda x: norm(x).sum())(xb)
  assert g.dtype == jnp.bfloat16 and g.shape == xb.shape
  assert np.all(np.isfinite(np.asarray(g, np.float32)))
