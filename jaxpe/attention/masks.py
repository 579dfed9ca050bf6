"""Masks built from positions and segment ids (packed documents) for the attention functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.attention.reference import make_attention_mask
from jaxpe.ops import checks as _checks


def document_mask(
  q_segment_ids: jax.Array, k_segment_ids: jax.Array, *, causal: bool = True, q_offset: int = 0
) -> jax.Array:
  """Attention mask for packed sequences: a query sees only keys of its own document.

  Args:
    q_segment_ids: ``[B, T]`` integer document ids of the queries.
    k_segment_ids: ``[B, S]`` integer document ids of the keys.
    causal: a bool; also hide keys after the query (query t sits at key slot ``q_offset + t``).
    q_offset: key slot of the first query (``S - T`` for the last T tokens); int, ``0 <= q_offset``
      and ``q_offset + T <= 2^31``.

  Returns:
    ``[B, 1, T, S]`` bool, True = may attend (broadcasts over heads).

  Raises:
    ValueError: wrong ranks, batch sizes differ, ``q_offset`` negative or ``q_offset + T > 2^31``.
    TypeError: non-integer segment ids; ``q_offset`` not an int; ``causal`` not a bool.

  Source: the packed-example mask of t5x / Flax lm1b (``make_attention_mask(segmentation,
  segmentation, jnp.equal)`` combined with the causal mask).
  """
  q_segment_ids = _checks.as_array("q_segment_ids", q_segment_ids)
  k_segment_ids = _checks.as_array("k_segment_ids", k_segment_ids)
  for name, ids in (("q_segment_ids", q_segment_ids), ("k_segment_ids", k_segment_ids)):
    _checks.check_rank(name, ids, 2, "[B, T]" if name[0] == "q" else "[B, S]")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype}")
  if q_segment_ids.shape[0] != k_segment_ids.shape[0]:
    raise ValueError(
      f"q_segment_ids and k_segment_ids must have the same batch size, got {q_segment_ids.shape[0]} "
      f"and {k_segment_ids.shape[0]}"
    )
  batch, t_len, s_len = q_segment_ids.shape[0], q_segment_ids.shape[1], k_segment_ids.shape[1]
  q_offset = _checks.check_index("q_offset", q_offset)
  if q_offset + t_len > _checks.MAX_POSITION:
    raise ValueError(f"q_offset + T must be <= 2^31 (int32 key slots), got {q_offset} + {t_len}")
  causal = _checks.check_bool("causal", causal)
  q_slot = jnp.broadcast_to(q_offset + jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
  k_slot = jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32), (batch, s_len))
  return make_attention_mask(
    q_slot, k_slot, causal=causal, q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids
  )
