"""The ring-buffer KV cache of windowed layers (issue 47): a ``sliding_attention`` layer of window
``sliding_window = w`` needs the keys of the last ``w - 1`` tokens only, a ``chunked_attention``
layer those of the last ``attention_chunk_size - 1``; such a layer's cache arrays hold
``W = LayerPattern.ring_slots`` slots (memory O(window), not O(T)) when the cache has more slots
than that (``jaxpe.model.cache.layer_slots``).

The token of sequence slot g (the cache's slot numbering, ``KVCache.positions``' column) lies in
ring slot ``g % W``. Before a chunk of T new tokens at slots ``end .. end + T - 1`` is written, ring
slot j holds slot ``g_j = end - 1 - ((end - 1 - j) mod W)`` (the last slot below ``end`` that maps
to j) if ``g_j >= 0``, else nothing. The chunk attends to the W ring slots (their positions and
validity read from the cache's ``[B, S]`` columns at ``g_j``) and to its own T keys, under an
``IndexMask`` of those slot indices with the layer's window (distances are slot indices, exact
past any number of wraps) or chunk (counted in the tokens' positions, read from the same columns:
from each row's first real token under left padding, as transformers); then its last ``min(T, W)`` keys overwrite their ring slots. An
empty ring slot is given index ``end + T + j`` (after every query: causally masked, and invalid).

Source: the ring buffer of transformers' ``SlidingWindowLayer`` (``cache_utils``), whose wrap
issue 37574 reports; here the positions come from the slot indices, never from the ring's order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.attention import masks


def ring_slot_index(end: jax.Array, t_len: int, ring: int) -> jax.Array:
  """``[W]`` int32 sequence slot held by each ring slot before a chunk of ``t_len`` tokens at
  ``end`` is written (``end + t_len + j`` for an empty ring slot j)."""
  j = jnp.arange(ring, dtype=jnp.int32)
  end = jnp.asarray(end, jnp.int32)
  g = end - 1 - jnp.mod(end - 1 - j, ring)
  return jnp.where(g >= 0, g, end + t_len + j)


def ring_write(ring_arr: jax.Array, new: jax.Array, end: jax.Array) -> jax.Array:
  """``ring_arr [B, K, W, H]`` with the last ``min(T, W)`` of ``new [B, T, K, H]`` (the chunk at
  slots ``end ..``) written to their ring slots ``slot % W``."""
  ring, t_len = ring_arr.shape[2], new.shape[1]
  keep = min(t_len, ring)
  new = jnp.swapaxes(new[:, t_len - keep :], 1, 2).astype(ring_arr.dtype)
  slots = jnp.mod(jnp.asarray(end, jnp.int32) + (t_len - keep) + jnp.arange(keep, dtype=jnp.int32), ring)
  return ring_arr.at[:, :, slots].set(new)


def ring_keys(
  cache_kv: tuple[jax.Array, jax.Array],
  k: jax.Array,
  v: jax.Array,
  mask: masks.IndexMask,
  kv_positions: jax.Array,
  end: jax.Array,
) -> tuple[jax.Array, jax.Array, masks.IndexMask, jax.Array]:
  """The keys a chunk attends to on a ring layer: ``(k_all [B, W + T, K, Hk], v_all [B, W + T, K,
  H], IndexMask, kv_positions [B, W + T])`` from the ring ``cache_kv`` (``[B, K, W, .]`` before the
  write), the chunk's ``k``, ``v`` ``[B, T, K, .]``, and the cache's ``mask`` / ``kv_positions``
  over all S sequence slots (the new tokens already in their columns)."""
  ring, t_len = cache_kv[0].shape[2], k.shape[1]
  batch = k.shape[0]
  g = ring_slot_index(end, t_len, ring)
  s_len = kv_positions.shape[1]
  at = jnp.clip(g, 0, s_len - 1)
  filled = g < jnp.asarray(end, jnp.int32)
  k_valid = jnp.ones(kv_positions.shape, bool) if mask.k_valid is None else mask.k_valid.astype(bool)
  ring_valid = jnp.take(k_valid, at, axis=1) & filled[None, :]
  new_valid = jax.lax.dynamic_slice_in_dim(k_valid, end, t_len, axis=1)
  new_pos = jax.lax.dynamic_slice_in_dim(kv_positions, end, t_len, axis=1)
  positions = jnp.concatenate([jnp.take(kv_positions, at, axis=1), new_pos], axis=1)
  index = jnp.concatenate([g, jnp.asarray(end, jnp.int32) + jnp.arange(t_len, dtype=jnp.int32)])
  index = jnp.broadcast_to(index, (batch, ring + t_len))
  k_all = jnp.concatenate([jnp.swapaxes(cache_kv[0], 1, 2), k.astype(cache_kv[0].dtype)], axis=1)
  v_all = jnp.concatenate([jnp.swapaxes(cache_kv[1], 1, 2), v.astype(cache_kv[1].dtype)], axis=1)
  valid = jnp.concatenate([ring_valid, new_valid], axis=1)
  chunk_pos = None if mask.q_positions is None else (mask.q_positions, positions)  # chunks: positions
  ring_mask = masks.IndexMask(
    mask.q_index, index, mask.causal, valid, None, None, *(chunk_pos or (None, None))
  )
  return k_all, v_all, ring_mask, positions
