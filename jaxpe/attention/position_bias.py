"""``PositionBias``: an additive bias computed from token positions, with learned parameters.

The relative biases of the length-extrapolation literature (T5's buckets, Kerple, FIRE;
``jaxpe.ops.relative_bias``, ``jaxpe.ops.fire``) are functions of the query and key positions and
of a few learned arrays. ``PositionBias`` carries the function, its parameters and the positions to
``jaxpe.attention.attention``; the ``xla`` backend's blockwise attention evaluates it per block pair
inside the online softmax (never a ``[B, N, T, S]`` array) and accumulates the parameters' gradient
in its backward pass (the vjp of the function per block pair, with that pair's score gradient as
cotangent). A dense bias or mask of the caller's sends it to the dense reference, where it is
evaluated on all positions and added. Fused kernels (cudnn, splash, pallas_gpu) take no bias: a
``PositionBias`` there is an error (it is ``xla``-only).

Shape alphabet: B batch, T query positions, S key positions, N heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpe.ops import checks as _checks


@dataclasses.dataclass(frozen=True)
class PositionBias:
  """A position-dependent additive score bias for ``attention`` (``xla`` backend only).

  Attributes:
    fn: ``fn(params, q_positions [B, t], k_positions [B, s]) -> [B, N, t, s]`` float32, a pure JAX
      function of int32 token indices, differentiable in ``params`` (reverse mode); called on
      blocks of positions (t, s <= T, S) and on positions 0 in padding slots of a block, so it
      must be finite there. Hashable (a module-level function or a ``functools.partial`` of one).
    params: pytree of float arrays (the learned parts: T5's table, Kerple's r1 and r2, FIRE's MLP);
      ``attention`` is differentiable in them. May be None or empty.
    q_positions: ``[B, T]`` integer token indices of the queries, >= 0.
    k_positions: ``[B, S]`` integer token indices of the keys, >= 0.

  Checked by ``attention`` against q and k (``check_position_bias``), not at construction.
  """

  fn: Callable[[Any, jax.Array, jax.Array], jax.Array]
  params: Any
  q_positions: jax.Array
  k_positions: jax.Array

  def dense(self) -> jax.Array:
    """The whole bias ``[B, N, T, S]`` float32 (the dense reference's path and the tests')."""
    return self.fn(self.params, self.q_positions, self.k_positions).astype(jnp.float32)


def check_position_bias(bias, batch: int, t_len: int, s_len: int, num_heads: int) -> PositionBias:
  """``bias`` checked against q ``[B, T, N, .]`` and k ``[B, S, ., .]``; positions as int32 arrays.

  Raises:
    TypeError: not a ``PositionBias``; ``fn`` not callable; non-integer positions; float leaves of
      ``params`` missing (a non-float leaf); ``fn`` returning a non-float array.
    ValueError: positions not ``[B, T]`` / ``[B, S]`` or (concrete) negative; ``fn`` returning a
      shape other than ``[B, N, T, S]``.
  """
  if not isinstance(bias, PositionBias):
    raise TypeError(f"position_bias must be a PositionBias or None, got {type(bias).__name__}")
  if not callable(bias.fn):
    raise TypeError(f"PositionBias.fn must be callable, got {bias.fn!r}")
  for leaf in jax.tree.leaves(bias.params):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
        f"PositionBias.params must hold float arrays, got a leaf of dtype {jnp.result_type(leaf)}"
      )
  positions = []
  for name, pos, shape in (
    ("PositionBias.q_positions", bias.q_positions, (batch, t_len)),
    ("PositionBias.k_positions", bias.k_positions, (batch, s_len)),
  ):
    pos = _checks.checked_positions(name, pos, shape)
    positions.append(jnp.asarray(pos).astype(jnp.int32))
  out = jax.eval_shape(bias.fn, bias.params, *positions)
  if tuple(out.shape) != (batch, num_heads, t_len, s_len):
    raise ValueError(
      f"PositionBias.fn must return [B, N, T, S] = {[batch, num_heads, t_len, s_len]}, got {tuple(out.shape)}"
    )
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(f"PositionBias.fn must return a float array, got dtype {out.dtype}")
  return dataclasses.replace(bias, q_positions=positions[0], k_positions=positions[1])


def refuse_on_fused(implementation: str) -> None:
  """Raises the error of a ``PositionBias`` on a fused kernel: they take no bias tensor.

  Raises:
    ValueError: always, naming ``implementation`` and saying the bias is ``xla``-only.
  """
  raise ValueError(
    f"attention implementation {implementation!r} takes no bias tensor: a PositionBias (T5, Kerple, FIRE "
    "relative biases) runs on implementation='xla' only (blockwise there, O(T) memory)"
  )


__all__ = ["PositionBias", "check_position_bias", "refuse_on_fused"]
