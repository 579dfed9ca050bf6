"""Attention masks: the structured ``AttentionMask`` that every backend takes, its dense form, and the
checks of mask fields.

- ``AttentionMask``: self-attention as causal + padding (``valid``) + packed documents
  (``segment_ids``); what fused kernels take instead of a dense mask.
- ``IndexMask``: the mask from slot indices (KV cache, context-parallel shards), structured.
- ``dense_attention_mask``: the dense ``[B, 1, T, S]`` bool mask from slot indices (KV cache too;
  slots, not the token positions that padding and packing repeat).
- ``document_mask``: the packed-documents mask (t5x / Flax lm1b).
- ``dense_segment_ids`` / ``kernel_segment_ids``: segment ids as the fused kernels read them.

Shape alphabet: B batch, T query positions, S key positions, N heads.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Structured self-attention mask: what fused kernels take instead of a dense ``[B, 1, T, S]`` mask.

  Queries and keys are the same T tokens (no KV cache: key slot t is query slot t). Query t may
  attend key s when ``s <= t`` (if ``causal``), ``valid[s]`` and ``segment_ids[t] == segment_ids[s]``.
  ``dense()`` gives the equivalent bool mask for the ``xla`` backend. Every backend of
  ``jaxpe.attention.attention`` reads the mask through ``check`` and compares segment ids exactly in
  their own dtype (int64 ids of 0 and 2^32 are two documents on every backend).

  Attributes:
    valid: optional ``[B, T]`` bool (or integer, nonzero = valid) array, False for padding tokens
      (left or right padding). A float dtype raises TypeError.
    segment_ids: optional ``[B, T]`` integer (int8..int64, uint8..uint64) document ids of packed
      sequences; any values (negative, huge) compared exactly. Bool or float ids raise TypeError
      (0 and 0.5 would be one document after the kernels' int32 cast).
    causal: static Python bool (a pytree meta field, so jit and scan see it as a Python bool).

  The checks run in ``check(batch, length)`` (called by ``dense`` and by every backend of
  ``kernels.attention``), not at construction (jax rebuilds the mask from tracers under jit).
  """

  valid: jax.Array | None = None
  segment_ids: jax.Array | None = None
  causal: bool = dataclasses.field(default=True, metadata=dict(static=True))

  def check(self, batch: int, length: int) -> AttentionMask:
    """This mask with its arrays as arrays, checked for a self-attention of ``[B, T]`` tokens.

    Raises:
      TypeError: ``causal`` not a bool; ``valid`` not bool/integer; ``segment_ids`` not integer;
        a field that is not an array (lists are converted).
      ValueError: ``valid`` or ``segment_ids`` not of shape ``[B, T]``.
    """
    causal = check_causal("AttentionMask.causal", self.causal)
    valid = self.valid
    if valid is not None:
      valid = check_valid("AttentionMask.valid", valid)
      _check_shape("AttentionMask.valid", valid, (batch, length), "[B, T]")
    segments = self.segment_ids
    if segments is not None:
      segments = check_segment_ids("AttentionMask.segment_ids", segments)
      _check_shape("AttentionMask.segment_ids", segments, (batch, length), "[B, T]")
    return AttentionMask(valid=valid, segment_ids=segments, causal=causal)

  def dense(self, batch: int, length: int) -> jax.Array:
    """The ``[B, 1, T, T]`` bool mask (True = may attend) of ``dense_attention_mask``.

    Raises:
      TypeError, ValueError: as ``check``.
    """
    mask = self.check(batch, length)
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return dense_attention_mask(
      index,
      index,
      causal=mask.causal,
      k_valid=mask.valid,
      q_segment_ids=mask.segment_ids,
      k_segment_ids=mask.segment_ids,
    )


def _check_shape(name: str, x, shape: tuple[int, ...], hint: str) -> None:
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {hint} = {list(shape)}, got {tuple(x.shape)}")


def check_causal(name: str, causal) -> bool:
  """``causal`` as a Python bool; TypeError unless it is a bool (a traced or array value is refused)."""
  if not isinstance(causal, bool | np.bool_):
    raise TypeError(f"{name} must be a Python bool (static), got {causal!r}")
  return bool(causal)


def check_valid(name: str, valid):
  """A padding mask: bool or integer (nonzero = valid) array; TypeError otherwise."""
  valid = _checks.as_array(name, valid)
  dtype = jnp.result_type(valid)
  if dtype != jnp.bool_ and not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be a bool array (True = real token) or integer 0/1, got dtype {dtype}")
  return valid


def check_segment_ids(name: str, ids):
  """Document ids: an integer array of any width and sign; TypeError for bool, float and others."""
  ids = _checks.as_array(name, ids)
  dtype = jnp.result_type(ids)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
      f"{name} must be an integer array of document ids (int8..int64 or uint8..uint64), got dtype {dtype}"
    )
  return ids


def dense_segment_ids(ids) -> jax.Array:
  """``[B, T]`` int32 ids in ``[0, T)`` equal exactly where ``ids`` are equal along each row.

  The ids are compared in their own dtype (no cast that could merge them: int64 2^32 and 0 stay two
  documents): each token gets the rank of its id among the row's distinct ids (a stable sort and a
  running count of changes). numpy inputs are ranked in numpy (a numpy int64 array would wrap on
  its way into jax without x64), jax inputs with jax ops (traceable). Used by the fused kernels,
  whose segment ids are int32.

  Args:
    ids: ``[B, T]`` integer array (checked by ``check_segment_ids``).

  Returns:
    ``[B, T]`` int32 array.
  """
  if isinstance(ids, np.ndarray):
    order = np.argsort(ids, axis=-1, kind="stable")
    ranked = np.take_along_axis(ids, order, axis=-1)
    change = np.concatenate([np.zeros((ids.shape[0], 1), bool), ranked[:, 1:] != ranked[:, :-1]], axis=-1)
    rank = np.empty(ids.shape, np.int32)
    np.put_along_axis(rank, order, np.cumsum(change, axis=-1, dtype=np.int32), axis=-1)
    return jnp.asarray(rank)
  order = jnp.argsort(ids, axis=-1, stable=True)
  ranked = jnp.take_along_axis(ids, order, axis=-1)
  change = jnp.concatenate([jnp.zeros((ids.shape[0], 1), bool), ranked[:, 1:] != ranked[:, :-1]], axis=-1)
  rank_sorted = jnp.cumsum(change, axis=-1, dtype=jnp.int32)
  rows = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
  return jnp.zeros(ids.shape, jnp.int32).at[rows, order].set(rank_sorted)


def kernel_segment_ids(mask: AttentionMask, batch: int, length: int) -> jax.Array | None:
  """``[B, T]`` int32 ids that encode packing and padding for a fused kernel, or None for neither.

  A token's (already ranked, ``dense_segment_ids``) document id, and one id of its own,
  ``int32 min``, shared by every padding token: real tokens never see padding ones, and no row is
  fully masked (padding tokens see each other).
  """
  if mask.valid is None and mask.segment_ids is None:
    return None
  ids = (
    jnp.zeros((batch, length), jnp.int32) if mask.segment_ids is None else mask.segment_ids.astype(jnp.int32)
  )
  if mask.valid is not None:
    ids = jnp.where(mask.valid.astype(bool), ids, jnp.iinfo(jnp.int32).min)
  return ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexMask:
  """Structured mask from slot indices: the arguments of ``dense_attention_mask`` as one pytree.

  Query t may attend key s when ``k_index[s] <= q_index[t]`` (if ``causal``), ``k_valid[s]`` and
  ``q_segment_ids[t] == k_segment_ids[s]``. Unlike ``AttentionMask`` the queries and keys need not be
  the same tokens: a KV cache (queries at slots ``end .. end + T - 1`` of S cache slots), or the
  context-parallel shards of a reordered sequence (each token keeps its original slot). The ``xla``
  backend of ``jaxpe.attention.attention`` evaluates it block by block (``jaxpe.attention.blockwise``),
  never as a ``[B, T, S]`` array; ``dense()`` gives that array for the dense reference.

  Attributes:
    q_index: ``[B, T]`` integer slot of each query in the sequence buffer (for causality; with a
      KV cache the cache slot, after a context-parallel reordering the original slot; not the
      position, which packed documents restart and padding repeats); distinct along each row.
    k_index: ``[B, S]`` integer slot of each key; distinct along each row.
    causal: static Python bool (a pytree meta field).
    k_valid: optional ``[B, S]`` bool (or integer, nonzero = valid), False for padding keys or empty
      cache slots.
    q_segment_ids, k_segment_ids: optional ``[B, T]`` / ``[B, S]`` integer document ids (the same
      dtype, any values, compared exactly); give both or neither.
    q_positions, k_positions: optional ``[B, T]`` / ``[B, S]`` integer token positions (>= 0, < 2^31)
      that ``chunk_size`` counts its chunks in (``jaxpe.attention.patterns``: query and key share a
      chunk when ``q_pos // c == k_pos // c``; Llama 4's chunks start at each row's first real
      token, as transformers' ``create_chunked_causal_mask``); give both or neither. None: the
      slots ``q_index`` / ``k_index`` (right for rows without left padding or packed documents).
      Windows compare the slots either way (a distance).

  Checked by ``check()`` (called by ``dense`` and by ``attention``), not at construction.
  """

  q_index: jax.Array
  k_index: jax.Array
  causal: bool = dataclasses.field(default=True, metadata=dict(static=True))
  k_valid: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  k_segment_ids: jax.Array | None = None
  q_positions: jax.Array | None = None
  k_positions: jax.Array | None = None

  def check(self) -> IndexMask:
    """This mask with its fields as checked arrays.

    Raises:
      ValueError: wrong ranks or shapes, mismatched batch sizes, concrete indices < 0 or >= 2^31
        or repeated along a row (token positions passed as slots), or only one of the segment ids
        given.
      TypeError: non-integer indices or segment ids (bool and float ids too), segment ids of two
        dtypes, a float ``k_valid``, a non-bool ``causal``.
    """
    causal = check_causal("causal", self.causal)
    q_segment_ids, k_segment_ids, k_valid = self.q_segment_ids, self.k_segment_ids, self.k_valid
    if (q_segment_ids is None) != (k_segment_ids is None):
      raise ValueError("q_segment_ids and k_segment_ids must be given together")
    q_positions, k_positions = self.q_positions, self.k_positions
    if (q_positions is None) != (k_positions is None):
      raise ValueError("q_positions and k_positions must be given together")
    if k_valid is not None:
      k_valid = check_valid("k_valid", k_valid)
    if q_segment_ids is not None:
      q_segment_ids = check_segment_ids("q_segment_ids", q_segment_ids)
      k_segment_ids = check_segment_ids("k_segment_ids", k_segment_ids)
      if jnp.result_type(q_segment_ids) != jnp.result_type(k_segment_ids):
        raise TypeError(
          "q_segment_ids and k_segment_ids must have the same integer dtype (compared exactly), got "
          f"{jnp.result_type(q_segment_ids)} and {jnp.result_type(k_segment_ids)}"
        )
    q_index, k_index = _checks.as_array("q_index", self.q_index), _checks.as_array("k_index", self.k_index)
    _checks.check_rank("q_index", q_index, 2, "[B, T]")
    _checks.check_rank("k_index", k_index, 2, "[B, S]")
    _checks.check_positions("q_index", q_index)
    _checks.check_positions("k_index", k_index)
    batch, t_len, s_len = q_index.shape[0], q_index.shape[1], k_index.shape[1]
    if k_index.shape[0] != batch:
      raise ValueError(
        f"q_index and k_index must have the same batch size B, got {batch} and {k_index.shape[0]}"
      )
    if q_positions is not None:  # the positions chunk_size counts
      q_positions, k_positions = (
        _checks.as_array(f"{s}_positions", x) for s, x in zip("qk", (q_positions, k_positions))
      )
      _checks.check_positions("q_positions", q_positions), _checks.check_positions("k_positions", k_positions)
    for name, arr, shape in (
      ("k_valid", k_valid, (batch, s_len)),
      ("q_segment_ids", q_segment_ids, (batch, t_len)),
      ("k_segment_ids", k_segment_ids, (batch, s_len)),
      ("q_positions", q_positions, (batch, t_len)),
      ("k_positions", k_positions, (batch, s_len)),
    ):
      if arr is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {arr.shape}")
    check_distinct_slots("q_index", q_index)
    check_distinct_slots("k_index", k_index)
    return IndexMask(
      q_index, k_index, causal, k_valid, q_segment_ids, k_segment_ids, q_positions, k_positions
    )

  def visible(self, q_rows=slice(None), k_cols=slice(None)) -> jax.Array:
    """``[B, t, s]`` bool: which keys ``k_cols`` the queries ``q_rows`` may attend (fields unchecked)."""
    q_index, k_index = self.q_index[:, q_rows], self.k_index[:, k_cols]
    mask = jnp.ones((q_index.shape[0], q_index.shape[1], k_index.shape[1]), bool)
    if self.causal:
      mask &= k_index[:, None, :] <= q_index[:, :, None]
    if self.k_valid is not None:
      mask &= self.k_valid[:, k_cols].astype(bool)[:, None, :]
    if self.q_segment_ids is not None:
      mask &= self.q_segment_ids[:, q_rows, None] == self.k_segment_ids[:, None, k_cols]
    return mask

  def dense(self) -> jax.Array:
    """The ``[B, 1, T, S]`` bool mask (True = may attend) of ``dense_attention_mask``.

    Raises:
      TypeError, ValueError: as ``check``; a mask larger than the device's memory.
    """
    mask = self.check()
    (batch, t_len), s_len = mask.q_index.shape, mask.k_index.shape[1]
    fix = "give shorter sequences, or pass the IndexMask / AttentionMask itself to attention (blockwise)"
    _checks.check_dense_fits("q_index / k_index", (batch, 1, t_len, s_len), np.bool_, fix)
    return mask.visible()[:, None, :, :]


SLOTS_NOT_POSITIONS = (
  "slot indices are distinct along each row (0..S-1, or the cache slots); token positions are not: "
  "positions_from_mask gives every padding token position 0 and positions_from_segment_ids restarts "
  "each document at 0, so a mask from positions lets real tokens see padding and other documents. "
  "For self-attention pass jaxpe.AttentionMask(valid=attention_mask, segment_ids=segment_ids) "
  "(.dense(B, T) for a bool array), or slots = jnp.arange(T) with k_valid=attention_mask and the "
  "segment ids"
)


def check_distinct_slots(name: str, index) -> None:
  """When ``index`` is concrete: no value repeats along a row (slots are buffer indices, each token
  has its own), else ValueError saying slots are not positions and what to pass instead
  (``SLOTS_NOT_POSITIONS``). Traced indices cannot be checked."""
  if isinstance(index, jax.core.Tracer):
    return
  arr = np.sort(np.asarray(index), axis=-1)
  repeated = arr[:, 1:] == arr[:, :-1]
  if repeated.any():
    row = int(np.argmax(repeated.any(axis=-1)))
    value = arr[row, 1:][repeated[row]][0]
    raise ValueError(
      f"{name} repeats slot {value} in row {row}: {name} holds slot indices, not token positions; "
      + SLOTS_NOT_POSITIONS
    )


def dense_attention_mask(
  q_index: jax.Array,
  k_index: jax.Array,
  *,
  causal: bool = True,
  k_valid: jax.Array | None = None,
  q_segment_ids: jax.Array | None = None,
  k_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """The dense boolean attention mask ``[B, 1, T, S]`` (True = may attend) from slot indices.

  The name says what it returns: the dense form of a mask, the one ``AttentionMask.dense()`` gives
  for the structured mask and the ``xla`` backend reads. It was ``make_attention_mask`` (still an
  alias, deprecated): Flax linen has a ``make_attention_mask(query_input, key_input, pairwise_fn)``
  with other arguments and meaning, and a Flax user reading the old name expected that one. Not
  ``position_mask``: it compares buffer slots (with a KV cache, cache slots), not token positions.

  Slots, not positions: with padding or packed documents the positions that RoPE or ALiBi take
  (``positions_from_mask``, ``positions_from_segment_ids``) repeat along a row (padding at 0, each
  document from 0), and a mask built from them lets real tokens attend padding and other documents
  without an error. Padding goes in ``k_valid``, documents in the segment ids, with the slots
  ``jnp.arange(T)``; for self-attention ``AttentionMask(valid=..., segment_ids=...).dense(B, T)``
  is this mask with no indices to get wrong. Concrete indices that repeat along a row are refused.

  Args:
    q_index: ``[B, T]`` integer slot index of each query in the sequence buffer (for causality;
      with a KV cache this is the cache slot, not the position); distinct along each row.
    k_index: ``[B, S]`` integer slot index of each key; distinct along each row.
    causal: static Python bool; if True, key slot ``s`` is visible to query slot ``t`` only when
      ``s <= t``.
    k_valid: optional ``[B, S]`` bool (or integer, nonzero = valid), False for padding keys (or
      empty cache slots).
    q_segment_ids, k_segment_ids: optional ``[B, T]``/``[B, S]`` integer document ids of packed
      sequences (any integer dtype, the same for both; any values, compared exactly);
      attention does not cross documents. Give both or neither.

  Returns:
    ``[B, 1, T, S]`` bool. A query row may be all False (e.g. a padding query under left padding);
    ``dot_product_attention`` returns zeros there.

  Raises:
    ValueError: wrong ranks or shapes, mismatched batch sizes, concrete indices < 0 or >= 2^31 or
      repeated along a row (positions passed as slots: the message says what to pass), or only
      one of the segment ids given.
    TypeError: non-integer indices or segment ids (bool and float ids too), segment ids of two
      dtypes, a float ``k_valid``,
      a non-bool ``causal``.
  """
  return IndexMask(
    q_index=q_index,
    k_index=k_index,
    causal=causal,
    k_valid=k_valid,
    q_segment_ids=q_segment_ids,
    k_segment_ids=k_segment_ids,
  ).dense()


def make_attention_mask(
  q_index: jax.Array,
  k_index: jax.Array,
  *,
  causal: bool = True,
  k_valid: jax.Array | None = None,
  q_segment_ids: jax.Array | None = None,
  k_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Deprecated alias of ``dense_attention_mask`` (same arguments, result and errors).

  Warns with a DeprecationWarning: the name is Flax linen's ``make_attention_mask(query_input,
  key_input, pairwise_fn)``, whose arguments differ. Will be removed with the other deprecated paths.
  """
  warnings.warn(
    "jaxpe.make_attention_mask is deprecated: use jaxpe.dense_attention_mask (same arguments); "
    "the old name is Flax linen's, which takes other arguments",
    DeprecationWarning,
    stacklevel=2,
  )
  return dense_attention_mask(
    q_index,
    k_index,
    causal=causal,
    k_valid=k_valid,
    q_segment_ids=q_segment_ids,
    k_segment_ids=k_segment_ids,
  )


def document_mask(
  q_segment_ids: jax.Array, k_segment_ids: jax.Array, *, causal: bool = True, q_offset: int = 0
) -> jax.Array:
  """Attention mask for packed sequences: a query sees only keys of its own document.

  Args:
    q_segment_ids: ``[B, T]`` integer document ids of the queries.
    k_segment_ids: ``[B, S]`` integer document ids of the keys.
    causal: a bool; also hide keys after the query (query t sits at key slot ``q_offset + t``).
    q_offset: key slot of the first query (``S - T`` for the last T tokens); int, ``0 <= q_offset``
      and ``q_offset + T <= 2^31``.

  Returns:
    ``[B, 1, T, S]`` bool, True = may attend (broadcasts over heads).

  Raises:
    ValueError: wrong ranks, batch sizes differ, ``q_offset`` negative or ``q_offset + T > 2^31``.
    TypeError: non-integer segment ids; ``q_offset`` not an int; ``causal`` not a bool.

  Source: the packed-example mask of t5x / Flax lm1b (Flax's ``make_attention_mask(segmentation,
  segmentation, jnp.equal)`` combined with the causal mask).
  """
  q_segment_ids = _checks.as_array("q_segment_ids", q_segment_ids)
  k_segment_ids = _checks.as_array("k_segment_ids", k_segment_ids)
  for name, ids in (("q_segment_ids", q_segment_ids), ("k_segment_ids", k_segment_ids)):
    _checks.check_rank(name, ids, 2, "[B, T]" if name[0] == "q" else "[B, S]")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype}")
  if q_segment_ids.shape[0] != k_segment_ids.shape[0]:
    raise ValueError(
      f"q_segment_ids and k_segment_ids must have the same batch size, got {q_segment_ids.shape[0]} "
      f"and {k_segment_ids.shape[0]}"
    )
  batch, t_len, s_len = q_segment_ids.shape[0], q_segment_ids.shape[1], k_segment_ids.shape[1]
  q_offset = _checks.check_index("q_offset", q_offset)
  if q_offset + t_len > _checks.MAX_POSITION:
    raise ValueError(f"q_offset + T must be <= 2^31 (int32 key slots), got {q_offset} + {t_len}")
  causal = _checks.check_bool("causal", causal)
  q_slot = jnp.broadcast_to(q_offset + jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
  k_slot = jnp.broadcast_to(jnp.arange(s_len, dtype=jnp.int32), (batch, s_len))
  return dense_attention_mask(
    q_slot, k_slot, causal=causal, q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids
  )
