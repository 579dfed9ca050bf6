"""jaxpe's exact GELU (``jaxpe.model.layers.gelu``, a custom JVP) against float64: the formula
``x Phi(x)`` (math.erf), central finite differences of it and its closed-form second derivative,
under jit, across the range where GELU bends and in its tails."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.model.layers import gelu


def _reference(x: np.ndarray) -> np.ndarray:
  erf = np.vectorize(math.erf)
  return x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))


@pytest.fixture(scope="module")
def points():
  return np.concatenate([np.linspace(-12.0, 12.0, 2401), [-0.0, 1e-30, -1e-30, 40.0, -40.0]]).astype(
    np.float32
  )


def test_value_matches_float64_formula(points):
  got = np.asarray(jax.jit(gelu)(jnp.asarray(points)), np.float64)
  want = _reference(points.astype(np.float64))
  # float32 rounding of values up to |x| = 40, and the erf form's ~1e-7 |x| below zero (as PyTorch's)
  np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7 * np.abs(points).max())
  small = np.abs(points) <= 3
  np.testing.assert_allclose(got[small], want[small], rtol=1e-6, atol=3e-7)


def test_gradient_matches_float64_finite_differences(points):
  x64 = points.astype(np.float64)
  h = 1e-6
  want = (_reference(x64 + h) - _reference(x64 - h)) / (2 * h)
  got = np.asarray(jax.jit(jax.vmap(jax.grad(gelu)))(jnp.asarray(points)), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # forward mode (a custom_jvp): the same derivative
  ones = jnp.ones_like(jnp.asarray(points))
  tangent = jax.jit(lambda x: jax.jvp(gelu, (x,), (ones,))[1])(jnp.asarray(points))
  np.testing.assert_allclose(np.asarray(tangent, np.float64), want, rtol=1e-5, atol=1e-6)


def test_second_derivative_matches_closed_form():
  x = np.linspace(-6.0, 6.0, 241)
  want = (2.0 - x**2) * np.exp(-0.5 * x**2) / np.sqrt(2.0 * np.pi)  # d^2/dx^2 of x Phi(x)
  second = jax.jit(jax.vmap(jax.grad(jax.grad(gelu))))(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(np.asarray(second, np.float64), want, rtol=1e-4, atol=1e-6)


def test_same_function_as_jax_nn_gelu_and_keeps_dtype():
  x = jnp.linspace(-6.0, 6.0, 1001, dtype=jnp.float32)
  np.testing.assert_allclose(gelu(x), jax.nn.gelu(x, approximate=False), rtol=1e-6, atol=1e-6)
  y = gelu(x.astype(jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  assert jax.grad(lambda v: gelu(v).sum())(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
