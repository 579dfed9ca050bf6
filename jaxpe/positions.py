"""Token positions from padding masks and packed-sequence segment ids.

Positions are token indices (int32, >= 0) and feed RoPE, ALiBi and the emulated form alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe import _checks


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Positions that count only real tokens: ``(cumsum(mask) - 1) * mask``.

  Works for left and right padding; padding slots get position 0. This is BLOOM's rule
  (HF ``BloomModel``: ``(attention_mask.cumsum(-1) - 1) * attention_mask``).

  Args:
    attention_mask: ``[B, S]`` bool or integer, 1/True for real tokens.

  Returns:
    ``[B, S]`` int32 positions.

  Raises:
    ValueError: ``attention_mask`` not rank 2.
  """
  _checks.check_rank("attention_mask", attention_mask, 2, "[B, S]")
  mask = attention_mask.astype(jnp.int32)
  return (jnp.cumsum(mask, axis=-1) - 1) * mask


def positions_from_segment_ids(segment_ids: jax.Array) -> jax.Array:
  """Positions that restart at 0 where the segment id changes (packed documents).

  Args:
    segment_ids: ``[B, T]`` integer document ids; consecutive tokens of one document share an id.
      (Padding may be given its own id, e.g. 0.)

  Returns:
    ``[B, T]`` int32 positions within each document.

  Raises:
    ValueError: ``segment_ids`` not rank 2.
    TypeError: non-integer ``segment_ids``.
  """
  _checks.check_rank("segment_ids", segment_ids, 2, "[B, T]")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")
  t_len = segment_ids.shape[1]
  index = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), segment_ids.shape)
  starts = jnp.concatenate(
    [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
  )
  start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  return index - start_index
