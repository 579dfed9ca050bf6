"""Second derivatives for the fused kernels: the kernel's own first derivatives, the higher ones of
the same attention in plain XLA.

The Pallas and cuDNN kernels define their gradients with ``jax.custom_vjp`` and a backward kernel,
which jax cannot differentiate again (``jax.hessian`` or grad of grad fails inside Pallas). And
since ``attention`` traces a branch for every platform (``jaxpe.attention.platforms``), such a
kernel in the branch of another platform would make a CPU program's second derivatives fail too.
``twice_differentiable`` keeps the kernel for the value and the gradient and takes every derivative
beyond from a reference computing the same attention (the ``xla`` backend), as
``jaxpe.attention.cpu_flash`` does for the CPU kernel: the kernels give the values, XLA the tangents.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _zero_tangent(x):
  if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
    return jnp.zeros(jnp.shape(x), jnp.result_type(x))
  return np.zeros(jnp.shape(x), jax.dtypes.float0)


def twice_differentiable(kernel: Callable, reference: Callable, *args: jax.Array) -> jax.Array:
  """``kernel(*args)``, differentiable in ``args`` to any order in reverse mode.

  Args:
    kernel: a function of float arrays with a first derivative (a ``custom_vjp``: a fused kernel).
    reference: the same function in plain JAX, differentiable to any order (its value is not used).
    args: the float arrays both differentiate in (q, k, v; sinks where given).

  Returns:
    ``kernel(*args)``. Its gradient (``jax.grad``, ``jax.vjp``) is the kernel's; the derivative of
    that gradient (grad of grad, ``jax.hessian``) is the reference's at the same arguments. Forward
    mode (``jax.jvp``) raises jax's custom_vjp TypeError, as for the kernel itself.
  """
  n = len(args)
  tree = {}

  @jax.custom_jvp
  def forward(*xs):  # the value and the kernel's residuals (its vjp function's leaves)
    out, pullback = jax.vjp(kernel, *xs)
    leaves, tree["pullback"] = jax.tree.flatten(pullback)
    return out, leaves

  @forward.defjvp
  def forward_jvp(primals, tangents):
    out, leaves = forward(*primals)
    d_out = jax.jvp(reference, primals, tangents)[1]
    return (out, leaves), (d_out, [_zero_tangent(x) for x in leaves])

  @jax.custom_jvp
  def backward(*xs):  # (*args, *leaves, cotangent) -> the kernel's gradients
    pullback = jax.tree.unflatten(tree["pullback"], xs[n:-1])
    return tuple(pullback(xs[-1]))

  @backward.defjvp
  def backward_jvp(primals, tangents):
    grads = backward(*primals)
    inputs = (*primals[:n], primals[-1])
    d_inputs = (*tangents[:n], tangents[-1])

    def reference_grads(*ys):
      return tuple(jax.vjp(reference, *ys[:n])[1](ys[-1]))

    d_grads = jax.jvp(reference_grads, inputs, tuple(map(_instantiate, inputs, d_inputs)))[1]
    return grads, d_grads

  @jax.custom_vjp
  def value(*xs):
    return forward(*xs)[0]

  def value_fwd(*xs):
    out, leaves = forward(*xs)
    return out, (xs, leaves)

  def value_bwd(residuals, cotangent):
    xs, leaves = residuals
    return backward(*xs, *leaves, cotangent)

  value.defvjp(value_fwd, value_bwd)
  return value(*args)


def _instantiate(primal, tangent):
  """A symbolic zero tangent as an array of zeros (``jax.jvp`` wants arrays)."""
  if type(tangent).__name__ == "SymbolicZero" or tangent is None:
    return jnp.zeros(jnp.shape(primal), jnp.result_type(primal))
  return tangent


__all__ = ["twice_differentiable"]
