"""Few-query attention over a KV cache: one pass over the cache slots, no key blocks, no loops.

KV-cache decoding asks for the attention of one new token (or a short chunk) against all S slots
of the cache. ``decode_attention`` forms the ``[B, N, T, S]`` scores in one einsum (for T = 1 they
are smaller than the cache itself), masks them with the ``IndexMask`` (causal slots, filled /
real-token slots, documents), adds the ALiBi bias or the learned position bias of those T rows
only, and contracts the probabilities with v: each cache array is read once per call. The
``xla`` backend of ``jaxpe.attention.attention`` runs it for an ``IndexMask`` with at most
``DECODE_MAX_QUERIES`` queries (decoding); longer chunks go blockwise.

Slots that no query may see (past the filled ones, padding) weigh exactly 0 and their values are
replaced by zeros before the products (``jaxpe.attention.numerics``): whatever they hold (stale
values, NaN) changes nothing. With ``heads_first=True`` (the ``KVCache`` layout ``[B, K, S, H]``, the
decoder's decode steps) the cache is read as it lies by two batched matmuls and never copied: the
hidden slots are masked in the scores, and the zeroed form runs only when a score or the ``P . V``
product is not finite (``_heads_first``), with the same result and derivatives.

Shape alphabet: B batch, T query positions, S key (cache) slots, N heads, K kv heads, G = N / K,
H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpe.attention import numerics
from jaxpe.attention import patterns as pattern_lib
from jaxpe.attention import sinks as sink_lib
from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.masks import IndexMask
from jaxpe.attention.position_bias import PositionBias
from jaxpe.ops import alibi as alibi_lib

# At most this many queries take the one-pass path (the score array is T x S per head).
DECODE_MAX_QUERIES = 16
# Up to this many query rows per kv head (G x T) the products are elementwise products and sums over
# the cache in its own layout; more rows go through batched matmuls.
REDUCE_MAX_ROWS = 4
_LOWEST = float(jnp.finfo(jnp.float32).min)


def decode_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: IndexMask,
  bias: jax.Array | None = None,
  alibi: AlibiSpec | None = None,
  position_bias: PositionBias | None = None,
  precise_dims: int = 0,
  sinks: jax.Array | None = None,
  heads_first: bool = False,
  local_window_size: int | tuple[int, int] | None = None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
) -> jax.Array:
  """``softmax(q.k * scale + bias, masked) . v`` of a few queries over all key slots, in one pass.

  The values of ``jaxpe.attention.dot_product_attention(q, k, v, bias=..., mask=mask.dense())`` to
  float32 rounding (float32 scores and softmax; the last ``precise_dims`` dims of q and k
  contracted in float32 at ``HIGHEST``; a row with no visible key gives zeros), except that keys
  no query sees never reach the result, even when they hold NaN or inf.

  Arguments are taken as checked (``jaxpe.attention.attention`` checks them).

  Args:
    q: ``[B, T, N, Hq]`` float queries, T small (``DECODE_MAX_QUERIES``).
    k: ``[B, S, K, Hq]`` float keys (the cache), ``N % K == 0``.
    v: ``[B, S, K, H]`` float values.
    scale: the score scale, a Python float > 0.
    mask: the ``IndexMask`` of the query and key slots.
    bias: optional float dense bias broadcastable to ``[B, N, T, S]`` (CoPE).
    alibi: optional ``AlibiSpec``: ``-m_h (i - j)`` of its slopes ``[N]`` and positions.
    position_bias: optional ``PositionBias`` (T5, Kerple, FIRE), evaluated on the T query rows.
    precise_dims: trailing float32 dims of q and k (``rope_alibi``), 0..Hq.
    sinks: optional ``[N]`` float sink logits (their ``exp`` joins each row's denominator).
    heads_first: a Python bool: k and v are given as ``[B, K, S, Hq]`` and ``[B, K, S, H]`` (the
      layout of ``jaxpe.model.KVCache``): the products are then batched matmuls over the arrays as
      they lie, each read once, with no transposed or zeroed copy (``_heads_first``).
    local_window_size, chunk_size, logits_soft_cap: the attention pattern of
      ``jaxpe.attention.attention`` (checked here, ``jaxpe.attention.patterns``): the window
      compares the mask's slots ``q_index`` / ``k_index``, the chunks its ``q_positions`` /
      ``k_positions`` (the tokens' positions; else the slots); the cap applies to the scaled scores before the bias and the mask.

  Raises:
    TypeError, ValueError: as ``jaxpe.attention.attention`` for the three pattern options.

  Returns:
    ``[B, T, N, H]`` of ``v.dtype``; zeros when B, T or S is 0 (as the dense reference).
  """
  pattern = pattern_lib.check_pattern(local_window_size, chunk_size, logits_soft_cap)
  pattern_lib.check_cap_precise_dims(pattern, int(precise_dims))
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = (k.shape[2], k.shape[1]) if heads_first else (k.shape[1], k.shape[2])
  if 0 in (batch, t_len, s_len):  # no rows, or no keys (rows without a visible key): zeros
    return jnp.zeros((batch, t_len, num_heads, v.shape[-1]), v.dtype)
  group = num_heads // num_kv
  h = v.shape[-1]
  visible = mask.visible()  # [B, T, S]
  if pattern.masks:  # the window / chunks on the slots (a ring-buffer cache: the tokens' positions)
    qi, ki = jnp.asarray(mask.q_index).astype(jnp.int32), jnp.asarray(mask.k_index).astype(jnp.int32)
    qc = kc = None
    if mask.q_positions is not None:  # the chunks count the tokens' positions
      qc = jnp.asarray(mask.q_positions).astype(jnp.int32)[:, :, None]
      kc = jnp.asarray(mask.k_positions).astype(jnp.int32)[:, None, :]
    visible = visible & pattern.visible(qi[:, :, None], ki[:, None, :], qc, kc)
  if heads_first:
    add = _score_bias(q, s_len, bias, alibi, position_bias)
    return _heads_first(float(scale), int(precise_dims), pattern.cap, q, k, v, visible, add, sinks)
  # slots no query sees are zeroed: 0 * NaN would otherwise reach the output (and dq through k)
  k, v = numerics.zero_hidden_keys(k, v, jnp.any(visible, axis=1))
  # [B, T, N, Hq] -> [B, K, G*T, Hq]: one matmul per kv head, its cache read once
  qr = jnp.moveaxis(q.reshape(batch, t_len, num_kv, group, qk_dim), 1, 3).reshape(
    batch, num_kv, group * t_len, qk_dim
  )
  split = qk_dim - precise_dims
  f32 = jnp.float32
  rows = group * t_len
  if rows <= REDUCE_MAX_ROWS:
    # products and sums over the cache as it lies ([B, S, K, H]): one read, no transposed copy of the
    # cache for a batched matmul (XLA:CPU made one per layer and step); float32 throughout (so the
    # emulation dims are contracted at float32 precision too)
    logits = jnp.sum(
      qr.astype(f32)[:, None, :, :, :] * k.astype(f32)[:, :, :, None, :], axis=-1
    )  # [B, S, K, Q]
    logits = jnp.moveaxis(logits, 1, 3)  # [B, K, Q, S]
  else:
    logits = jnp.einsum("BKQH,BSKH->BKQS", qr[..., :split], k[..., :split], preferred_element_type=f32)
  if precise_dims and rows > REDUCE_MAX_ROWS:
    logits = logits + _precise_logits("BKQH,BSKH->BKQS", qr, k, split)
  logits = pattern.soft_cap(logits.reshape(batch, num_kv, group, t_len, s_len) * f32(scale))
  extra = None
  if alibi is not None:
    extra = alibi_lib.alibi_bias(jnp.asarray(alibi.slopes, f32), alibi.q_positions, alibi.k_positions)
  elif position_bias is not None:
    extra = position_bias.dense()
  for b in (bias, extra):
    if b is not None:
      b = jnp.broadcast_to(b.astype(f32), (batch, num_heads, t_len, s_len))
      logits = logits + b.reshape(batch, num_kv, group, t_len, s_len)
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  seen = row_max != -jnp.inf  # rows with a visible key (a NaN maximum too: the row gives NaN)
  e = jnp.exp(logits - jnp.where(seen, row_max, 0.0))
  total = jnp.sum(e, axis=-1, keepdims=True)
  e = e.reshape(batch, num_kv, rows, s_len)
  if rows <= REDUCE_MAX_ROWS:
    ew = jnp.moveaxis(e, 3, 1)  # [B, S, K, Q]
    out = jnp.sum(ew[..., None] * v.astype(f32)[:, :, :, None, :], axis=1)  # [B, K, Q, H]
  else:
    out = jnp.einsum("BKQS,BSKH->BKQH", e.astype(v.dtype), v, preferred_element_type=f32)
  out = out.reshape(batch, num_kv, group, t_len, h)
  out = out * jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
  out = jnp.moveaxis(out, 3, 1).reshape(batch, t_len, num_heads, h)
  if sinks is not None:
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
    lse = jnp.moveaxis(lse, 3, 1).reshape(batch, t_len, num_heads)
    out, _ = sink_lib.apply_sinks(out, lse, sinks)
  return out.astype(v.dtype)


def _score_bias(q, s_len, bias, alibi, position_bias):
  """The additive ``[B, N, T, S]`` float32 score bias (dense, ALiBi or learned; None without)."""
  batch, t_len, num_heads = q.shape[:3]
  total = None
  extra = None
  if alibi is not None:
    extra = alibi_lib.alibi_bias(jnp.asarray(alibi.slopes, jnp.float32), alibi.q_positions, alibi.k_positions)
  elif position_bias is not None:
    extra = position_bias.dense()
  for b in (bias, extra):
    if b is not None:
      b = jnp.broadcast_to(b.astype(jnp.float32), (batch, num_heads, t_len, s_len))
      total = b if total is None else total + b
  return total


def _heads_first_core(q, k, v, visible, add, scale, precise_dims, safe, cap=None):
  """``(raw scores [B, K, G*T, S], unnormalised P.V [B, K, G*T, H] float32, row max, row sum)``
  of heads-first k, v; ``safe``: hidden slots' keys and values zeroed first (materialised)."""
  batch, t_len, num_heads, qk_dim = q.shape
  num_kv, s_len = k.shape[1], k.shape[2]
  group = num_heads // num_kv
  f32 = jnp.float32
  if safe:
    seen = jnp.any(visible, axis=1)[:, None, :, None]  # [B, 1, S, 1]
    k = jnp.where(seen, k, jnp.zeros((), k.dtype))
    v = jnp.where(seen, v, jnp.zeros((), v.dtype))
  qr = jnp.moveaxis(q.reshape(batch, t_len, num_kv, group, qk_dim), 1, 3).reshape(
    batch, num_kv, group * t_len, qk_dim
  )
  split = qk_dim - precise_dims
  raw = jnp.einsum("BKQH,BKSH->BKQS", qr[..., :split], k[..., :split], preferred_element_type=f32)
  if precise_dims:
    raw = raw + _precise_logits("BKQH,BKSH->BKQS", qr, k, split)
  logits = pattern_lib.Pattern(cap=cap).soft_cap(raw.reshape(batch, num_kv, group, t_len, s_len) * f32(scale))
  if add is not None:
    logits = logits + add.reshape(batch, num_kv, group, t_len, s_len)
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  seen_row = row_max != -jnp.inf
  e = jnp.exp(logits - jnp.where(seen_row, row_max, 0.0))
  total = jnp.sum(e, axis=-1, keepdims=True)
  e = e.reshape(batch, num_kv, group * t_len, s_len)
  out = jnp.einsum("BKQS,BKSH->BKQH", e.astype(v.dtype), v, preferred_element_type=f32)
  return raw, out, row_max, total


def _heads_first_finish(q, v, out, row_max, total, sinks):
  batch, t_len, num_heads = q.shape[:3]
  num_kv, h = v.shape[1], v.shape[-1]
  group = num_heads // num_kv
  seen = row_max != -jnp.inf  # a NaN maximum too: the row gives NaN
  out = out.reshape(batch, num_kv, group, t_len, h)
  out = out * jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
  out = jnp.moveaxis(out, 3, 1).reshape(batch, t_len, num_heads, h)
  if sinks is not None:
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
    lse = jnp.moveaxis(lse, 3, 1).reshape(batch, t_len, num_heads)
    out, _ = sink_lib.apply_sinks(out, lse, sinks)
  return out.astype(v.dtype)


def _safe(q, k, v, visible, add, sinks, scale, precise_dims, cap=None):
  """The heads-first attention with hidden slots zeroed first: the reference of ``_heads_first``
  and the rule of its derivatives."""
  _, out, row_max, total = _heads_first_core(q, k, v, visible, add, scale, precise_dims, True, cap)
  return _heads_first_finish(q, v, out, row_max, total, sinks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _heads_first(scale, precise_dims, cap, q, k, v, visible, add, sinks):
  """Few-query attention over heads-first k ``[B, K, S, Hq]``, v ``[B, K, S, H]``: two batched
  matmuls over the cache as it lies, the hidden slots masked in the scores only.

  A slot no query sees weighs exactly 0, so it changes nothing unless it holds a NaN or inf (``0 x
  NaN``). Rather than writing a zeroed copy of the cache every call (what ``zero_hidden_keys``
  does, a cache-sized select per layer and decode step), the raw scores and the unnormalised
  ``P . V`` are checked (arrays of ``T x S`` and ``T x H`` per head): all finite, the result is
  exactly that of zeroed slots; else (a non-finite value anywhere, visible or not) the call is
  recomputed with the hidden slots zeroed (``_safe``, a ``lax.cond`` branch that runs only then).
  Derivatives (forward and reverse mode) are those of ``_safe``: a NaN in a hidden slot never
  reaches a gradient either."""
  raw, out, row_max, total = _heads_first_core(q, k, v, visible, add, scale, precise_dims, False, cap)
  ok = jnp.all(jnp.isfinite(raw)) & jnp.all(jnp.isfinite(out))
  return jax.lax.cond(
    ok,
    lambda: _heads_first_finish(q, v, out, row_max, total, sinks),
    lambda: _safe(q, k, v, visible, add, sinks, scale, precise_dims, cap),
  )


@_heads_first.defjvp
def _heads_first_jvp(scale, precise_dims, cap, primals, tangents):
  return jax.jvp(lambda *a: _safe(*a, scale, precise_dims, cap), primals, tangents)


__all__ = ["DECODE_MAX_QUERIES", "decode_attention"]


def _precise_logits(spec: str, qr: jax.Array, k: jax.Array, split: int) -> jax.Array:
  """The emulation dims' part of q.k (dims ``split:``) at float32 HIGHEST precision, float32."""
  f32 = jnp.float32
  return jnp.einsum(
    spec,
    qr[..., split:].astype(f32),
    k[..., split:].astype(f32),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=f32,
  )
