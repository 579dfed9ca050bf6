"""Numeric rules every attention backend shares (one place, so the backends cannot drift apart).

- Hidden keys do not matter: ``zero_hidden_keys`` replaces the keys and values of key slots that
  no query of the call may see (``k_valid`` False: padding, empty KV-cache slots; a dense mask
  column that is False for every query) by zeros before ``P . V`` (and ``dS . K`` in the backward
  pass), where ``0 x NaN`` would otherwise make every row NaN (``decode_attention(heads_first=True)``
  keeps the rule without a zeroed copy of the cache: it zeroes only when a product is not finite). Whatever such a slot holds (NaN, inf, stale values) changes neither the output nor the
  gradients of q, k, v.
- A NaN score is not an empty row: ``row_seen`` tells a row with no visible key (its running
  maximum never left the lowest float32, the row gives zeros) from one whose maximum is NaN (a NaN
  query, key or bias among its visible scores: the row gives NaN, as the dense reference does).
- Wide document ids are never cast: ``canonical_segment_ids`` ranks ids that int32 cannot hold
  (int64, uint32, uint64 values such as 0 and 2^32) jointly over the queries' and the keys' ids
  (``masks.dense_segment_ids``), exactly, before any path that holds int32.

Shape alphabet: B batch, T query positions, S key positions, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention.masks import dense_segment_ids

LOWEST = float(jnp.finfo(jnp.float32).min)
"""The score of a masked key (the lowest finite float32; -inf would give NaN in ``exp(s - max)``)."""


def zero_hidden_keys(k: jax.Array, v: jax.Array, key_seen) -> tuple[jax.Array, jax.Array]:
  """``(k, v)`` with the keys and values of key slots no query sees set to zero (``0 x NaN`` would
  otherwise reach the output through ``P . V`` and the gradients through ``dS . K``).

  Args:
    k: ``[B, S, K, Hq]`` float keys.
    v: ``[B, S, K, H]`` float values.
    key_seen: ``[B, S]`` bool (or integer, nonzero = seen) array, False where no query of the call
      may see key s; None: every key may be seen (k and v are returned as they are).

  Returns:
    ``(k, v)`` of their dtypes (``jnp.where``: the gradient of a hidden slot is 0).
  """
  if key_seen is None:
    return k, v
  seen = jnp.asarray(key_seen).astype(bool)[:, :, None, None]
  return jnp.where(seen, k, jnp.zeros((), k.dtype)), jnp.where(seen, v, jnp.zeros((), v.dtype))


def row_seen(row_max: jax.Array, row_sum: jax.Array | None = None) -> jax.Array:
  """Whether a row's running maximum (masked scores are ``LOWEST``) comes from a visible key: True
  also for a NaN maximum or a NaN row sum (the row then gives NaN, not the zeros of a row with no
  visible key). The sum is asked too because XLA's CPU reductions need not carry a NaN into a
  maximum (a row max over a padded key block came back as ``LOWEST``); ``exp(NaN - m)`` always
  carries it into the sum."""
  seen = row_max != LOWEST
  return seen if row_sum is None else seen | jnp.isnan(row_sum)


def is_wide(ids) -> bool:
  """Whether integer ids may hold values int32 cannot (int64, uint32, uint64: ranked, never cast)."""
  dtype = np.dtype(ids.dtype)
  return dtype.itemsize > 4 or dtype == np.uint32


def canonical_segment_ids(q_seg, k_seg):
  """``(q_seg [B, T], k_seg [B, S])`` safe for int32 paths: unchanged when both fit int32 (or are
  None), else ranked jointly (``dense_segment_ids`` of ``[q_seg | k_seg]``: int32 ids in
  ``[0, T + S)``, equal exactly where the given ids are equal). numpy ids are ranked in numpy (jax
  without x64 would wrap an int64 array on its way in), jax ids with jax ops (traceable)."""
  if q_seg is None or k_seg is None or not (is_wide(q_seg) or is_wide(k_seg)):
    return q_seg, k_seg
  t_len = q_seg.shape[1]
  traced = any(isinstance(x, jax.core.Tracer) for x in (q_seg, k_seg))
  if not traced and (isinstance(q_seg, np.ndarray) or isinstance(k_seg, np.ndarray)):
    joined = np.concatenate([np.asarray(q_seg), np.asarray(k_seg)], axis=1)
  else:
    joined = jnp.concatenate([jnp.asarray(q_seg), jnp.asarray(k_seg)], axis=1)
  ranked = dense_segment_ids(joined)
  return ranked[:, :t_len], ranked[:, t_len:]


def canonical_ids(ids):
  """One array of document ids (self-attention: the queries' are the keys'), as
  ``canonical_segment_ids``: unchanged when int32 holds them, else ranked (int32)."""
  if ids is None or not is_wide(ids):
    return ids
  return dense_segment_ids(ids)


__all__ = ["LOWEST", "canonical_ids", "canonical_segment_ids", "is_wide", "row_seen", "zero_hidden_keys"]
