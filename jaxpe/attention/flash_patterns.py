"""The attention patterns of the ``flash`` kernels (both families): the block ranges and element
masks of causal masking, ``local_window_size`` ``(left, right)`` and ``chunk_size`` (the contract of
``jaxpe.attention.attention``, on token indices of the row), the soft cap and the sinks' start of
the online softmax.

``key_blocks`` / ``query_blocks`` give the ``[lo, hi)`` range of the other side's blocks that a block
needs (a block wholly outside every row's window / chunk is never loaded: the Triton loops run over
the range, the Mosaic grids walk it, ``span`` long); ``pattern_mask`` masks the pairs inside the
blocks the range cuts. Each takes Python ints (``span``: the grid's static length) or traced int32
grid indices (index maps and kernel bodies; ``lax.div``, as Mosaic's ``//`` of int32 asks for the
chip). Window sides are at most the padded T (``flash.attend`` drops longer ones): int32-safe.

Shape alphabet: bq, bk block rows; ``cfg``: ``flash_kernels.Config``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _max(a, b):
  return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a, b):
  return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _div(a, b: int):
  """``a // b`` for ``a >= 0`` (Python ints, or int32 through ``lax.div``: Mosaic's ``//`` asks for the chip)."""
  return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _sides(cfg):
  """``(left, right)`` of the window with the causal mask folded in (right 0), None for an unbounded side."""
  left, right = cfg.window if cfg.window is not None else (None, None)
  if cfg.causal:
    right = 0
  return left, right


def _chunk_blocks(cfg, first, last, lo, hi):
  """``[lo, hi)`` narrowed to the blocks of the chunks of tokens ``first..last`` (same-chunk pairs only)."""
  if cfg.chunk is None:
    return lo, hi
  c, b = cfg.chunk, cfg.block
  lo = _max(lo, _div(_div(first, c) * c, b))
  hi = _min(hi, _div(_div(last, c) * c + (c - 1), b) + 1)
  return lo, hi


def key_blocks(cfg, i, n: int):
  """``[lo, hi)``: the key blocks with a key that some query of q block ``i`` sees (causal, window,
  chunks); the others are never loaded. ``i`` a Python int or a traced int32 (a grid index)."""
  b = cfg.block
  first, last = i * b, i * b + (b - 1)
  left, right = _sides(cfg)
  lo, hi = 0, n
  if left is not None:
    lo = _max(lo, _div(_max(first - left, 0), b))
  if right is not None:
    hi = _min(hi, _div(last + right, b) + 1)
  return _chunk_blocks(cfg, first, last, lo, hi)


def query_blocks(cfg, j, n: int):
  """``[lo, hi)``: the q blocks with a query that sees some key of key block ``j`` (query i sees key
  j when ``j - right <= i <= j + left``, in the same chunk)."""
  b = cfg.block
  first, last = j * b, j * b + (b - 1)
  left, right = _sides(cfg)
  lo, hi = 0, n
  if right is not None:
    lo = _max(lo, _div(_max(first - right, 0), b))
  if left is not None:
    hi = _min(hi, _div(last + left, b) + 1)
  return _chunk_blocks(cfg, first, last, lo, hi)


def span(blocks, cfg, n: int) -> int:
  """The most blocks ``blocks`` (``key_blocks`` / ``query_blocks``) gives any of the n blocks: the
  length of the Mosaic grid's sequential axis."""
  return max(hi - lo for lo, hi in (blocks(cfg, x, n) for x in range(n)))


def pattern_mask(cfg, q_start, k_start, shape, mask=None):
  """Bool ``[bq, bk]``: ``mask`` (None: all) and the (query, key) pairs of the blocks starting at
  token ``q_start`` / ``k_start`` that the causal mask, the window and the chunks let through; None
  when there is neither."""
  left, right = _sides(cfg)
  if left is None and right is None and cfg.chunk is None:
    return mask
  span_q = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
  span_k = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
  parts = []
  if right is not None:
    parts.append(span_k <= span_q + right)
  if left is not None:
    parts.append(span_k >= span_q - left)
  if cfg.chunk is not None:  # token indices >= 0: lax.div is floor division
    parts.append(lax.div(span_q, jnp.int32(cfg.chunk)) == lax.div(span_k, jnp.int32(cfg.chunk)))
  for part in parts:
    mask = part if mask is None else jnp.logical_and(mask, part)
  return mask


def soft_cap(cfg, s):
  """``(cap tanh(s / cap), 1 - tanh^2)`` of float32 scores (Gemma 2's ``attn_logit_softcapping``;
  the second: the backward's chain rule), or ``(s, None)`` without a cap."""
  if cfg.soft_cap is None:
    return s, None
  t = jnp.tanh(s * jnp.float32(1.0 / cfg.soft_cap))
  return t * jnp.float32(cfg.soft_cap), 1.0 - t * t


def softmax_start(cfg, sink_ref, rows: int):
  """The online softmax's start ``(max, sum)`` ``[rows, 1]`` float32: ``(-inf, 0)``, or with sinks
  (``sink_ref``: the head's ``(1, 1)`` logit block) ``(sink_h, 1)``: ``exp(sink_h - max)`` is the
  first term of the sum, a term with no value (gpt-oss; arXiv 2309.17453)."""
  if not cfg.sinks:
    return jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32)
  return jnp.broadcast_to(sink_ref[...], (rows, 1)), jnp.ones((rows, 1), jnp.float32)
