"""The block-pair loops of ``jaxpe.attention.online_softmax``: which partner blocks of a block to
visit (a static band, ``partners``) and the ``lax.cond``-guarded steps over them (``pairs``,
``guarded``). Every loop has a fixed trip count, so the loops stay reverse-differentiable (grad of
grad). With a local window or chunks (``jaxpe.attention.patterns``) the band is the few blocks the
window reaches: the work is O(T x window), not O(T^2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpe.attention import patterns


def guarded(step, static, need, i, j, carry):
  """``step(i, j, carry)`` where block pair (i, j) is needed, else ``carry``; i, j Python ints
  (straight-line code: static pairs are left out) or traced (loops: a ``lax.cond``)."""
  if static is not None:
    if isinstance(i, int) and isinstance(j, int):
      if not static[i, j]:
        return carry
    else:
      need = jnp.asarray(static) if need is None else need & jnp.asarray(static)
  if need is None:
    return step(i, j, carry)
  return jax.lax.cond(need[i, j], lambda c: step(i, j, c), lambda c: c, carry)


def partners(static, row: bool, n: int):
  """``(first [m] int32 array or None, width)``: the static band of partner blocks of each block
  (``row``: key blocks of each query block; else query blocks of each key block); None: all n."""
  if static is None:
    return None, n
  first, width = patterns.band(static if row else static.T)
  return jnp.asarray(first), width


def pairs(step, static, need, band, n: int, i, carry, *, row: bool, strict: bool = False):
  """``step`` over the partner blocks of block ``i`` in its static ``band`` (``partners``; a fixed
  trip count, so the loop stays reverse-differentiable), each pair under a ``lax.cond`` on
  ``static`` / ``need``; ``strict``: only pairs with key block < query block, as off-diagonal
  pairs (``step(..., True)``) of the triangular loops."""
  first, width = band
  static_arr = None if static is None else jnp.asarray(static)

  def body(r, c):
    p = r if first is None else first[i] + r
    pc = p if first is None else jnp.minimum(p, n - 1)
    qi, kj = (i, pc) if row else (pc, i)
    conds = [] if first is None else [p < n]
    conds += [] if static_arr is None else [static_arr[qi, kj]]
    conds += [] if need is None else [need[qi, kj]]
    conds += [kj < qi] if strict else []
    run = lambda c: step(qi, kj, c, True) if strict else step(qi, kj, c)  # noqa: E731
    if not conds:
      return run(c)
    return jax.lax.cond(functools.reduce(jnp.logical_and, conds), run, lambda c: c, c)

  return jax.lax.fori_loop(0, width, body, carry)


__all__ = ["guarded", "pairs", "partners"]
