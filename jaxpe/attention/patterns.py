"""Attention patterns that ship with RoPE models: a local (sliding) window, chunked attention and
logit soft-capping, as ``jaxpe.attention.attention``'s ``local_window_size``, ``chunk_size`` and
``logits_soft_cap``.

- ``local_window_size = (left, right)``: query i sees key j only if ``i - left <= j <= i + right``
  (``jax.nn.dot_product_attention``'s name and meaning; an int w is ``(w, w)``). transformers'
  ``sliding_window = w`` (Mistral, Gemma 2/3, gpt-oss), which counts the query itself, is
  ``(w - 1, 0)`` with a causal mask (``transformers.masking_utils.sliding_window_causal_mask_function``:
  ``kv_idx > q_idx - w``).
- ``chunk_size = c``: query i sees key j only if ``p_i // c == p_j // c`` with p the tokens'
  positions (Llama 4's ``attention_chunk_size``; ``chunked_causal_mask_function`` with a causal mask).
  Chunks start at each row's first real token and restart with each packed document, as
  transformers does: ``create_chunked_causal_mask`` offsets the chunks by the row's left padding
  (``chunked_overlay``: ``(kv_idx - left_padding) // c == (q_idx - left_padding) // c``) and, for
  packed rows, reads the indices from ``position_ids`` (``remap_positions_for_packed_sequence``).
- ``logits_soft_cap = cap``: the scaled scores ``s = q.k * scale`` become ``cap * tanh(s / cap)``
  before the mask, the bias (ALiBi, a learned bias) and the sinks (Gemma 2's
  ``attn_logit_softcapping``, transformers' ``gemma2.eager_attention_forward``).

Windows are a distance: i and j are slots (the indices ``0..T-1`` / ``0..S-1``, an ``IndexMask``'s
``q_index`` / ``k_index``); within one document of a packed row, or after left padding, the slot
distance is the position distance (transformers measures packed windows in ``position_ids``, the
same pairs since other documents are masked). Chunks are absolute: their positions p are
``document_positions`` of an ``AttentionMask``'s ``valid`` / ``segment_ids`` (a slot minus the first
real slot of its document), an ``IndexMask``'s ``q_positions`` / ``k_positions`` (the KV cache: the
tokens' positions), else the slots.

``Pattern`` holds the three checked values (static, hashable); ``visible`` / ``soft_cap`` apply them.

Shape alphabet: B batch, T query positions, S key positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks

# A window side or chunk at least this long restricts nothing (slots are int32 < 2^31).
UNBOUNDED = 2**31 - 1


class Pattern(NamedTuple):
  """The checked attention pattern (static): ``window`` ``(left, right)`` ints >= 0 or None,
  ``chunk`` an int >= 1 or None, ``cap`` a float > 0 or None."""

  window: tuple[int, int] | None = None
  chunk: int | None = None
  cap: float | None = None

  @property
  def masks(self) -> bool:
    """Whether the pattern hides keys (a window or chunks)."""
    return self.window is not None or self.chunk is not None

  @property
  def active(self) -> bool:
    return self.masks or self.cap is not None

  def options(self) -> tuple[str, ...]:
    """The argument names this pattern sets (for refusals)."""
    names = ("local_window_size", "chunk_size", "logits_soft_cap")
    return tuple(n for n, x in zip(names, (self.window, self.chunk, self.cap)) if x is not None)

  def visible(self, q_pos: jax.Array, k_pos: jax.Array, q_chunk=None, k_chunk=None) -> jax.Array | None:
    """Bool ``q_pos`` vs ``k_pos`` (broadcast together; int32 slots): which keys the window and
    chunks let each query see; None when neither is set. ``q_chunk`` / ``k_chunk``: the tokens'
    positions the chunks count (broadcast as ``q_pos`` / ``k_pos``; None: the slots)."""
    out = None
    if self.window is not None:
      left, right = self.window
      d = q_pos - k_pos  # int32: both in [0, 2^31), no overflow
      if left < UNBOUNDED:
        out = d <= left
      if right < UNBOUNDED:
        r = -d <= right
        out = r if out is None else out & r
    if self.chunk is not None and self.chunk < UNBOUNDED:
      qc, kc = (q_pos, k_pos) if q_chunk is None else (q_chunk, k_chunk)
      same = (qc // self.chunk) == (kc // self.chunk)
      out = same if out is None else out & same
    if out is None and self.masks:
      out = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), bool)
    return out

  def soft_cap(self, s: jax.Array) -> jax.Array:
    """``cap * tanh(s / cap)`` of float32 scores (``s`` unchanged without a cap)."""
    if self.cap is None:
      return s
    cap = jnp.float32(self.cap)
    return cap * jnp.tanh(s / cap)

  def slot_bound(self) -> Pattern:
    """This pattern with its chunks replaced by the window ``(c - 1, c - 1)`` they lie in, for block
    skipping on slots when the chunks count positions a constant apart from the slots within each
    document (``document_positions``): a superset of the visible pairs, never the mask itself."""
    if self.chunk is None:
      return self
    c = min(self.chunk, UNBOUNDED) - 1
    left, right = (UNBOUNDED, UNBOUNDED) if self.window is None else self.window
    return Pattern((min(left, c), min(right, c)), None, self.cap)

  def key_range(self, q_first: int, q_last: int) -> tuple[int, int]:
    """The key positions ``[lo, hi]`` (inclusive, unclipped) queries ``q_first..q_last`` may see."""
    lo, hi = -UNBOUNDED, UNBOUNDED
    if self.window is not None:
      lo, hi = max(lo, q_first - self.window[0]), min(hi, q_last + self.window[1])
    if self.chunk is not None:
      lo = max(lo, (q_first // self.chunk) * self.chunk)
      hi = min(hi, (q_last // self.chunk + 1) * self.chunk - 1)
    return lo, hi


PATTERN_OPTIONS: dict[str, tuple[str, ...]] = {
  "xla": ("local_window_size", "chunk_size", "logits_soft_cap"),
  "splash": ("local_window_size", "chunk_size", "logits_soft_cap"),
  "cudnn": ("local_window_size",),
  "tokamax": ("local_window_size", "logits_soft_cap"),
  "flash": ("local_window_size", "chunk_size", "logits_soft_cap"),
}
"""Backend -> the options it runs (splash: chunks with a causal mask; cudnn: a causal left window;
tokamax: the cap without a bias, as its cap comes after the bias); the other backends refuse them."""
REFUSAL_REASONS: dict[str, str] = {
  "pallas_gpu": "jax's Pallas GPU mha kernel has no window, chunks or soft cap",
  "cudnn": "cuDNN's fused attention through jax.nn.dot_product_attention has a causal left window only",
  "tokamax": "tokamax.dot_product_attention has local_window_size and logits_soft_cap, no chunks",
}


def refuse(impl: str, pattern: Pattern, *, emulated_alibi: bool = False, bias=None) -> None:
  """ValueError naming backend ``impl`` and the first option of ``pattern`` it cannot run; the soft
  cap with an ALiBi that ``impl`` emulates inside q.k (``emulated_alibi``: the cap would squash it),
  and on tokamax with a bias (tokamax caps ``scale * q.k + bias``, Gemma 2 caps before the bias)."""
  runs = PATTERN_OPTIONS.get(impl, ())
  for option in pattern.options():
    if option not in runs:
      why = REFUSAL_REASONS.get(impl, "this backend has no such option")
      raise ValueError(
        f"attention implementation {impl!r} cannot run {option} ({why}); implementation='xla' runs "
        "local_window_size, chunk_size and logits_soft_cap on every platform, and 'auto' picks a backend that can"
      )
  if pattern.cap is not None and emulated_alibi:
    raise ValueError(
      f"attention implementation {impl!r} with logits_soft_cap and alibi_spec: {impl!r} runs ALiBi as its "
      "bias-free emulation inside q.k, which the soft cap would squash with the scores (the cap comes before "
      "the bias); use implementation='xla' (native ALiBi)"
    )


def refuse_chunk_offsets(impl: str, pattern: Pattern, mask) -> None:
  """ValueError for ``chunk_size`` on kernel ``impl`` with an ``AttentionMask`` that has padding
  (``valid``) or packed documents (``segment_ids``): the fused kernels count chunks from slot 0
  (splash's ``ChunkedCausalMask``, flash's and the CPU kernel's chunk bounds), while each row's
  chunks start at its first real token (``document_positions``; transformers'
  ``create_chunked_causal_mask``). ``auto`` then runs ``xla``, which counts them so."""
  if pattern.chunk is None or mask is None or not hasattr(mask, "segment_ids"):
    return
  if mask.valid is None and mask.segment_ids is None:
    return
  given = "valid (padding)" if mask.valid is not None else "segment_ids (packed documents)"
  raise ValueError(
    f"attention implementation {impl!r} cannot run chunk_size with an AttentionMask's {given}: its kernel "
    "counts chunks from slot 0, while each row's chunks start at its first real token and restart with "
    "each document (as transformers' create_chunked_causal_mask); implementation='xla' runs them, and "
    "'auto' picks it"
  )


def static_block_need(pattern: Pattern, nq: int, bq: int, nk: int, bk: int) -> np.ndarray:
  """``[nq, nk]`` numpy bool: which (query block, key block) pairs of indices ``0..`` may hold a
  visible pair under the window and chunks (blocks of ``bq`` / ``bk`` tokens; conservative)."""
  need = np.ones((nq, nk), bool)
  k_first = np.arange(nk) * bk
  for i in range(nq):
    lo, hi = pattern.key_range(i * bq, i * bq + bq - 1)
    need[i] = (k_first + bk - 1 >= lo) & (k_first <= hi)
  return need


def dynamic_block_need(pattern: Pattern, q_min, q_max, k_min, k_max, chunk_range=None) -> jax.Array:
  """``[nq, nk]`` bool: the pairs of query blocks (slots ``q_min..q_max``, ``[nq]``) and key blocks
  (valid slots ``k_min..k_max``, ``[nk]``; an empty block has ``k_min > k_max``) whose slots may
  hold a visible pair under the window and chunks (conservative). ``chunk_range``: ``(q_min, q_max,
  k_min, k_max)`` of the positions the chunks count (``Pattern.visible``), else the slots."""
  q_min, q_max = q_min[:, None], q_max[:, None]
  k_min, k_max = k_min[None, :], k_max[None, :]
  need = k_min <= k_max
  if pattern.window is not None:
    left, right = (min(x, UNBOUNDED) for x in pattern.window)
    # int32 slots in [0, 2^31) and sides <= 2^31 - 1: the differences do not overflow
    need = need & (k_max >= q_min - left) & (k_min - right <= q_max)
  if pattern.chunk is not None:
    c = min(pattern.chunk, UNBOUNDED)
    if chunk_range is not None:
      q_min, q_max, k_min, k_max = chunk_range
      q_min, q_max, k_min, k_max = q_min[:, None], q_max[:, None], k_min[None, :], k_max[None, :]
    need = need & (k_min // c <= q_max // c) & (k_max // c >= q_min // c)
  return need


def document_positions(valid, segment_ids, batch: int, length: int) -> jax.Array:
  """``[B, T]`` int32 position of each slot in its document, the positions chunks count in: the slot
  minus the first real slot (``valid``) of its document (the run of equal ``segment_ids`` around
  it; the whole row without them). Left padding shifts the row's chunks as transformers'
  ``create_chunked_causal_mask`` (its left-padding offset); packed documents restart them (its
  ``position_ids`` remap); padding inside a row shifts nothing (as there). Padding slots before a
  document's first real token count from the document's first slot.

  ``valid`` ``[B, T]`` bool or None (all real); ``segment_ids`` ``[B, T]`` integer ids or None."""
  idx = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  if segment_ids is None:
    run_start = jnp.zeros((batch, length), jnp.int32)
  else:
    seg = jnp.asarray(segment_ids)
    new = jnp.concatenate([jnp.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run_start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
  if valid is None:
    return idx - run_start
  real = jnp.asarray(valid).astype(bool)
  before = jnp.cumsum(real, axis=1, dtype=jnp.int32) - real.astype(jnp.int32)  # real slots before t
  in_run = before - jnp.take_along_axis(before, run_start, axis=1)  # ... within t's document
  first = real & (in_run == 0)
  origin = jnp.maximum(jax.lax.cummax(jnp.where(first, idx, -1), axis=1), run_start)
  return idx - origin


def band(need: np.ndarray) -> tuple[np.ndarray, int]:
  """``(first [n], width)`` of a static ``[n, m]`` need matrix: row r's needed columns lie in
  ``first[r] .. first[r] + width - 1`` (width 0 when none is needed anywhere)."""
  any_row = need.any(axis=1)
  first = np.where(any_row, need.argmax(axis=1), 0)
  last = np.where(any_row, need.shape[1] - 1 - need[:, ::-1].argmax(axis=1), -1)
  width = int(np.max(last - first + 1, initial=0))
  return first.astype(np.int32), max(width, 0)


def check_local_window_size(value) -> tuple[int, int] | None:
  """``local_window_size`` as ``(left, right)`` ints in ``[0, 2^31]`` (an int w: ``(w, w)``), or None.

  Raises:
    TypeError: not None, an int or a pair of ints (a bool, a float, a traced value).
    ValueError: a side < 0 or > 2^31, or a sequence not of two items.
  """
  if value is None:
    return None
  what = (
    "local_window_size must be None, an int w >= 0 (the window (w, w)) or a pair (left, right) of ints >= 0"
  )
  if _checks.is_int(value):
    sides = (value, value)
  elif isinstance(value, tuple | list):
    if len(value) != 2:
      raise ValueError(f"{what}, got a sequence of {len(value)} items: {value!r}")
    sides = tuple(value)
    if not all(_checks.is_int(x) for x in sides):
      raise TypeError(f"{what}, got {value!r}")
  else:
    raise TypeError(f"{what}, got {value!r} ({type(value).__name__})")
  if any(x < 0 or x > _checks.MAX_POSITION for x in sides):
    raise ValueError(f"{what} (each side in [0, 2^31] tokens), got {value!r}")
  return int(sides[0]), int(sides[1])


def check_chunk_size(value) -> int | None:
  """``chunk_size`` as an int in ``[1, 2^31]``, or None.

  Raises:
    TypeError: not None or an int (a bool, a float, a traced value).
    ValueError: < 1 or > 2^31.
  """
  if value is None:
    return None
  if not _checks.is_int(value):
    raise TypeError(f"chunk_size must be None or an int >= 1 (tokens per chunk), got {value!r}")
  if not 1 <= value <= _checks.MAX_POSITION:
    raise ValueError(f"chunk_size must be None or an int in [1, 2^31] (tokens per chunk), got {value!r}")
  return int(value)


def check_logits_soft_cap(value) -> float | None:
  """``logits_soft_cap`` as a finite float > 0, or None.

  Raises:
    TypeError: not a concrete real number (a bool, a string, an array of several values, traced).
    ValueError: NaN, inf, 0 or negative.
  """
  if value is None:
    return None
  if isinstance(value, jax.core.Tracer) or np.ndim(value) != 0:
    raise TypeError(f"logits_soft_cap must be None or a concrete finite number > 0, got {value!r}")
  try:
    return _checks.check_positive_float("logits_soft_cap", value)
  except _checks.ArgTypeError as e:
    raise TypeError(str(e)) from None


def check_pattern(local_window_size=None, chunk_size=None, logits_soft_cap=None) -> Pattern:
  """The three options checked (``check_local_window_size``, ``check_chunk_size``,
  ``check_logits_soft_cap``) as a ``Pattern``."""
  return Pattern(
    check_local_window_size(local_window_size),
    check_chunk_size(chunk_size),
    check_logits_soft_cap(logits_soft_cap),
  )


def check_cap_precise_dims(pattern: Pattern, precise_dims: int) -> None:
  """ValueError for ``logits_soft_cap`` with ``precise_dims > 0``: those q/k dims carry an emulated
  bias (RoPE-emulated ALiBi) inside q.k, which the cap would squash with the scores."""
  if pattern.cap is not None and precise_dims:
    raise ValueError(
      f"logits_soft_cap with precise_dims={precise_dims} > 0: the last precise_dims dims of q and k carry "
      "an emulated bias (RoPE-emulated ALiBi) inside q.k, which the cap would squash with the scores; "
      "give ALiBi natively (alibi_spec on xla, or bias=), or precise_dims=0 when those dims are not an emulation"
    )


def dense_visible(
  pattern: Pattern, q_pos: jax.Array, k_pos: jax.Array, q_chunk=None, k_chunk=None
) -> jax.Array | None:
  """``[B|1, 1, T, S]`` bool of ``pattern.visible`` for ``[B|1, T]`` / ``[B|1, S]`` slots (and the
  positions the chunks count, ``q_chunk`` / ``k_chunk``, None: the slots)."""
  q_pos, k_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)
  if q_chunk is not None:
    q_chunk = jnp.asarray(q_chunk, jnp.int32)[:, :, None]
    k_chunk = jnp.asarray(k_chunk, jnp.int32)[:, None, :]
  out = pattern.visible(q_pos[:, :, None], k_pos[:, None, :], q_chunk, k_chunk)
  return None if out is None else out[:, None]


def arange_positions(length: int) -> jax.Array:
  """``[1, length]`` int32 positions ``0..length-1``."""
  return jnp.arange(length, dtype=jnp.int32)[None]


__all__ = [
  "Pattern",
  "arange_positions",
  "band",
  "dynamic_block_need",
  "refuse",
  "refuse_chunk_offsets",
  "static_block_need",
  "check_cap_precise_dims",
  "check_chunk_size",
  "check_local_window_size",
  "check_logits_soft_cap",
  "check_pattern",
  "dense_visible",
  "document_positions",
]
