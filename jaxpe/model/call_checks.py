"""The argument checks of ``jaxpe.model.decoder.Decoder.__call__`` (``check_call``,
``check_logits_index``): shapes, dtypes and ranges, named by argument, at trace time.

Shape alphabet: B batch, T tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import masks
from jaxpe.model import partitioning
from jaxpe.model.config import ModelConfig
from jaxpe.ops import checks as _checks


def check_call(cfg: ModelConfig, tokens, positions, attention_mask, segment_ids, slot_index, cache):
  """The static checks of ``Decoder.__call__``; returns the arguments as JAX arrays."""

  # _checks.as_array keeps numpy as numpy until checked (jnp.asarray would wrap int64 values to int32)
  # and names the argument for a ragged list or strings.
  tokens = _checks.as_array("tokens", tokens)
  _checks.check_rank("tokens", tokens, 2, "[B, T]")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
  if 0 in tokens.shape:
    raise ValueError(
      f"tokens must hold at least one token in at least one row (B, T >= 1), got shape {tokens.shape}"
    )
  _checks.check_index_range("tokens", tokens, cfg.vocab_size, "vocab_size")
  shape = tokens.shape

  def same_shape(name, x):
    if tuple(x.shape) != tuple(shape):
      raise ValueError(f"{name} must have the shape of tokens [B, T] = {tuple(shape)}, got {tuple(x.shape)}")

  if positions is not None:
    positions = _checks.as_array("positions", positions)
    same_shape("positions", positions)
    _checks.check_positions("positions", positions)
  if attention_mask is not None:
    attention_mask = _checks.as_array("attention_mask", attention_mask)
    same_shape("attention_mask", attention_mask)
    if not (attention_mask.dtype == jnp.bool_ or jnp.issubdtype(attention_mask.dtype, jnp.integer)):
      raise TypeError(
        f"attention_mask must be bool or integer (nonzero = real token), got dtype {attention_mask.dtype}"
      )
  if segment_ids is not None:
    if cache is not None:
      raise ValueError("segment_ids (packed sequences) cannot be combined with a KV cache")
    segment_ids = _checks.as_array("segment_ids", segment_ids)
    same_shape("segment_ids", segment_ids)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise TypeError(f"segment_ids must be an integer array of document ids, got dtype {segment_ids.dtype}")
    if np.dtype(segment_ids.dtype).itemsize > 4 or segment_ids.dtype == np.uint32:
      # ids int32 cannot hold (int64 0 and 2^32 are two documents): ranked exactly, never cast
      segment_ids = masks.dense_segment_ids(segment_ids)

  split = partitioning.sequence_split()
  if slot_index is not None:
    if cache is not None:
      raise ValueError("slot_index (reordered tokens) cannot be combined with a KV cache")
    slot_index = _checks.as_array("slot_index", slot_index)
    same_shape("slot_index", slot_index)
    if not jnp.issubdtype(slot_index.dtype, jnp.integer):
      raise TypeError(f"slot_index must hold integer slots, got dtype {slot_index.dtype}")
    _checks.check_positions("slot_index", slot_index)
    if positions is None and (attention_mask is not None or segment_ids is not None):
      raise ValueError(
        "slot_index with attention_mask or segment_ids needs the reordered tokens' positions: derive them "
        "in slot order (jaxpe.model.partitioning.zigzag_inputs does) and pass positions="
      )
  if split is not None and shape[1] % partitioning.sequence_shards():
    raise ValueError(
      f"T ({shape[1]}) must be divisible by the {partitioning.sequence_shards()} devices of the mesh axes "
      f"{list(split[1])} the sequence is split over (logical_rules.length)"
    )
  if cache is None and (slot_index is not None or split is not None):
    # auto runs these on xla (an IndexMask); an explicit fused backend is refused
    if cfg.attn_implementation not in ("xla", "auto"):
      what = (
        "slot_index (reordered tokens)" if split is None else f"a sequence split over mesh axes {split[1]}"
      )
      raise ValueError(
        f"{what} runs attention on the xla backend; set attn_implementation='xla' (or 'auto'), got "
        f"{cfg.attn_implementation!r}"
      )

  def to_jax(x):
    return None if x is None else jnp.asarray(x)

  return to_jax(tokens), to_jax(positions), to_jax(attention_mask), to_jax(segment_ids), to_jax(slot_index)


def check_logits_index(index, batch: int, t_len: int) -> jax.Array:
  """``logits_index`` as ``[B]`` int32 (a concrete one in ``[0, T)``)."""
  index = _checks.as_array("logits_index", index)
  if not jnp.issubdtype(index.dtype, jnp.integer):
    raise TypeError(f"logits_index must hold integer token indices, got dtype {index.dtype}")
  if tuple(index.shape) != (batch,):
    raise ValueError(f"logits_index must have shape [B] = [{batch}], got {tuple(index.shape)}")
  if not isinstance(index, jax.core.Tracer):
    arr = np.asarray(index)
    if arr.size and (arr.min() < 0 or arr.max() >= t_len):
      raise ValueError(f"logits_index must be in [0, T = {t_len}), got values {np.unique(arr).tolist()}")
  return jnp.clip(jnp.asarray(index).astype(jnp.int32), 0, t_len - 1)
