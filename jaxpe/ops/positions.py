"""Token positions from padding masks and packed-sequence segment ids.

Positions are token indices (int32, >= 0) and feed RoPE, ALiBi and the emulated form alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks


def positions_from_mask(attention_mask: jax.Array, *, start: jax.Array | int | None = None) -> jax.Array:
  """Positions that count only real tokens: ``start + (cumsum(mask) - 1) * mask``.

  Works for left and right padding; padding slots get position 0. This is BLOOM's rule
  (HF ``BloomModel``: ``(attention_mask.cumsum(-1) - 1) * attention_mask``).

  These positions are for RoPE / ALiBi, not for the attention mask: they repeat (every padding
  token is at 0), so a mask compared on them lets real tokens see padding. Mask with the padding
  itself: ``jaxpe.AttentionMask(valid=attention_mask)`` (``.dense(B, S)`` for a bool array).

  Args:
    attention_mask: ``[B, S]`` bool or integer, nonzero/True for real tokens.
    start: optional position of the first real token per sequence, e.g. the number of real tokens
      already in a KV cache: an int in ``[0, 2^31 - S]`` or a ``[B]`` integer array (concrete: values
      in that range; traced: not checked, the sum wraps in int32 beyond it). Padding stays at 0.

  Returns:
    ``[B, S]`` int32 positions.

  Raises:
    ValueError: ``attention_mask`` not rank 2; ``start`` negative, not ``[B]``, or ``start + S > 2^31``.
    TypeError: ``attention_mask`` not a bool/integer array (float, strings, ragged lists); ``start``
      not an int or integer array (float, bool).
  """
  attention_mask = _checks.as_array("attention_mask", attention_mask)
  _checks.check_rank("attention_mask", attention_mask, 2, "[B, S]")
  _check_mask_dtype("attention_mask", attention_mask)
  s_len = attention_mask.shape[1]
  if start is not None:
    if isinstance(start, (int, np.integer)) and not isinstance(start, bool):
      start = _checks.check_index("start", start, upper=_checks.MAX_POSITION - s_len, what="2^31 - S")
      start = jnp.full((attention_mask.shape[0],), start, jnp.int32)
    elif not isinstance(start, jax.Array | np.ndarray | list | tuple):
      raise _checks.ArgTypeError(f"start must be an int >= 0 or a [B] integer array, got {start!r}")
    start = _checks.as_array("start", start)
    _checks.check_rank("start", start, 1, "[B]")
    _checks.check_dim("start", start, 0, attention_mask.shape[0], "B")
    _checks.check_positions("start", start)
    if (
      not isinstance(start, jax.core.Tracer)
      and start.size
      and int(np.max(start)) + s_len > _checks.MAX_POSITION
    ):
      raise ValueError(
        f"start + S must be <= 2^31 (int32 positions), got max start {np.max(start)} and S = {s_len}"
      )
  mask = attention_mask.astype(bool).astype(jnp.int32)  # any nonzero value is a real token
  positions = (jnp.cumsum(mask, axis=-1) - 1) * mask
  if start is None:
    return positions
  return positions + jnp.asarray(start).astype(jnp.int32)[:, None] * mask


def _check_mask_dtype(name: str, mask) -> None:
  dtype = jnp.result_type(mask)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"{name} must be a bool or integer (0/1) array, got dtype {dtype}")


def positions_from_segment_ids(segment_ids: jax.Array) -> jax.Array:
  """Positions that restart at 0 where the segment id changes (packed documents).

  For RoPE / ALiBi, not for the attention mask (they repeat across documents): mask with the ids,
  ``jaxpe.AttentionMask(segment_ids=segment_ids)`` or ``document_mask``.

  Args:
    segment_ids: ``[B, T]`` integer document ids; consecutive tokens of one document share an id.
      (Padding may be given its own id, e.g. 0.)

  Returns:
    ``[B, T]`` int32 positions within each document.

  Raises:
    ValueError: ``segment_ids`` not rank 2.
    TypeError: ``segment_ids`` not an integer array (float, bool, strings).

  Source: sequence packing as in T5 / t5x (``inputs_positions`` from ``inputs_segmentation``,
  Raffel et al. arXiv 1910.10683) and Flax's lm1b example.
  """
  segment_ids = _checks.as_array("segment_ids", segment_ids)
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
