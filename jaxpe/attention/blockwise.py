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

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import cpu_flash, numerics, platforms
from jaxpe.attention import patterns as pattern_lib
from jaxpe.attention import sinks as sink_lib
from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.masks import AttentionMask, IndexMask
from jaxpe.attention.online_softmax import Config, flash
from jaxpe.attention.position_bias import PositionBias
from jaxpe.attention.reference import check_not_forward_mode, check_precise_dims, check_scale
from jaxpe.ops import checks as _checks

# Query and key block sizes when the caller gives none: 32 up to T = 2048, 512 above. Measured on the
# 2-core CPU, forward + backward against the dense reference with causal query blocks of 128 (B 32,
# T 256, N 8, H 16 and B 8, T 512, N 8, H 64; alternating, busy machine): blocks of 32 took 0.32-0.53x
# and 0.68-0.88x its time, 64 0.81-0.88x and 0.75-1.2x, 128 1.2-1.4x (small blocks skip more of the
# causal triangle and stay in cache). Above T 2048 blocks of 512 keep the loop count down; at T 16k,
# N 16 one block pair's float32 scores are 16 MiB.
SMALL_BLOCK, LARGE_BLOCK, LARGE_FROM = 32, 512, 2048


def default_block(length: int) -> int:
  """The block size ``blockwise_attention`` uses for ``length`` queries or keys when given none."""
  return SMALL_BLOCK if length <= LARGE_FROM else LARGE_BLOCK


def blockwise_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: IndexMask | AttentionMask | None = None,
  alibi: AlibiSpec | None = None,
  position_bias: PositionBias | None = None,
  precise_dims: int | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
  return_lse: bool = False,
  sinks: jax.Array | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
):
  """``softmax(softcap(q.k * scale) + ALiBi, masked) . v`` by key blocks, with float32 scores and softmax.

  Equal to ``jaxpe.attention.dot_product_attention`` with ``bias=alibi_bias(...)`` and
  ``mask=mask.dense()`` to float32 rounding (the online softmax rescales partial sums), including
  its rules: a row with no visible key gives zeros (and zero gradients), a row whose visible scores
  hold a NaN gives NaN; the keys and values of keys no query sees (``k_valid`` False, causal cache
  slots after every query) never reach the result or the gradients, even NaN
  (``jaxpe.attention.numerics``); the last ``precise_dims`` dims of q and k are contracted in
  float32 at ``precision=HIGHEST`` in both passes; grouped-query heads share their kv head without
  repeating it.

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
    position_bias: optional ``PositionBias`` (T5, Kerple, FIRE): ``fn(params, q_pos, k_pos)``
      evaluated per block pair on its ``q_positions [B, T]`` / ``k_positions [B, S]`` and added to
      the scaled scores; differentiable in ``position_bias.params`` (their gradient accumulated per block
      pair in the backward pass). Checked by the caller (``attention``); not with ``alibi``.
    precise_dims: trailing dims of q and k contracted at float32 ``HIGHEST`` precision; 0..Hq.
      Default None: the dims beyond v's width, ``Hq - H``.
    block_q, block_k: query / key block sizes, ints > 0; default ``default_block(T)`` /
      ``default_block(S)`` (``LARGE_BLOCK`` keys when T <= ``SMALL_BLOCK``: decoding). T and S
      need not be multiples (the last block is padded, padded keys are invisible).
    return_lse: also return the log-sum-exp of each row's scaled, biased scores.
    sinks: optional ``[N]`` float attention-sink logits (``jaxpe.attention.sinks``: ``exp(sink_h)``
      joins each row's softmax denominator, with no value; gpt-oss, arXiv 2309.17453), applied
      from the lse after the online softmax; differentiable. With ``return_lse`` the lse then
      includes the sink's term.
    local_window_size, chunk_size, logits_soft_cap: the attention pattern of
      ``jaxpe.attention.attention`` (``jaxpe.attention.patterns``): the window compares the mask's
      slots (``q_index`` / ``k_index``; with an ``AttentionMask`` or no mask the indices
      ``0..T-1`` / ``0..S-1``), the chunks the tokens' positions (an ``IndexMask``'s
      ``q_positions`` / ``k_positions``; an ``AttentionMask``'s ``patterns.document_positions``:
      from each document's first real token, as transformers); the cap applies to the scaled scores before ALiBi, the position
      bias, the mask and the sinks.

  Returns:
    ``[B, T, N, H]`` of ``v.dtype``; with ``return_lse`` also ``[B, T, N]`` float32 log-sum-exp
    (``-inf`` on rows with no visible key). Both are differentiable in q, k, v and ``position_bias.params``
    (reverse mode: ``jax.grad``, ``jax.vjp``; forward mode, ``jax.jvp`` / ``jax.jacfwd``, raises a
    TypeError naming ``dot_product_attention``, which has both;
    second derivatives are tested for q, k, v, not for ``position_bias.params``).

  Raises:
    ValueError: ranks or sizes that do not fit (B, S, K, Hq, N % K, no heads), ``scale`` not a
      finite number > 0, ``precise_dims`` outside 0..Hq, a block size not an int > 0, mask or ALiBi
      arrays not of their ``[B, T]`` / ``[B, S]`` shapes or slopes not ``[N]``, ``sinks`` not ``[N]``.
    TypeError: non-float q, k, v or sinks (q, k, v not arrays of numbers: lists of numbers are taken
      as numpy arrays); ``return_lse`` not a bool; a traced ``scale``; mask fields of the wrong dtype; ``mask`` not
      an ``IndexMask``, ``alibi`` not an ``AlibiSpec``, ``position_bias`` not a ``PositionBias``.

  Memory: the residuals of the backward pass are q, k, v, the output and the ``[B, T, N]``
  log-sum-exp; each pass holds a few ``[B, N, block_q, block_k]`` float32 temporaries at a time.
  """
  q, k, v = (_checks.as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
  for name, arr, hint in (("q", q, "[B, T, N, Hq]"), ("k", k, "[B, S, K, Hq]"), ("v", v, "[B, S, K, H]")):
    _checks.check_rank(name, arr, 4, hint)
    _checks.check_float(name, arr)
  scale = check_scale("scale", scale)
  return_lse = _checks.check_bool("return_lse", return_lse)
  check_not_forward_mode("blockwise_attention (the xla backend's path)", q, k, v, sinks)
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if num_heads == 0 or num_kv == 0:
    raise ValueError(f"q and k need at least one head (N >= 1, K >= 1), got N={num_heads}, K={num_kv}")
  if num_heads % num_kv or k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != qk_dim:
    raise ValueError(
      f"q, k, v must be [B,T,N,Hq], [B,S,K,Hq], [B,S,K,H] with N % K == 0, got {q.shape}, {k.shape}, {v.shape}"
    )
  precise_dims = check_precise_dims(precise_dims, qk_dim, v.shape[-1])
  pattern = pattern_lib.check_pattern(local_window_size, chunk_size, logits_soft_cap)
  pattern_lib.check_cap_precise_dims(pattern, precise_dims)
  if sinks is not None:
    sinks = sink_lib.check_sinks(sinks, num_heads)
  explicit_blocks = block_q is not None or block_k is not None
  block_q = _check_block("block_q", block_q, t_len)
  # few queries (KV-cache decoding, short chunks): large key blocks, fewer loop steps
  block_k = _check_block("block_k", block_k, LARGE_FROM + 1 if t_len <= SMALL_BLOCK else s_len)
  natural = isinstance(mask, AttentionMask)
  if natural:
    if s_len != t_len:
      raise ValueError(f"an AttentionMask is for self-attention (T == S), got T={t_len}, S={s_len}")
    mask = mask.check(batch, t_len)
    mask = self_attention_mask(
      mask.valid,
      mask.segment_ids,
      causal=mask.causal,
      batch=batch,
      length=t_len,
      chunks=pattern.chunk is not None,
    )
  elif mask is not None and not isinstance(mask, IndexMask):
    raise TypeError(f"mask must be an IndexMask, an AttentionMask or None, got {type(mask).__name__}")
  if alibi is not None and not isinstance(alibi, AlibiSpec):
    raise TypeError(f"alibi must be an AlibiSpec or None, got {type(alibi).__name__}")
  if position_bias is not None and not isinstance(position_bias, PositionBias):
    raise TypeError(f"position_bias must be a PositionBias or None, got {type(position_bias).__name__}")
  if position_bias is not None and alibi is not None:
    raise ValueError("give alibi or position_bias, not both (one position bias per attention)")
  plain = natural or mask is None  # slots 0..T-1 / 0..S-1: the CPU kernel's
  if mask is None and pattern.masks:  # the window and chunks compare indices 0..T-1 / 0..S-1
    mask = IndexMask(
      jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len)),
      jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32), (batch, s_len)),
      causal=False,
    )
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
  bias_fn = bias_params = None
  if position_bias is not None:
    q_pos, k_pos = jnp.asarray(position_bias.q_positions), jnp.asarray(position_bias.k_positions)
    if q_pos.shape != (batch, t_len) or k_pos.shape != (batch, s_len):
      raise ValueError(
        f"position_bias q_positions / k_positions must be [B, T] / [B, S] = {[batch, t_len]} / {[batch, s_len]}, "
        f"got {q_pos.shape} / {k_pos.shape}"
      )
    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    bias_fn, bias_params = position_bias.fn, position_bias.params
  out_shape = (batch, t_len, num_heads, v.shape[-1])
  if t_len == 0 or s_len == 0:
    out = jnp.zeros(out_shape, v.dtype)
    lse = jnp.full(out_shape[:3], -jnp.inf, jnp.float32)
    if sinks is not None:
      lse = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :], lse.shape)
    return (out, lse) if return_lse else out
  causal = mask is not None and mask.causal
  cfg = Config(
    float(scale),
    int(precise_dims),
    block_q,
    block_k,
    causal,
    natural,
    bias_fn,
    pattern if pattern.active else None,
  )
  qi = ki = k_valid = q_seg = k_seg = q_chunk = k_chunk = None
  if mask is not None:
    # slots: checked < 2^31 where concrete, int32 exactly
    qi, ki, k_valid = mask.q_index.astype(jnp.int32), mask.k_index.astype(jnp.int32), mask.k_valid
    if pattern.chunk is not None and mask.q_positions is not None:  # chunks count token positions
      q_chunk, k_chunk = mask.q_positions.astype(jnp.int32), mask.k_positions.astype(jnp.int32)
    q_seg, k_seg = numerics.canonical_segment_ids(mask.q_segment_ids, mask.k_segment_ids)
    k_valid = None if k_valid is None else jnp.asarray(k_valid).astype(bool)
    seen = k_valid
    if causal and not natural:  # slots after every query's slot (an unfilled cache): no query sees them
      later = ki <= jnp.max(qi, axis=1, keepdims=True)
      seen = later if seen is None else seen & later
    k, v = numerics.zero_hidden_keys(k, v, seen)  # hidden keys (NaN too) never reach P.V or dS.K

  def loops():
    return flash(
      q, k, v, qi, ki, k_valid, q_seg, k_seg, q_pos, k_pos, q_chunk, k_chunk, slopes, bias_params, cfg
    )

  # the CPU kernel counts chunks from slot 0: chunks counted from each document's first real token
  # (padding or packed documents) run on the XLA loops
  if q_chunk is None and _cpu_kernel_applies(
    q, k, v, plain, explicit_blocks, position_bias, precise_dims, q_seg, k_seg, q_pos, k_pos
  ):

    def kernel():
      return cpu_flash.cpu_flash_attention(
        q, k, v, scale=scale, causal=causal, precise_dims=precise_dims, k_valid=k_valid,
        q_segment_ids=q_seg, k_segment_ids=k_seg, slopes=None if alibi is None else alibi.slopes,
        q_positions=q_pos, k_positions=k_pos, return_lse=True, local_window_size=pattern.window,
        chunk_size=pattern.chunk, logits_soft_cap=pattern.cap,
      )  # fmt: skip

    # the CPU kernel in a program lowered for the CPU, the XLA loops for any other platform
    out, lse = platforms.per_platform({"cpu": kernel}, default=loops)
  else:
    out, lse = loops()
  if sinks is not None:
    out, lse = sink_lib.apply_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out


def self_attention_mask(
  valid, segment_ids, *, causal: bool, batch: int, length: int, chunks: bool = False
) -> IndexMask:
  """The ``IndexMask`` of an ``AttentionMask``'s fields: slots ``0..T-1`` for queries and keys;
  with ``chunks`` and padding or packed documents, the positions the chunks count too
  (``patterns.document_positions``: each document's chunks start at its first real token)."""
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  positions = None
  if chunks and (valid is not None or segment_ids is not None):
    positions = pattern_lib.document_positions(valid, segment_ids, batch, length)
  return IndexMask(index, index, causal, valid, segment_ids, segment_ids, positions, positions)


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

  Raises:
    TypeError: an argument that is not a float array (lists of numbers are taken as numpy arrays).
    ValueError: ``out_a`` / ``out_b`` not of one ``[B, T, N, H]`` shape, or an lse not ``[B, T, N]``.
  """
  out_a, lse_a, out_b, lse_b = (
    _checks.as_array(name, x)
    for name, x in zip(("out_a", "lse_a", "out_b", "lse_b"), (out_a, lse_a, out_b, lse_b))
  )
  for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
    _checks.check_float(name, x)
  _checks.check_rank("out_a", out_a, 4, "[B, T, N, H]")
  if tuple(out_b.shape) != tuple(out_a.shape):
    raise ValueError(
      f"out_b must have out_a's shape [B, T, N, H] = {tuple(out_a.shape)}, got {tuple(out_b.shape)}"
    )
  for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
    if tuple(x.shape) != tuple(out_a.shape[:3]):
      raise ValueError(f"{name} must have shape [B, T, N] = {tuple(out_a.shape[:3])}, got {tuple(x.shape)}")
  out_a, lse_a, out_b, lse_b = (jnp.asarray(x) for x in (out_a, lse_a, out_b, lse_b))
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


def _cpu_kernel_applies(q, k, v, natural, explicit_blocks, position_bias, precise_dims, *side) -> bool:
  """Whether ``blockwise_attention`` runs the fused CPU kernel (``cpu_flash``) where the program is
  lowered for the CPU (``platforms.per_platform``; its XLA loops on any other platform): q, k, v are
  float32, the mask is an ``AttentionMask`` or none, no block size was asked for, no learned
  position bias, the side arrays are integers of at most 32 bits, the kernel's O(S) scratch fits
  the machine (``cpu_flash.scratch_fits``: else the XLA loops, whose memory is O(block_q x
  block_k), run: S = 2^25 keys fit there), and the kernel is available (it builds on first use)."""
  if explicit_blocks or position_bias is not None or not natural:
    return False
  need, room = cpu_flash.scratch_fits(q.shape[1], k.shape[1], q.shape[3], v.shape[3], precise_dims)
  if need > room:
    return False
  if any(jnp.result_type(x) != jnp.float32 for x in (q, k, v)):
    return False
  for x in side:
    dtype = None if x is None else jnp.result_type(x)
    if dtype is not None and not (jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits <= 32):
      return False
    if dtype == jnp.uint32:
      return False
  return cpu_flash.available()


def _check_block(name: str, block, length: int) -> int:
  if block is None:
    return default_block(length)
  if isinstance(block, bool) or not isinstance(block, int | np.integer) or block <= 0:
    raise ValueError(f"{name} must be an int > 0 (block size in tokens), got {block!r}")
  return int(block)


__all__ = ["blockwise_attention", "combine_partials", "default_block", "self_attention_mask"]
