"""The ``xla`` backend: blockwise attention in plain XLA (``jaxpe.attention.attention``).

A few queries under an ``IndexMask`` (KV-cache decoding) run in one pass over the cache
(``jaxpe.attention.decode``). Structured masks (``AttentionMask``, ``IndexMask``), no mask, ALiBi of an
``AlibiSpec`` and a learned ``PositionBias`` (T5, Kerple, FIRE) run through ``jaxpe.attention.blockwise.blockwise_attention``: key blocks with an
online softmax, the bias and mask computed per block from slot indices and positions, O(T x block)
memory, never a ``[B, N, T, S]`` array. A dense bias or dense bool mask that the caller built runs
on the dense reference ``jaxpe.attention.reference.dot_product_attention`` (the arrays are the
caller's, already score-sized).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.attention import blockwise, decode, reference
from jaxpe.attention import patterns as pattern_lib
from jaxpe.attention import sinks as sink_lib
from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.masks import AttentionMask, IndexMask
from jaxpe.attention.position_bias import PositionBias
from jaxpe.ops import alibi

HEAD_DIM_MULTIPLE: dict[str, int] = {"xla": 1, "cudnn": 8, "splash": 128, "pallas_gpu": 0}
# The dense reference's query block for causal self-attention (``dot_product_attention(causal_block=)``).
# The ``xla`` backend itself now runs blockwise (``blockwise.default_block``); kept for callers of the
# dense reference and old imports.
XLA_CAUSAL_BLOCK = reference.DEFAULT_CAUSAL_BLOCK


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: AttentionMask | IndexMask | jax.Array | None,
  bias: jax.Array | None,
  alibi_spec: AlibiSpec | None,
  precise_dims: int,
  sinks: jax.Array | None = None,
  position_bias: PositionBias | None = None,
  pattern: pattern_lib.Pattern | None = None,
) -> jax.Array:
  """``jaxpe.attention.attention`` on ``xla``, its arguments already checked: ``[B, T, N, H]``.

  ``pattern`` (checked): the local window on the mask's slots (``IndexMask``) or the indices
  ``0..T-1`` / ``0..S-1`` (otherwise), the chunks on the tokens' positions
  (``jaxpe.attention.patterns``: an ``IndexMask``'s positions, an ``AttentionMask``'s
  ``document_positions``; a dense mask carries none: the slots), the soft cap before the bias, mask and sinks.

  ``sinks`` (``[N]``, checked): blockwise from the lse, dense as one more key slot
  (``jaxpe.attention.sinks``). An ``IndexMask`` with at most ``decode.DECODE_MAX_QUERIES`` queries
  (KV-cache decoding) runs in one pass over the keys (``jaxpe.attention.decode``), a dense bias too."""
  pattern = pattern_lib.Pattern() if pattern is None else pattern
  options = dict(local_window_size=pattern.window, chunk_size=pattern.chunk, logits_soft_cap=pattern.cap)
  if isinstance(mask, IndexMask) and q.shape[1] <= decode.DECODE_MAX_QUERIES:
    return decode.decode_attention(
      q,
      k,
      v,
      scale=scale,
      mask=mask,
      bias=bias,
      alibi=alibi_spec,
      position_bias=position_bias,
      precise_dims=precise_dims,
      sinks=sinks,
      **options,
    )
  if bias is None and (mask is None or isinstance(mask, AttentionMask | IndexMask)):
    # Looked up at call time so tests can wrap blockwise.blockwise_attention.
    return blockwise.blockwise_attention(
      q,
      k,
      v,
      scale=scale,
      mask=mask,
      alibi=alibi_spec,
      position_bias=position_bias,
      precise_dims=precise_dims,
      sinks=sinks,
      **options,
    )
  q_pos, k_pos = pattern_lib.arange_positions(q.shape[1]), pattern_lib.arange_positions(k.shape[1])
  q_chunk = k_chunk = None  # the positions the chunks count (None: the slots)
  if isinstance(mask, AttentionMask):
    checked = mask.check(q.shape[0], q.shape[1])
    if pattern.chunk is not None and (checked.valid is not None or checked.segment_ids is not None):
      q_chunk = k_chunk = pattern_lib.document_positions(
        checked.valid, checked.segment_ids, q.shape[0], q.shape[1]
      )
    mask = mask.dense(q.shape[0], q.shape[1])
  elif isinstance(mask, IndexMask):
    q_pos, k_pos = mask.q_index, mask.k_index
    q_chunk, k_chunk = mask.q_positions, mask.k_positions
    mask = mask.dense()
  if pattern.masks:  # the window / chunks as part of the dense mask (before a sink's key slot)
    local = pattern_lib.dense_visible(pattern, q_pos, k_pos, q_chunk, k_chunk)
    mask = local if mask is None else mask & local
  if alibi_spec is not None:
    native = alibi.alibi_bias(
      jnp.asarray(alibi_spec.slopes, jnp.float32), alibi_spec.q_positions, alibi_spec.k_positions
    )
    bias = native if bias is None else bias + native
  if position_bias is not None:
    native = position_bias.dense()
    bias = native if bias is None else bias + native
  if sinks is not None:
    k, v, bias, mask = sink_lib.with_sink_key(q, k, v, bias, mask, sinks)
  # Looked up at call time so tests can wrap reference.dot_product_attention.
  return reference.dot_product_attention(
    q, k, v, scale=scale, bias=bias, mask=mask, precise_dims=precise_dims, logits_soft_cap=pattern.cap
  )
