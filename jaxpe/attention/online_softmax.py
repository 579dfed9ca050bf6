"""The online-softmax kernel behind ``jaxpe.attention.blockwise.blockwise_attention``.

Queries and keys in blocks; the forward pass folds each needed block pair into a running row max,
row sum and output (FlashAttention, Dao et al. 2022, arXiv 2205.14135); the backward pass recomputes
each pair's probabilities from the saved log-sum-exp and accumulates dq, dk, dv (FlashAttention-2,
Dao 2023, arXiv 2307.08691). ``flash`` is a ``jax.custom_vjp`` over already-checked arguments; the
checks and the documented entry point are ``blockwise``'s.

Which pairs run: under an ``AttentionMask`` with square blocks (the decoder's training step) the
loops run the pairs j < i without the causal compare and the diagonal pair with it (B 8, T 512, N 8,
H 64 forward + backward: 275 -> 217 ms, the train step 1.21x -> 1.13x PyTorch's); other masks
compute the mask on every pair. Pairs no query sees are skipped by a ``lax.cond`` on the pair's
statically or dynamically known need; every loop has a fixed trip count, so the backward pass is
itself reverse-differentiable (grad of grad).

Layout inside: q blocks ``[nq, B, K, G, bq, Hq]``; k blocks ``[nk, B, K, bk, Hq]``; v blocks
``[nk, B, K, bk, H]``; per-token side arrays (slots, validity, segments, positions) ``[n, B, b]``.
Shape alphabet: B batch, T queries, S keys, N heads, K kv heads, G = N / K, H head dim.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import patterns
from jaxpe.attention.block_loops import guarded as _guarded
from jaxpe.attention.block_loops import pairs as _pairs
from jaxpe.attention.block_loops import partners as _partners
from jaxpe.attention.numerics import LOWEST as _LOWEST
from jaxpe.attention.numerics import row_seen

_INT_MAX = int(np.iinfo(np.int32).max)
# Block pairs up to this count run as straight-line code, more in loops (XLA CPU compiled 36 unrolled
# pairs for 4.5 minutes and ran them no faster than the loop).
UNROLL_PAIRS = 1


class Config(NamedTuple):
  scale: float
  precise_dims: int
  block_q: int
  block_k: int
  causal: bool
  natural: bool  # q_index = k_index = 0..T-1 (an AttentionMask): the causal skip is static
  # PositionBias.fn: fn(params, q_pos [B, bq], k_pos [B, bk]) -> [B, N, bq, bk], added per block pair
  bias_fn: Any = None
  # patterns.Pattern: local window / chunks on the slots qi, ki; soft cap of the scaled scores
  pattern: Any = None


class _Blocks(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  qi: jax.Array | None
  ki: jax.Array | None
  k_valid: jax.Array | None
  q_seg: jax.Array | None
  k_seg: jax.Array | None
  q_pos: jax.Array | None
  k_pos: jax.Array | None
  q_chunk: jax.Array | None = None  # the positions chunk_size counts (None: the slots qi, ki)
  k_chunk: jax.Array | None = None


def _pad_to(x, axis: int, size: int, value):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _split(x, axis: int, block: int, value):
  """``x`` padded along ``axis`` to whole blocks and split: ``[n, ..., block, ...]`` with n first."""
  n = -(-x.shape[axis] // block)
  x = _pad_to(x, axis, n * block, value)
  x = x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


def _to_blocks(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, chunk_pos, cfg: Config) -> _Blocks:
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  group = num_heads // num_kv
  qg = jnp.moveaxis(q.reshape(batch, t_len, num_kv, group, qk_dim), 1, 3)  # [B, K, G, T, Hq]
  padded_keys = -(-s_len // cfg.block_k) * cfg.block_k != s_len
  if padded_keys and k_valid is None:
    k_valid = jnp.ones((batch, s_len), bool)
  side = lambda x, block, value: None if x is None else _split(x, 1, block, value)  # noqa: E731
  return _Blocks(
    q=_split(qg, 3, cfg.block_q, 0),
    k=_split(jnp.moveaxis(k, 1, 2), 2, cfg.block_k, 0),
    v=_split(jnp.moveaxis(v, 1, 2), 2, cfg.block_k, 0),
    qi=side(qi, cfg.block_q, 0),
    ki=side(ki, cfg.block_k, _INT_MAX),
    k_valid=side(k_valid, cfg.block_k, False),
    q_seg=side(q_seg, cfg.block_q, 0),
    k_seg=side(k_seg, cfg.block_k, 0),
    q_pos=side(q_pos, cfg.block_q, 0),
    k_pos=side(k_pos, cfg.block_k, 0),
    q_chunk=None if chunk_pos is None else side(chunk_pos[0], cfg.block_q, 0),
    k_chunk=None if chunk_pos is None else side(chunk_pos[1], cfg.block_k, 0),
  )


def _needed(b: _Blocks, cfg: Config):
  """Which block pairs to compute: (static ``[nq, nk]`` numpy bool or None, dynamic ``[nq, nk]`` bool
  array or None); None means every pair. Natural slots (an ``AttentionMask``): the causal skip and
  the window / chunks (``patterns.static_block_need``) are static. Other slots: a pair is needed
  when its first valid key slot is at most its last query slot, its key block holds a valid key,
  and the window / chunks may join its slots (``patterns.dynamic_block_need``)."""
  nq, nk = b.q.shape[0], b.k.shape[0]
  pattern = cfg.pattern if cfg.pattern is not None and cfg.pattern.masks else None
  if cfg.natural:
    static = None
    if cfg.causal:
      first_key = np.arange(nk)[None, :] * cfg.block_k
      last_query = np.arange(nq)[:, None] * cfg.block_q + cfg.block_q - 1
      static = first_key <= last_query
    if pattern is not None:
      # chunks counted from each document's first token lie in the slot window (c - 1, c - 1)
      bound = pattern if b.q_chunk is None else pattern.slot_bound()
      local = patterns.static_block_need(bound, nq, cfg.block_q, nk, cfg.block_k)
      static = local if static is None else static & local
    return static, None
  need = None
  if cfg.causal:
    q_last = jnp.max(b.qi, axis=(1, 2))
    k_first = jnp.min(jnp.where(b.k_valid, b.ki, _INT_MAX) if b.k_valid is not None else b.ki, axis=(1, 2))
    need = k_first[None, :] <= q_last[:, None]
  if b.k_valid is not None:
    any_key = jnp.any(b.k_valid, axis=(1, 2))[None, :]
    need = any_key if need is None else need & any_key
  if pattern is not None:
    valid = jnp.ones(b.ki.shape, bool) if b.k_valid is None else b.k_valid
    k_min = jnp.min(jnp.where(valid, b.ki, _INT_MAX), axis=(1, 2))
    k_max = jnp.max(jnp.where(valid, b.ki, -1), axis=(1, 2))
    q_min, q_max = jnp.min(b.qi, axis=(1, 2)), jnp.max(b.qi, axis=(1, 2))
    chunk_range = None
    if b.q_chunk is not None:
      chunk_range = (
        jnp.min(b.q_chunk, axis=(1, 2)),
        jnp.max(b.q_chunk, axis=(1, 2)),
        jnp.min(jnp.where(valid, b.k_chunk, _INT_MAX), axis=(1, 2)),
        jnp.max(jnp.where(valid, b.k_chunk, -1), axis=(1, 2)),
      )
    local = patterns.dynamic_block_need(pattern, q_min, q_max, k_min, k_max, chunk_range)
    need = local if need is None else need & local
  return None, None if need is None else jnp.broadcast_to(need, (nq, nk))


def _side(x, i):
  return None if x is None else x[i]


def _triangular(cfg: Config) -> bool:
  """Natural causal slots (T == S) in square blocks: pair (i, j) is needed iff j <= i, and only the
  diagonal pair needs the causal mask (the loops run j < i unmasked, then the diagonal)."""
  return cfg.natural and cfg.causal and cfg.block_q == cfg.block_k


def _position_bias(b: _Blocks, i, j, bias_params, cfg: Config):
  """``cfg.bias_fn`` on query block i and key block j: ``[B, K, G, bq, bk]`` float32."""
  batch, num_kv, group, bq = b.q.shape[1:5]
  out = cfg.bias_fn(bias_params, b.q_pos[i], b.k_pos[j]).astype(jnp.float32)  # [B, N, bq, bk]
  return out.reshape(batch, num_kv, group, bq, out.shape[-1])


def _scores(
  b: _Blocks,
  i,
  j,
  slopes,
  cfg: Config,
  *,
  off_diagonal: bool = False,
  bias_params=None,
  bias=None,
  cap_grad: bool = False,
):
  """Scaled, biased, masked float32 scores ``[B, K, G, bq, bk]`` of query block i and key block j
  (``off_diagonal``: a pair of ``_triangular`` blocks with j < i, where every key precedes every
  query: no causal compare; ``bias``: the pair's ``_position_bias`` when already computed). With
  ``cap_grad``: ``(scores, d capped / d raw)`` (``1 - tanh^2``; None without a soft cap)."""
  q, k = b.q[i], b.k[j]
  split = q.shape[-1] - cfg.precise_dims
  s = jnp.einsum("BKGQH,BKSH->BKGQS", q[..., :split], k[..., :split], preferred_element_type=jnp.float32)
  if cfg.precise_dims:
    s = s + _precise("BKGQH,BKSH->BKGQS", q[..., split:], k[..., split:])
  s = s * jnp.float32(cfg.scale)
  d_cap = None
  pattern = cfg.pattern
  if pattern is not None and pattern.cap is not None:  # Gemma 2: before the bias and the mask
    t = jnp.tanh(s / jnp.float32(pattern.cap))
    s = jnp.float32(pattern.cap) * t
    d_cap = 1.0 - t * t if cap_grad else None
  if slopes is not None:
    distance = (b.q_pos[i][:, :, None] - b.k_pos[j][:, None, :]).astype(jnp.float32)  # [B, bq, bk]
    s = jnp.maximum(s - slopes[None, :, :, None, None] * distance[:, None, None], _LOWEST)
  if cfg.bias_fn is not None:
    bias = _position_bias(b, i, j, bias_params, cfg) if bias is None else bias
    s = jnp.maximum(s + bias, _LOWEST)
  visible = None
  if cfg.causal and not off_diagonal:
    visible = b.ki[j][:, None, :] <= b.qi[i][:, :, None]
  if b.k_valid is not None:
    kv = b.k_valid[j][:, None, :]
    visible = kv if visible is None else visible & kv
  if b.q_seg is not None:
    same = b.q_seg[i][:, :, None] == b.k_seg[j][:, None, :]
    visible = same if visible is None else visible & same
  if pattern is not None and pattern.masks:
    qc = kc = None
    if b.q_chunk is not None:
      qc, kc = b.q_chunk[i][:, :, None], b.k_chunk[j][:, None, :]
    local = pattern.visible(b.qi[i][:, :, None], b.ki[j][:, None, :], qc, kc)
    visible = local if visible is None else visible & local
  if visible is not None:
    s = jnp.where(visible[:, None, None], s, _LOWEST)
  return (s, d_cap) if cap_grad else s


def _precise(eq: str, a, b):
  return jnp.einsum(
    eq,
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )


def _forward(b: _Blocks, slopes, bias_params, cfg: Config):
  """(out ``[nq, B, K, G, bq, H]`` float32, lse ``[nq, B, K, G, bq]`` float32, -inf on empty rows)."""
  nq, nk = b.q.shape[0], b.k.shape[0]
  static, need = _needed(b, cfg)
  head = b.q.shape[1:5]
  h_v = b.v.shape[-1]

  def init():
    return (
      jnp.full((*head, 1), _LOWEST, jnp.float32),
      jnp.zeros((*head, 1), jnp.float32),
      jnp.zeros((*head, h_v), jnp.float32),
    )

  def step(i, j, carry, off_diagonal=False):
    m, row_sum, acc = carry
    s = _scores(b, i, j, slopes, cfg, off_diagonal=off_diagonal, bias_params=bias_params)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    row_sum = alpha * row_sum + jnp.sum(p, axis=-1, keepdims=True)
    pv = jnp.einsum("BKGQS,BKSH->BKGQH", p.astype(b.v.dtype), b.v[j], preferred_element_type=jnp.float32)
    return m_new, row_sum, alpha * acc + pv

  def finish(carry):
    m, row_sum, acc = carry
    # a row with no visible key gives zeros, as the dense reference; a NaN maximum (a NaN query, key
    # or bias among the visible scores) is seen: the row gives NaN, as the reference
    seen = row_seen(m, row_sum)
    out = jnp.where(seen, acc / jnp.where(seen, row_sum, 1.0), 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
    return out, lse[..., 0]

  guarded = functools.partial(_guarded, step, static, need)

  if _triangular(cfg) and nq * nk > UNROLL_PAIRS:
    band = _partners(static, True, nk)

    def triangle_row(i):
      # fixed trip counts (a loop up to i would be a while loop, which reverse mode cannot
      # differentiate: grad of grad goes through this forward and the backward below); with a
      # window or chunks only the band of key blocks they reach
      carry = _pairs(step, static, None, band, nk, i, init(), row=True, strict=True)
      return finish(step(i, i, carry))

    return jax.lax.map(triangle_row, jnp.arange(nq))

  if nq * nk <= UNROLL_PAIRS:
    outs, lses = [], []
    for i in range(nq):
      carry = init()
      for j in range(nk):
        carry = guarded(i, j, carry)
      out, lse = finish(carry)
      outs.append(out)
      lses.append(lse)
    return jnp.stack(outs), jnp.stack(lses)

  band = _partners(static, True, nk)

  def per_query_block(i):
    return finish(_pairs(step, static, need, band, nk, i, init(), row=True))

  return jax.lax.map(per_query_block, jnp.arange(nq))


def _backward(b: _Blocks, slopes, bias_params, cfg: Config, out, lse, d_out, d_lse):
  """(dq ``[nq, ...]``, dk ``[nk, ...]``, dv ``[nk, ...]``, d bias_params) float32, by key block with
  recomputation. The bias parameters' gradient is the vjp of ``cfg.bias_fn`` per block pair with the
  pair's score gradient as cotangent, summed over the pairs (carried with dq)."""
  nq, nk = b.q.shape[0], b.k.shape[0]
  static, need = _needed(b, cfg)
  # d(loss)/d(score) = P * (dP - delta) with delta = rowsum(dO * O) - d_lse (the lse's own gradient).
  delta = jnp.sum(d_out * out, axis=-1) - d_lse  # [nq, B, K, G, bq]
  lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse)[..., None]  # empty rows: P = 0
  split = b.q.shape[-1] - cfg.precise_dims
  f32 = dict(preferred_element_type=jnp.float32)
  scale = jnp.float32(cfg.scale)

  def step(i, j, carry, off_diagonal=False):
    dq, dk, dv, d_bias = carry  # dq [nq, ...] (all query blocks), dk / dv of key block j
    bias = bias_vjp = None
    if cfg.bias_fn is not None:  # the pair's bias and its vjp, computed once
      bias, bias_vjp = jax.vjp(lambda p: _position_bias(b, i, j, p, cfg), bias_params)
    s, d_cap = _scores(b, i, j, slopes, cfg, off_diagonal=off_diagonal, bias=bias, cap_grad=True)
    p = jnp.exp(s - lse_safe[i])
    dv = dv + jnp.einsum("BKGQS,BKGQH->BKSH", p.astype(b.v.dtype), d_out[i].astype(b.v.dtype), **f32)
    dp = jnp.einsum("BKGQH,BKSH->BKGQS", d_out[i].astype(b.v.dtype), b.v[j], **f32)
    ds = p * (dp - delta[i][..., None])
    if cfg.bias_fn is not None:  # ds is d(loss) / d(biased score); the bias enters unscaled, uncapped
      d_bias = jax.tree.map(jnp.add, d_bias, bias_vjp(ds)[0])
    if d_cap is not None:  # through the soft cap to the raw scaled scores
      ds = ds * d_cap
    q, k = b.q[i], b.k[j]
    dq_i = jnp.einsum("BKGQS,BKSH->BKGQH", ds.astype(k.dtype), k[..., :split], **f32)
    dk_j = jnp.einsum("BKGQS,BKGQH->BKSH", ds.astype(q.dtype), q[..., :split], **f32)
    if cfg.precise_dims:
      dq_i = jnp.concatenate([dq_i, _precise("BKGQS,BKSH->BKGQH", ds, k[..., split:])], axis=-1)
      dk_j = jnp.concatenate([dk_j, _precise("BKGQS,BKGQH->BKSH", ds, q[..., split:])], axis=-1)
    dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i * scale, i, 0)
    return dq, dk + dk_j * scale, dv, d_bias

  guarded = functools.partial(_guarded, step, static, need)

  dq = jnp.zeros(b.q.shape, jnp.float32)
  d_bias = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), bias_params)
  zeros_k, zeros_v = jnp.zeros(b.k.shape[1:], jnp.float32), jnp.zeros(b.v.shape[1:], jnp.float32)
  if _triangular(cfg) and nq * nk > UNROLL_PAIRS:
    band = _partners(static, False, nq)

    def triangle_column(acc, j):
      dq, d_bias = acc
      carry = step(j, j, (dq, zeros_k, zeros_v, d_bias))
      dq, dk_j, dv_j, d_bias = _pairs(step, static, None, band, nq, j, carry, row=False, strict=True)
      return (dq, d_bias), (dk_j, dv_j)

    (dq, d_bias), (dk, dv) = jax.lax.scan(triangle_column, (dq, d_bias), jnp.arange(nk))
    return dq, dk, dv, d_bias

  if nq * nk <= UNROLL_PAIRS:
    dks, dvs = [], []
    for j in range(nk):
      carry = (dq, zeros_k, zeros_v, d_bias)
      for i in range(nq):
        carry = guarded(i, j, carry)
      dq, dk_j, dv_j, d_bias = carry
      dks.append(dk_j)
      dvs.append(dv_j)
    return dq, jnp.stack(dks), jnp.stack(dvs), d_bias

  band = _partners(static, False, nq)

  def per_key_block(acc, j):
    dq, d_bias = acc
    dq, dk_j, dv_j, d_bias = _pairs(
      step, static, need, band, nq, j, (dq, zeros_k, zeros_v, d_bias), row=False
    )
    return (dq, d_bias), (dk_j, dv_j)

  (dq, d_bias), (dk, dv) = jax.lax.scan(per_key_block, (dq, d_bias), jnp.arange(nk))
  return dq, dk, dv, d_bias


def _unblock_q(x, t_len: int, num_heads: int):
  """``[nq, B, K, G, bq, X]`` -> ``[B, T, N, X]``."""
  nq, batch, num_kv, group, bq, dim = x.shape
  x = jnp.moveaxis(x, 0, 3).reshape(batch, num_kv, group, nq * bq, dim)[:, :, :, :t_len]
  return jnp.moveaxis(x, 3, 1).reshape(batch, t_len, num_heads, dim)


def _unblock_k(x, s_len: int):
  """``[nk, B, K, bk, X]`` -> ``[B, S, K, X]``."""
  nk, batch, num_kv, bk, dim = x.shape
  x = jnp.moveaxis(x, 0, 2).reshape(batch, num_kv, nk * bk, dim)[:, :, :s_len]
  return jnp.moveaxis(x, 2, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(14,))
def flash(
  q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, q_chunk, k_chunk, slopes, bias_params, cfg: Config
):
  """``(out, lse)``; ``q_chunk`` / ``k_chunk``: ``[B, T]`` / ``[B, S]`` positions the chunks count, or None."""
  args = (q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, q_chunk, k_chunk, slopes, bias_params, cfg)
  return flash_fwd(*args)[0]


def flash_fwd(
  q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, q_chunk, k_chunk, slopes, bias_params, cfg
):
  chunk_pos = None if q_chunk is None else (q_chunk, k_chunk)
  b = _to_blocks(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, chunk_pos, cfg)
  out_b, lse_b = _forward(b, slopes, bias_params, cfg)
  t_len, num_heads = q.shape[1], q.shape[2]
  out = _unblock_q(out_b, t_len, num_heads).astype(v.dtype)
  lse = _unblock_q(lse_b[..., None], t_len, num_heads)[..., 0]
  residuals = (q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, chunk_pos, slopes, bias_params, out, lse)
  return (out, lse), residuals


def flash_bwd(cfg, residuals, cotangents):
  q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, chunk_pos, slopes, bias_params, out, lse = residuals
  d_out, d_lse = cotangents
  b = _to_blocks(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, chunk_pos, cfg)
  to_q = functools.partial(_to_q_blocks, num_kv=k.shape[2], block=cfg.block_q)
  d_lse = jnp.zeros(lse.shape, jnp.float32) if d_lse is None else d_lse.astype(jnp.float32)
  dq, dk, dv, d_bias = _backward(
    b,
    slopes,
    bias_params,
    cfg,
    to_q(out.astype(jnp.float32)),
    to_q(lse[..., None], pad=jnp.inf)[..., 0],
    to_q(d_out.astype(jnp.float32)),
    to_q(d_lse[..., None])[..., 0],
  )
  dq = _unblock_q(dq, q.shape[1], q.shape[2]).astype(q.dtype)
  dk = _unblock_k(dk, k.shape[1]).astype(k.dtype)
  dv = _unblock_k(dv, k.shape[1]).astype(v.dtype)
  d_bias = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), d_bias, bias_params)
  return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None, d_bias)


def _to_q_blocks(x, *, num_kv: int, block: int, pad=0.0):
  """``[B, T, N, X]`` -> ``[nq, B, K, G, bq, X]`` (padding rows hold ``pad``)."""
  batch, t_len, num_heads, dim = x.shape
  x = jnp.moveaxis(x.reshape(batch, t_len, num_kv, num_heads // num_kv, dim), 1, 3)
  return _split(x, 3, block, pad)


flash.defvjp(flash_fwd, flash_bwd)
