"""Blockwise attention in plain XLA: FlashAttention's online softmax over key blocks, O(T) memory.

``blockwise_attention`` never writes a ``[B, N, T, S]`` array: queries and keys go in blocks, each
block pair's scores, mask and ALiBi bias are computed from the blocks' slot indices and positions and
folded into a running row max, row sum and output (the online softmax of FlashAttention, Dao et al.
2022, arXiv 2205.14135; Rabe & Staats 2021, arXiv 2112.05682). The backward pass recomputes each
block pair's probabilities from the saved log-sum-exp (FlashAttention-2's, Dao 2023, arXiv
2307.08691): memory is O(T x block) in both passes. Block pairs that no query of the pair may see
(causal: keys after the block's last query; keys that are all padding or empty cache slots) are
skipped, not computed and masked.

It is the ``xla`` backend's path for structured masks (``AttentionMask``, ``IndexMask``) and ALiBi
(``AlibiSpec``); the dense ``jaxpe.attention.reference.dot_product_attention`` stays the reference
(and the path for a dense bias or dense mask a caller built). ``return_lse`` and
``combine_partials`` serve attention split over key shards (context parallelism).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, G = N / K query
heads per kv head, H head dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.masks import AttentionMask, IndexMask, dense_segment_ids
from jaxpe.attention.reference import check_scale
from jaxpe.ops import checks as _checks

_LOWEST = float(jnp.finfo(jnp.float32).min)
_INT_MAX = int(np.iinfo(np.int32).max)
# Query and key block sizes when the caller gives none: 128 up to T = 2048 (on CPU the causal skip
# pays for the smaller matmuls), 512 above (fewer loop iterations; at T 16k, N 16 one block pair's
# float32 scores are 16 MiB).
SMALL_BLOCK, LARGE_BLOCK, LARGE_FROM = 128, 512, 2048
# Block pairs up to this count run as straight-line code (XLA fuses across them); more run in loops.
UNROLL_PAIRS = 16


def default_block(length: int) -> int:
  """The block size ``blockwise_attention`` uses for ``length`` queries or keys when given none."""
  return SMALL_BLOCK if length <= LARGE_FROM else LARGE_BLOCK


class _Config(NamedTuple):
  scale: float
  precise_dims: int
  block_q: int
  block_k: int
  causal: bool
  natural: bool  # q_index = k_index = 0..T-1 (an AttentionMask): the causal skip is static


def blockwise_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: IndexMask | AttentionMask | None = None,
  alibi: AlibiSpec | None = None,
  precise_dims: int = 0,
  block_q: int | None = None,
  block_k: int | None = None,
  return_lse: bool = False,
):
  """``softmax(q.k * scale + ALiBi, masked) . v`` by key blocks, with float32 scores and softmax.

  Equal to ``jaxpe.attention.dot_product_attention`` with ``bias=alibi_bias(...)`` and
  ``mask=mask.dense()`` to float32 rounding (the online softmax rescales partial sums), including
  its rules: a row with no visible key gives zeros (and zero gradients); the last ``precise_dims``
  dims of q and k are contracted in float32 at ``precision=HIGHEST`` in both passes; grouped-query
  heads share their kv head without repeating it.

  Args:
    q: ``[B, T, N, Hq]`` float queries.
    k: ``[B, S, K, Hq]`` float keys; ``N % K == 0``.
    v: ``[B, S, K, H]`` float values.
    scale: multiplies q.k, a concrete number > 0 (usually ``1/sqrt(H)``).
    mask: optional ``IndexMask`` (slot indices, causal, key validity, segment ids), or an
      ``AttentionMask`` (self-attention in slot order, T == S: its causal key blocks after a query
      block are skipped without looking at the data); None: every key visible.
    alibi: optional ``AlibiSpec``: the bias ``-m_h (i - j)`` from ``slopes [N]`` and its
      ``q_positions [B, T]`` / ``k_positions [B, S]`` (token indices), computed per block.
      Checked by the caller (``attention`` checks it); ``form`` and ``max_position`` are not used.
    precise_dims: trailing dims of q and k contracted at float32 ``HIGHEST`` precision; 0..Hq.
    block_q, block_k: query / key block sizes, ints > 0; default ``default_block(T)`` /
      ``default_block(S)``. T and S need not be multiples (the last block is padded, padded keys
      are invisible).
    return_lse: also return the log-sum-exp of each row's scaled, biased scores.

  Returns:
    ``[B, T, N, H]`` of ``v.dtype``; with ``return_lse`` also ``[B, T, N]`` float32 log-sum-exp
    (``-inf`` on rows with no visible key). Both are differentiable in q, k, v (reverse mode:
    ``jax.grad``, ``jax.vjp``; forward mode raises jax's custom_vjp TypeError).

  Raises:
    ValueError: ranks or sizes that do not fit (B, S, K, Hq, N % K, no heads), ``scale`` not a
      finite number > 0, ``precise_dims`` outside 0..Hq, a block size not an int > 0, mask or ALiBi
      arrays not of their ``[B, T]`` / ``[B, S]`` shapes or slopes not ``[N]``.
    TypeError: non-float q, k, v; a traced ``scale``; mask fields of the wrong dtype; ``mask`` not
      an ``IndexMask`` or ``alibi`` not an ``AlibiSpec``.

  Memory: the residuals of the backward pass are q, k, v, the output and the ``[B, T, N]``
  log-sum-exp; each pass holds a few ``[B, N, block_q, block_k]`` float32 temporaries at a time.
  """
  for name, arr, hint in (("q", q, "[B, T, N, Hq]"), ("k", k, "[B, S, K, Hq]"), ("v", v, "[B, S, K, H]")):
    _checks.check_rank(name, arr, 4, hint)
    _checks.check_float(name, arr)
  scale = check_scale("scale", scale)
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if num_heads == 0 or num_kv == 0:
    raise ValueError(f"q and k need at least one head (N >= 1, K >= 1), got N={num_heads}, K={num_kv}")
  if num_heads % num_kv or k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != qk_dim:
    raise ValueError(
      f"q, k, v must be [B,T,N,Hq], [B,S,K,Hq], [B,S,K,H] with N % K == 0, got {q.shape}, {k.shape}, {v.shape}"
    )
  if isinstance(precise_dims, bool) or not isinstance(precise_dims, int | np.integer):
    raise TypeError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  if not 0 <= precise_dims <= qk_dim:
    raise ValueError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  block_q = _check_block("block_q", block_q, t_len)
  block_k = _check_block("block_k", block_k, s_len)
  natural = isinstance(mask, AttentionMask)
  if natural:
    if s_len != t_len:
      raise ValueError(f"an AttentionMask is for self-attention (T == S), got T={t_len}, S={s_len}")
    mask = mask.check(batch, t_len)
    mask = self_attention_mask(mask.valid, mask.segment_ids, causal=mask.causal, batch=batch, length=t_len)
  elif mask is not None and not isinstance(mask, IndexMask):
    raise TypeError(f"mask must be an IndexMask, an AttentionMask or None, got {type(mask).__name__}")
  if alibi is not None and not isinstance(alibi, AlibiSpec):
    raise TypeError(f"alibi must be an AlibiSpec or None, got {type(alibi).__name__}")
  if mask is not None:
    mask = mask.check()
    if mask.q_index.shape != (batch, t_len) or mask.k_index.shape != (batch, s_len):
      raise ValueError(
        f"mask.q_index / mask.k_index must have shapes [B, T] = {[batch, t_len]} / [B, S] = "
        f"{[batch, s_len]}, got {tuple(mask.q_index.shape)} / {tuple(mask.k_index.shape)}"
      )
  slopes = q_pos = k_pos = None
  if alibi is not None:
    slopes = np.asarray(alibi.slopes, np.float32)
    q_pos, k_pos = jnp.asarray(alibi.q_positions), jnp.asarray(alibi.k_positions)
    if slopes.shape != (num_heads,) or q_pos.shape != (batch, t_len) or k_pos.shape != (batch, s_len):
      raise ValueError(
        f"alibi slopes / q_positions / k_positions must be [N] / [B, T] / [B, S] = {[num_heads]} / "
        f"{[batch, t_len]} / {[batch, s_len]}, got {slopes.shape} / {q_pos.shape} / {k_pos.shape}"
      )
    slopes = jnp.asarray(slopes.reshape(num_kv, num_heads // num_kv))
  out_shape = (batch, t_len, num_heads, v.shape[-1])
  if t_len == 0 or s_len == 0:
    out = jnp.zeros(out_shape, v.dtype)
    lse = jnp.full(out_shape[:3], -jnp.inf, jnp.float32)
    return (out, lse) if return_lse else out
  causal = mask is not None and mask.causal
  cfg = _Config(float(scale), int(precise_dims), block_q, block_k, causal, natural)
  qi = ki = k_valid = q_seg = k_seg = None
  if mask is not None:
    qi, ki, k_valid = mask.q_index.astype(jnp.int32), mask.k_index.astype(jnp.int32), mask.k_valid
    q_seg, k_seg = _exact_segment_ids(mask.q_segment_ids, mask.k_segment_ids)
    k_valid = None if k_valid is None else k_valid.astype(bool)
  out, lse = _flash(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, slopes, cfg)
  return (out, lse) if return_lse else out


def self_attention_mask(valid, segment_ids, *, causal: bool, batch: int, length: int) -> IndexMask:
  """The ``IndexMask`` of an ``AttentionMask``'s fields: slots ``0..T-1`` for queries and keys."""
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  return IndexMask(index, index, causal, valid, segment_ids, segment_ids)


def combine_partials(out_a, lse_a, out_b, lse_b):
  """Merges two attentions of the same queries over disjoint key sets into the attention over both.

  ``out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b)``, ``lse = log(e^lse_a + e^lse_b)``,
  computed from the larger lse (no overflow); a side with ``lse = -inf`` (no visible key) weighs 0,
  and both at ``-inf`` give zeros and ``-inf`` (finite gradients everywhere, no NaN).

  Args:
    out_a, out_b: ``[B, T, N, H]`` outputs of ``blockwise_attention(..., return_lse=True)``.
    lse_a, lse_b: ``[B, T, N]`` float32 log-sum-exps of the same calls.

  Returns:
    ``(out [B, T, N, H] of out_a's dtype, lse [B, T, N] float32)``.
  """
  lse_a, lse_b = lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)
  top = jnp.maximum(lse_a, lse_b)
  empty = top == -jnp.inf
  safe_top = jnp.where(empty, 0.0, top)
  w_a = jnp.exp(jnp.where(empty, -jnp.inf, lse_a - safe_top))
  w_b = jnp.exp(jnp.where(empty, -jnp.inf, lse_b - safe_top))
  total = w_a + w_b
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
  out = (
    out_a.astype(jnp.float32) * (w_a * inv)[..., None] + out_b.astype(jnp.float32) * (w_b * inv)[..., None]
  )
  lse = jnp.where(empty, -jnp.inf, safe_top + jnp.log(jnp.where(empty, 1.0, total)))
  return out.astype(out_a.dtype), lse


def _exact_segment_ids(q_seg, k_seg):
  """Segment ids jax can hold without merging any two: numpy ids wider than int32 (which jax without
  x64 would wrap: int64 0 and 2^32 would become one document) are ranked jointly, exactly."""
  if q_seg is None or not (isinstance(q_seg, np.ndarray) or isinstance(k_seg, np.ndarray)):
    return q_seg, k_seg
  q_np, k_np = np.asarray(q_seg), np.asarray(k_seg)
  if np.can_cast(q_np.dtype, np.int32) and np.can_cast(k_np.dtype, np.int32):
    return q_seg, k_seg
  ranked = dense_segment_ids(np.concatenate([q_np, k_np], axis=1))
  return ranked[:, : q_np.shape[1]], ranked[:, q_np.shape[1] :]


def _check_block(name: str, block, length: int) -> int:
  if block is None:
    return default_block(length)
  if isinstance(block, bool) or not isinstance(block, int | np.integer) or block <= 0:
    raise ValueError(f"{name} must be an int > 0 (block size in tokens), got {block!r}")
  return int(block)


# ---------------------------------------------------------------------------------------------------
# The kernel. Layout inside: q blocks [nq, B, K, G, bq, Hq]; k blocks [nk, B, K, bk, Hq]; v blocks
# [nk, B, K, bk, H]; per-token side arrays (slots, validity, segments, positions) [n, B, b].


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


def _to_blocks(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, cfg: _Config) -> _Blocks:
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
  )


def _needed(b: _Blocks, cfg: _Config):
  """Which block pairs to compute: (static ``[nq, nk]`` numpy bool or None, dynamic ``[nq, nk]`` bool
  array or None); None means every pair. Natural slots (an ``AttentionMask``): the causal skip is
  static (key block j starts after query block i ends). Other slots: a pair is needed when its first
  valid key slot is at most its last query slot, and its key block holds a valid key."""
  nq, nk = b.q.shape[0], b.k.shape[0]
  if cfg.natural:
    if not cfg.causal:
      return None, None
    first_key = np.arange(nk)[None, :] * cfg.block_k
    last_query = np.arange(nq)[:, None] * cfg.block_q + cfg.block_q - 1
    return first_key <= last_query, None
  need = None
  if cfg.causal:
    q_last = jnp.max(b.qi, axis=(1, 2))
    k_first = jnp.min(jnp.where(b.k_valid, b.ki, _INT_MAX) if b.k_valid is not None else b.ki, axis=(1, 2))
    need = k_first[None, :] <= q_last[:, None]
  if b.k_valid is not None:
    any_key = jnp.any(b.k_valid, axis=(1, 2))[None, :]
    need = any_key if need is None else need & any_key
  return None, None if need is None else jnp.broadcast_to(need, (nq, nk))


def _side(x, i):
  return None if x is None else x[i]


def _scores(b: _Blocks, i, j, slopes, cfg: _Config):
  """Scaled, biased, masked float32 scores ``[B, K, G, bq, bk]`` of query block i and key block j."""
  q, k = b.q[i], b.k[j]
  split = q.shape[-1] - cfg.precise_dims
  s = jnp.einsum("BKGQH,BKSH->BKGQS", q[..., :split], k[..., :split], preferred_element_type=jnp.float32)
  if cfg.precise_dims:
    s = s + _precise("BKGQH,BKSH->BKGQS", q[..., split:], k[..., split:])
  s = s * jnp.float32(cfg.scale)
  if slopes is not None:
    distance = (b.q_pos[i][:, :, None] - b.k_pos[j][:, None, :]).astype(jnp.float32)  # [B, bq, bk]
    s = jnp.maximum(s - slopes[None, :, :, None, None] * distance[:, None, None], _LOWEST)
  visible = None
  if cfg.causal:
    visible = b.ki[j][:, None, :] <= b.qi[i][:, :, None]
  if b.k_valid is not None:
    kv = b.k_valid[j][:, None, :]
    visible = kv if visible is None else visible & kv
  if b.q_seg is not None:
    same = b.q_seg[i][:, :, None] == b.k_seg[j][:, None, :]
    visible = same if visible is None else visible & same
  if visible is not None:
    s = jnp.where(visible[:, None, None], s, _LOWEST)
  return s


def _precise(eq: str, a, b):
  return jnp.einsum(
    eq,
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )


def _guarded(step, static, need, i, j, carry):
  """``step(i, j, carry)`` where block pair (i, j) is needed, else ``carry``; i, j Python ints
  (straight-line code: static pairs are left out) or traced (loops: a ``lax.cond``)."""
  if static is not None:
    if isinstance(i, int) and isinstance(j, int):
      if not static[i, j]:
        return carry
    else:
      need = jnp.asarray(static) if need is None else need & jnp.asarray(static)
  if need is None:
    return step(i, j, carry)
  return jax.lax.cond(need[i, j], lambda c: step(i, j, c), lambda c: c, carry)


def _forward(b: _Blocks, slopes, cfg: _Config):
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

  def step(i, j, carry):
    m, row_sum, acc = carry
    s = _scores(b, i, j, slopes, cfg)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    row_sum = alpha * row_sum + jnp.sum(p, axis=-1, keepdims=True)
    pv = jnp.einsum("BKGQS,BKSH->BKGQH", p.astype(b.v.dtype), b.v[j], preferred_element_type=jnp.float32)
    return m_new, row_sum, alpha * acc + pv

  def finish(carry):
    m, row_sum, acc = carry
    seen = m > _LOWEST  # a row with no visible key gives zeros, as the dense reference
    out = jnp.where(seen, acc / jnp.where(seen, row_sum, 1.0), 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
    return out, lse[..., 0]

  guarded = functools.partial(_guarded, step, static, need)

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

  def per_query_block(i):
    return finish(jax.lax.fori_loop(0, nk, lambda j, c: guarded(i, j, c), init()))

  return jax.lax.map(per_query_block, jnp.arange(nq))


def _backward(b: _Blocks, slopes, cfg: _Config, out, lse, d_out, d_lse):
  """(dq ``[nq, ...]``, dk ``[nk, ...]``, dv ``[nk, ...]``) float32, by key block with recomputation."""
  nq, nk = b.q.shape[0], b.k.shape[0]
  static, need = _needed(b, cfg)
  # d(loss)/d(score) = P * (dP - delta) with delta = rowsum(dO * O) - d_lse (the lse's own gradient).
  delta = jnp.sum(d_out * out, axis=-1) - d_lse  # [nq, B, K, G, bq]
  lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse)[..., None]  # empty rows: P = 0
  split = b.q.shape[-1] - cfg.precise_dims
  f32 = dict(preferred_element_type=jnp.float32)
  scale = jnp.float32(cfg.scale)

  def step(i, j, carry):
    dq, dk, dv = carry  # dq [nq, ...] (all query blocks), dk / dv of key block j
    s = _scores(b, i, j, slopes, cfg)
    p = jnp.exp(s - lse_safe[i])
    dv = dv + jnp.einsum("BKGQS,BKGQH->BKSH", p.astype(b.v.dtype), d_out[i].astype(b.v.dtype), **f32)
    dp = jnp.einsum("BKGQH,BKSH->BKGQS", d_out[i].astype(b.v.dtype), b.v[j], **f32)
    ds = p * (dp - delta[i][..., None])
    q, k = b.q[i], b.k[j]
    dq_i = jnp.einsum("BKGQS,BKSH->BKGQH", ds.astype(k.dtype), k[..., :split], **f32)
    dk_j = jnp.einsum("BKGQS,BKGQH->BKSH", ds.astype(q.dtype), q[..., :split], **f32)
    if cfg.precise_dims:
      dq_i = jnp.concatenate([dq_i, _precise("BKGQS,BKSH->BKGQH", ds, k[..., split:])], axis=-1)
      dk_j = jnp.concatenate([dk_j, _precise("BKGQS,BKGQH->BKSH", ds, q[..., split:])], axis=-1)
    dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i * scale, i, 0)
    return dq, dk + dk_j * scale, dv

  guarded = functools.partial(_guarded, step, static, need)

  dq = jnp.zeros(b.q.shape, jnp.float32)
  zeros_k, zeros_v = jnp.zeros(b.k.shape[1:], jnp.float32), jnp.zeros(b.v.shape[1:], jnp.float32)
  if nq * nk <= UNROLL_PAIRS:
    dks, dvs = [], []
    for j in range(nk):
      carry = (dq, zeros_k, zeros_v)
      for i in range(nq):
        carry = guarded(i, j, carry)
      dq, dk_j, dv_j = carry
      dks.append(dk_j)
      dvs.append(dv_j)
    return dq, jnp.stack(dks), jnp.stack(dvs)

  def per_key_block(dq, j):
    dq, dk_j, dv_j = jax.lax.fori_loop(0, nq, lambda i, c: guarded(i, j, c), (dq, zeros_k, zeros_v))
    return dq, (dk_j, dv_j)

  dq, (dk, dv) = jax.lax.scan(per_key_block, dq, jnp.arange(nk))
  return dq, dk, dv


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _flash(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, slopes, cfg: _Config):
  return _flash_fwd(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, slopes, cfg)[0]


def _flash_fwd(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, slopes, cfg):
  b = _to_blocks(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, cfg)
  out_b, lse_b = _forward(b, slopes, cfg)
  t_len, num_heads = q.shape[1], q.shape[2]
  out = _unblock_q(out_b, t_len, num_heads).astype(v.dtype)
  lse = _unblock_q(lse_b[..., None], t_len, num_heads)[..., 0]
  residuals = (q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, slopes, out, lse)
  return (out, lse), residuals


def _flash_bwd(cfg, residuals, cotangents):
  q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, slopes, out, lse = residuals
  d_out, d_lse = cotangents
  b = _to_blocks(q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, cfg)
  to_q = functools.partial(_to_q_blocks, num_kv=k.shape[2], block=cfg.block_q)
  d_lse = jnp.zeros(lse.shape, jnp.float32) if d_lse is None else d_lse.astype(jnp.float32)
  dq, dk, dv = _backward(
    b,
    slopes,
    cfg,
    to_q(out.astype(jnp.float32)),
    to_q(lse[..., None], pad=jnp.inf)[..., 0],
    to_q(d_out.astype(jnp.float32)),
    to_q(d_lse[..., None])[..., 0],
  )
  dq = _unblock_q(dq, q.shape[1], q.shape[2]).astype(q.dtype)
  dk = _unblock_k(dk, k.shape[1]).astype(k.dtype)
  dv = _unblock_k(dv, k.shape[1]).astype(v.dtype)
  return (dq, dk, dv, None, None, None, None, None, None, None, None)


def _to_q_blocks(x, *, num_kv: int, block: int, pad=0.0):
  """``[B, T, N, X]`` -> ``[nq, B, K, G, bq, X]`` (padding rows hold ``pad``)."""
  batch, t_len, num_heads, dim = x.shape
  x = jnp.moveaxis(x.reshape(batch, t_len, num_kv, num_heads // num_kv, dim), 1, 3)
  return _split(x, 3, block, pad)


_flash.defvjp(_flash_fwd, _flash_bwd)

__all__ = ["blockwise_attention", "combine_partials", "default_block", "self_attention_mask"]
