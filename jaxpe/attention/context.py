"""Context parallelism: attention over a sequence split across devices, and the load-balanced
(zig-zag) token order for causal masks.

With C devices on a ``context`` mesh axis, each holds T / C of the queries, keys and values.
``context_attention`` lets every query see every key, two ways (the same result):

- ``all_gather``: each device gathers all keys and values (with their slot indices, validity,
  segment ids and positions) and attends its queries to them (MaxText's default strategy).
- ``ring``: keys and values travel around the devices (``jax.lax.ppermute``); at each of the C
  steps a device attends its queries to the chunk visiting it and merges the partial result into
  its running one with the online-softmax rule (``blockwise.combine_partials``). Each device holds
  T / C keys at a time, in the backward pass too (it runs the ring again, each chunk's key and value
  gradients travelling with it; Liu et al., Ring Attention, arXiv 2310.01889).

Causality compares each token's original slot (``IndexMask.q_index`` / ``k_index``), never its place in the
split sequence, so any token order is correct. Under a causal mask the natural split gives the last device 2C
- 1 times the visible query-key pairs of the first; the zig-zag order (``zigzag_order``: the sequence cut into
2C chunks, device i holding chunks i and 2C-1-i, as in Megatron-LM's and MaxText's load-balanced context
parallelism) gives every device the same work. Positions (RoPE, xPos, ALiBi, the rope_alibi emulation, a learned
``PositionBias`` such as T5's, Kerple's or FIRE's, whose parameters every shard holds whole) travel with their tokens: the caller reorders tokens, positions, slot indices, validity and segment ids together
(``to_zigzag``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
C context shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpe.attention import blockwise, numerics, patterns, reference
from jaxpe.attention.backends import AlibiSpec, check_alibi_spec
from jaxpe.attention.masks import IndexMask
from jaxpe.attention.position_bias import PositionBias, check_position_bias
from jaxpe.ops import checks as _checks

STRATEGIES: tuple[str, ...] = ("all_gather", "ring")
"""The ways ``context_attention`` reaches the keys of the other shards."""


# --- zig-zag order -------------------------------------------------------------------------------


def zigzag_order(length: int, shards: int) -> np.ndarray:
  """``[T]`` int32: the original slot of the token at each place of the zig-zag order.

  The T slots are cut into 2C chunks of T / 2C; shard i (places ``i T/C .. (i+1) T/C - 1``) holds
  chunks i and 2C-1-i, so under a causal mask every shard has the same number of visible
  query-key pairs. ``shards`` = 1 gives ``0..T-1``.

  Raises:
    ValueError: ``shards`` not an int >= 1, or ``length`` not a positive multiple of 2 x ``shards``
      (for ``shards`` > 1).
  """
  shards = _checks.check_positive_int("shards", shards)
  length = _checks.check_positive_int("length", length)
  if shards == 1:
    return np.arange(length, dtype=np.int32)
  if length % (2 * shards):
    raise ValueError(
      f"the sequence length T ({length}) must be divisible by 2 x shards = {2 * shards}: the zig-zag order "
      "cuts it into 2 chunks per context shard"
    )
  chunks = np.arange(length, dtype=np.int32).reshape(2 * shards, length // (2 * shards))
  return chunks[[c for i in range(shards) for c in (i, 2 * shards - 1 - i)]].reshape(-1)


def to_zigzag(x, shards: int, *, axis: int = 1):
  """``x`` with its ``axis`` (T, default 1: ``[B, T, ...]``) put in zig-zag order (``zigzag_order``);
  numpy in, numpy out. Raises ValueError as ``zigzag_order``."""
  order = zigzag_order(x.shape[axis], shards)
  return np.take(x, order, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, order, axis=axis)


def from_zigzag(x, shards: int, *, axis: int = 1):
  """The inverse of ``to_zigzag``: ``x`` in zig-zag order along ``axis`` back in slot order."""
  inverse = np.argsort(zigzag_order(x.shape[axis], shards)).astype(np.int32)
  return np.take(x, inverse, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, inverse, axis=axis)


# --- attention across shards ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Local:
  """The static settings of the per-shard computation."""

  scale: float
  causal: bool
  precise_dims: int
  slopes: tuple[float, ...] | None
  axes: tuple[str, ...]
  shards: int
  bias_fn: Any = None  # PositionBias.fn
  pattern: Any = None  # patterns.Pattern (window and chunks on the original slots, soft cap)


def context_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mesh: jax.sharding.Mesh,
  axes: str | Sequence[str] = "context",
  strategy: str = "all_gather",
  mask: IndexMask | None = None,
  alibi: AlibiSpec | None = None,
  precise_dims: int | None = None,
  position_bias: PositionBias | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
) -> jax.Array:
  """``softmax(softcap(q.k * scale) + ALiBi, masked) . v`` with T and S split over the mesh ``axes``.

  Runs a ``jax.shard_map`` that is manual over ``axes`` only (the other mesh axes, e.g. the batch
  over ``data`` and the heads over ``tensor``, stay with the compiler). Equal to the dense
  reference (``dot_product_attention`` with ``mask.dense()`` and the ALiBi bias) to float32
  rounding, in value and gradients (reverse mode), for either ``strategy``.

  Args:
    q: ``[B, T, N, Hq]`` float queries, T divisible by C (the product of the ``axes`` sizes).
    k: ``[B, S, K, Hq]`` float keys, S divisible by C; ``N % K == 0``.
    v: ``[B, S, K, H]`` float values.
    scale: multiplies q.k, a concrete number > 0.
    mesh: the mesh holding ``axes``.
    axes: the mesh axis (or axes) the sequence is split over; default ``"context"``.
    strategy: ``"all_gather"`` or ``"ring"`` (``STRATEGIES``).
    mask: an ``IndexMask`` whose ``q_index [B, T]`` / ``k_index [B, S]`` are each token's ORIGINAL
      slot (causality compares them, whatever the order of the split sequence), with optional key
      validity and segment ids; None: every key visible.
    alibi: optional ``AlibiSpec`` (``q_positions [B, T]``, ``k_positions [B, S]`` travelling with
      their tokens); the bias is native (the ``xla`` form), ``form`` is not used.
    precise_dims: trailing dims of q and k contracted in float32 at ``HIGHEST`` (the rope_alibi
      emulation dims), 0..Hq; default None: the dims beyond v's width, ``Hq - H``.
    position_bias: optional ``PositionBias`` (T5, Kerple, FIRE): its positions travel with their tokens, its
      parameters are replicated on every shard (their gradient is the sum of the shards'); not
      with ``alibi``.
    local_window_size, chunk_size, logits_soft_cap: the attention pattern of
      ``jaxpe.attention.attention``; the window compares the ORIGINAL slots (``mask``'s
      ``q_index`` / ``k_index``; without a mask ``0..T-1`` / ``0..S-1``), the chunks the mask's
      ``q_positions`` / ``k_positions`` when given (else the same slots), which travel with their
      tokens, so a zig-zag order is correct; each shard's key blocks outside the window are skipped (``blockwise``).

  Returns:
    ``[B, T, N, H]`` of ``v.dtype``, split like q. A row with no visible key gives zeros, a row
    whose visible scores hold a NaN gives NaN; padding keys (``k_valid`` False) and slots after
    every query never reach the result, even NaN; segment ids of any integer width are compared
    exactly (ranked jointly before the ``shard_map``; ``jaxpe.attention.numerics``); B, T or
    S = 0 gives the zeros of that shape (as the dense reference), without a collective.

  Raises:
    ValueError: ``strategy`` not in ``STRATEGIES``; an axis not in ``mesh``; T or S not divisible
      by C; ranks or sizes that do not fit (as ``dot_product_attention``); mask or ALiBi arrays not
      ``[B, T]`` / ``[B, S]``.
    TypeError: ``mask`` not an ``IndexMask``, ``alibi`` not an ``AlibiSpec``, ``position_bias`` not a
      ``PositionBias`` (and as ``jaxpe.attention.position_bias.check_position_bias``).
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  missing = [a for a in axes if a not in mesh.shape]
  if not axes or missing:
    raise ValueError(f"axes must name mesh axes of {tuple(mesh.shape)}, got {list(axes)}")
  q, k, v = (_checks.as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
  for name, arr, hint in (("q", q, "[B, T, N, Hq]"), ("k", k, "[B, S, K, Hq]"), ("v", v, "[B, S, K, H]")):
    _checks.check_rank(name, arr, 4, hint)
    _checks.check_float(name, arr)
  scale = reference.check_scale("scale", scale)
  precise_dims = reference.default_precise_dims(precise_dims, q.shape[-1], v.shape[-1])
  pattern = patterns.check_pattern(local_window_size, chunk_size, logits_soft_cap)
  patterns.check_cap_precise_dims(pattern, precise_dims)
  shards = math.prod(mesh.shape[a] for a in axes)
  batch, t_len, s_len = q.shape[0], q.shape[1], k.shape[1]
  if t_len % shards or s_len % shards:
    raise ValueError(
      f"T ({t_len}) and S ({s_len}) must be divisible by the {shards} shards of the mesh axes {list(axes)}"
    )
  if mask is not None:
    if not isinstance(mask, IndexMask):
      raise TypeError(f"mask must be an IndexMask or None, got {type(mask).__name__}")
    mask = mask.check()
  elif pattern.masks:  # the window compares slots: without a mask, the tokens' own order 0..T-1 / 0..S-1
    mask = IndexMask(
      jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len)),
      jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32), (batch, s_len)),
      causal=False,
    )
  if alibi is not None:
    alibi = check_alibi_spec(alibi, batch, t_len, s_len, q.shape[2], fused=False)
  if position_bias is not None:
    if alibi is not None:
      raise ValueError("give alibi or position_bias, not both (one position bias per attention)")
    position_bias = check_position_bias(position_bias, batch, t_len, s_len, q.shape[2])
  q_side = k_side = (None, None, None)
  chunk_side = (None, None)  # the positions the chunks count (IndexMask.q_positions / k_positions)
  if mask is not None:  # wide ids ranked jointly here: inside the shard_map they would be int32
    q_seg, k_seg = numerics.canonical_segment_ids(mask.q_segment_ids, mask.k_segment_ids)
    q_side = (mask.q_index, q_seg, None)
    k_side = (mask.k_index, k_seg, mask.k_valid)
    if pattern.chunk is not None and mask.q_positions is not None:
      chunk_side = (mask.q_positions, mask.k_positions)
  slopes = None
  if alibi is not None:
    slopes = tuple(float(x) for x in np.asarray(alibi.slopes, np.float64))
    q_side, k_side = (*q_side[:2], alibi.q_positions), (*k_side, alibi.k_positions)
  elif position_bias is not None:  # the bias's positions travel where ALiBi's would
    q_side, k_side = (*q_side[:2], position_bias.q_positions), (*k_side, position_bias.k_positions)
  else:
    k_side = (*k_side, None)
  for name, arr, length in zip(
    ("q_index", "q_segment_ids", "q_positions", "k_index", "k_segment_ids", "k_valid", "k_positions"),
    (*q_side, *k_side),
    (t_len,) * 3 + (s_len,) * 4,
  ):
    if arr is not None and tuple(arr.shape) != (batch, length):
      raise ValueError(f"{name} must have shape [B, {'T' if name[0] == 'q' else 'S'}] = {[batch, length]}")
  q_side, k_side = (*q_side, chunk_side[0]), (*k_side, chunk_side[1])  # travel with their tokens
  if 0 in (batch, t_len, s_len):
    # nothing to split (a collective of empty shards does not lower): the dense reference's result,
    # zeros of [B, T, N, H] (rows without keys give zeros; no rows give an empty array)
    return jnp.zeros((batch, t_len, q.shape[2], v.shape[-1]), v.dtype)
  cfg = _Local(
    float(scale),
    bool(mask is not None and mask.causal),
    int(precise_dims),
    slopes,
    axes,
    shards,
    None if position_bias is None else position_bias.fn,
    pattern if pattern.active else None,
  )
  body = functools.partial(_ring if strategy == "ring" else _all_gather, cfg=cfg)
  split = P(None, axes[0] if len(axes) == 1 else axes)
  # check_vma=False: blockwise's loops start from constants (not varying over the manual axes) that
  # its steps turn into per-shard values, which the varying-axes check refuses in lax.cond / scan.
  # the bias parameters are whole on every shard (P()): shard_map's transpose sums their gradient
  mapped = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=((split,) * 5) + (P(),),
    out_specs=split,
    axis_names=frozenset(axes),
    check_vma=False,
  )
  return mapped(q, k, v, q_side, k_side, None if position_bias is None else position_bias.params)


def _attend(q, k, v, q_side, k_side, params, cfg: _Local, *, with_lse: bool):
  """Local blockwise attention of ``q`` to the keys ``k, v`` with their side arrays: ``out [B, t,
  N, H]`` (``v.dtype``), and with ``with_lse`` also the float32 log-sum-exp ``[B, t, N]`` (-inf: no
  visible key)."""
  q_index, q_seg, q_pos, q_chunk = q_side
  k_index, k_seg, k_valid, k_pos, k_chunk = k_side
  mask = (
    None
    if q_index is None
    else IndexMask(q_index, k_index, cfg.causal, k_valid, q_seg, k_seg, q_chunk, k_chunk)
  )
  alibi = None
  if cfg.slopes is not None:  # blockwise reads slopes and positions only
    alibi = AlibiSpec(np.asarray(cfg.slopes, np.float64), q_pos, k_pos, max_position=2**24)
  bias = None if cfg.bias_fn is None else PositionBias(cfg.bias_fn, params, q_pos, k_pos)
  pattern = cfg.pattern or patterns.Pattern()
  return blockwise.blockwise_attention(
    q,
    k,
    v,
    scale=cfg.scale,
    mask=mask,
    alibi=alibi,
    position_bias=bias,
    precise_dims=cfg.precise_dims,
    return_lse=with_lse,
    local_window_size=pattern.window,
    chunk_size=pattern.chunk,
    logits_soft_cap=pattern.cap,
  )


def _all_gather(q, k, v, q_side, k_side, params, *, cfg: _Local):
  """Per shard: gather every shard's keys, values and key-side arrays, attend the local queries."""

  def gather(x):
    return None if x is None else jax.lax.all_gather(x, cfg.axes, axis=1, tiled=True)

  k, v = gather(k), gather(v)
  k_side = tuple(gather(x) for x in k_side)
  return _attend(q, k, v, q_side, k_side, params, cfg, with_lse=False)


def _ring(q, k, v, q_side, k_side, params, *, cfg: _Local):
  """Per shard: the ring (``_ring_attention``), in the dtype of ``v``."""
  return _ring_attention(q, k, v, q_side, k_side, params, cfg).astype(v.dtype)


def _pass(x, cfg: _Local):
  """Every shard's ``x`` (a pytree) to the next shard of the ring."""
  perm = [(i, (i + 1) % cfg.shards) for i in range(cfg.shards)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, cfg.axes, perm), x)


def _ring_forward(q, k, v, q_side, k_side, params, cfg: _Local):
  """C steps; each attends the local queries to the visiting keys and merges the partial result
  into the running one (online softmax). The C - 1 passes run in a ``lax.scan`` (one traced step,
  whatever C). Returns ``(out float32, lse)``."""
  out, lse = _attend(q, k, v, q_side, k_side, params, cfg, with_lse=True)

  def step(carry, _):
    out, lse, visiting = carry
    visiting = _pass(visiting, cfg)
    part, part_lse = _attend(q, visiting[0], visiting[1], q_side, visiting[2], params, cfg, with_lse=True)
    out, lse = blockwise.combine_partials(out, lse, part.astype(jnp.float32), part_lse)
    return (out, lse, visiting), None

  (out, lse, _), _ = jax.lax.scan(step, (out.astype(jnp.float32), lse, (k, v, k_side)), length=cfg.shards - 1)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring_attention(q, k, v, q_side, k_side, params, cfg: _Local):
  """The ring's output ``[B, t, N, H]`` float32; its backward pass runs the ring again, so a
  shard holds one visiting chunk of keys (and of their gradients) at a time, never all T."""
  return _ring_forward(q, k, v, q_side, k_side, params, cfg)[0]


def _ring_fwd(q, k, v, q_side, k_side, params, cfg):
  out, lse = _ring_forward(q, k, v, q_side, k_side, params, cfg)
  return out, (q, k, v, q_side, k_side, params, out, lse)


def _ring_bwd(cfg, residuals, d_out):
  """The gradient of ``out = sum_s w_s out_s`` (``w_s = exp(lse_s - lse)``) through each step's
  partial attention: ``d out_s = w_s d_out`` and ``d lse_s = w_s <d_out, out_s - out>``; the keys
  travel the ring again with their gradient accumulators, which a last pass brings home."""
  q, k, v, q_side, k_side, params, out, lse = residuals
  d_out = d_out.astype(jnp.float32)

  def grads(k, v, k_side):  # this step's (d q, d k, d v, d params), float32
    def part(q, k, v, params):
      return _attend(q, k, v, q_side, k_side, params, cfg, with_lse=True)

    (part_out, part_lse), vjp = jax.vjp(part, q, k, v, params)
    seen = (part_lse != -jnp.inf) & (lse != -jnp.inf)  # a NaN lse is seen: NaN gradients
    w = jnp.where(seen, jnp.exp(jnp.where(seen, part_lse - lse, 0.0)), 0.0)
    d_part = (w[..., None] * d_out).astype(part_out.dtype)
    d_part_lse = w * jnp.sum(d_out * (part_out.astype(jnp.float32) - out), axis=-1)
    return jax.tree.map(lambda g: g.astype(jnp.float32), vjp((d_part, d_part_lse)))

  def step(carry, _):
    d_q, d_params, acc, visiting = carry
    visiting, acc = _pass((visiting, acc), cfg)  # each chunk's gradient travels with it
    g_q, g_k, g_v, g_params = grads(*visiting)
    d_params = jax.tree.map(jnp.add, d_params, g_params)
    return (d_q + g_q, d_params, (acc[0] + g_k, acc[1] + g_v), visiting), None

  d_q, d_k, d_v, d_params = grads(k, v, k_side)
  carry = (d_q, d_params, (d_k, d_v), (k, v, k_side))
  (d_q, d_params, acc, _), _ = jax.lax.scan(step, carry, length=cfg.shards - 1)
  d_k, d_v = _pass(acc, cfg)  # the last pass brings each chunk's gradient home

  def zero(x):
    return np.zeros(x.shape, jax.dtypes.float0)

  return (
    d_q.astype(q.dtype),
    d_k.astype(k.dtype),
    d_v.astype(v.dtype),
    jax.tree.map(zero, q_side),
    jax.tree.map(zero, k_side),
    jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), d_params, params),  # this shard's part
  )


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


__all__ = ["STRATEGIES", "context_attention", "from_zigzag", "to_zigzag", "zigzag_order"]
