"""Scaled dot-product attention that every positional-encoding variant goes through.

Einsum equations use the shape alphabet of the package docstring (B, T, S, N, K, H).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpe import _checks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Structured self-attention mask: what fused kernels take instead of a dense ``[B, 1, T, S]`` mask.

  Queries and keys are the same T tokens (no KV cache: key slot t is query slot t). Query t may
  attend key s when ``s <= t`` (if ``causal``), ``valid[s]`` and ``segment_ids[t] == segment_ids[s]``.
  ``dense()`` gives the equivalent bool mask for the ``xla`` backend.

  Attributes:
    valid: optional ``[B, T]`` bool, False for padding tokens (left or right padding).
    segment_ids: optional ``[B, T]`` integer document ids of packed sequences.
    causal: static bool (a pytree meta field, so jit and scan see it as a Python bool).
  """

  valid: jax.Array | None = None
  segment_ids: jax.Array | None = None
  causal: bool = dataclasses.field(default=True, metadata=dict(static=True))

  def dense(self, batch: int, length: int) -> jax.Array:
    """The ``[B, 1, T, T]`` bool mask (True = may attend) of ``make_attention_mask``."""
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return make_attention_mask(
      index,
      index,
      causal=self.causal,
      k_valid=self.valid,
      q_segment_ids=self.segment_ids,
      k_segment_ids=self.segment_ids,
    )


def make_attention_mask(
  q_index: jax.Array,
  k_index: jax.Array,
  *,
  causal: bool = True,
  k_valid: jax.Array | None = None,
  q_segment_ids: jax.Array | None = None,
  k_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Boolean attention mask (True = may attend).

  Args:
    q_index: ``[B, T]`` integer slot index of each query in the sequence buffer (for causality;
      with a KV cache this is the cache slot, not the position).
    k_index: ``[B, S]`` integer slot index of each key.
    causal: if True, key slot ``s`` is visible to query slot ``t`` only when ``s <= t``.
    k_valid: optional ``[B, S]`` bool, False for padding keys (or empty cache slots).
    q_segment_ids, k_segment_ids: optional ``[B, T]``/``[B, S]`` integer document ids of packed
      sequences; attention does not cross documents. Give both or neither.

  Returns:
    ``[B, 1, T, S]`` bool.

  Raises:
    ValueError: wrong ranks or shapes, mismatched batch sizes, negative indices, or only one of
      the segment ids given.
    TypeError: non-integer indices.
  """
  _checks.check_rank("q_index", q_index, 2, "[B, T]")
  _checks.check_rank("k_index", k_index, 2, "[B, S]")
  _checks.check_positions("q_index", q_index)
  _checks.check_positions("k_index", k_index)
  batch, t_len, s_len = q_index.shape[0], q_index.shape[1], k_index.shape[1]
  if k_index.shape[0] != batch:
    raise ValueError(
      f"q_index and k_index must have the same batch size B, got {batch} and {k_index.shape[0]}"
    )
  for name, arr, shape in (
    ("k_valid", k_valid, (batch, s_len)),
    ("q_segment_ids", q_segment_ids, (batch, t_len)),
    ("k_segment_ids", k_segment_ids, (batch, s_len)),
  ):
    if arr is not None and arr.shape != shape:
      raise ValueError(f"{name} must have shape {list(shape)}, got {arr.shape}")
  mask = jnp.ones((batch, t_len, s_len), bool)
  if causal:
    mask &= k_index[:, None, :] <= q_index[:, :, None]
  if k_valid is not None:
    mask &= k_valid.astype(bool)[:, None, :]
  if (q_segment_ids is None) != (k_segment_ids is None):
    raise ValueError("q_segment_ids and k_segment_ids must be given together")
  if q_segment_ids is not None:
    mask &= q_segment_ids[:, :, None] == k_segment_ids[:, None, :]
  return mask[:, None, :, :]


def dot_product_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  precise_dims: int = 0,
) -> jax.Array:
  """``softmax(q.k * scale + bias, masked) . v`` with float32 logits and softmax.

  q and k may carry more dims than v (the RoPE-emulated ALiBi pair); ``scale`` is then still
  ``1/sqrt(H)`` of the original head dim. Grouped-query attention: the N query heads are split into
  K groups of N/K heads that share one kv head.

  Precision: the last ``precise_dims`` dims of q and k (the emulation dims, values ~1e5-1e6 whose
  products cancel down to the ALiBi bias) are contracted in float32 with ``precision=HIGHEST``,
  whatever ``jax.default_matmul_precision`` says (TF32 on recent NVIDIA GPUs, one bf16 pass on TPU
  would cost whole logits there); the other dims use the default precision like every other score.

  Args:
    q: ``[B, T, N, Hq]`` float queries.
    k: ``[B, S, K, Hq]`` float keys; ``N % K == 0``.
    v: ``[B, S, K, H]`` float values.
    scale: multiplies q.k, usually ``1/sqrt(H)``.
    bias: optional float bias broadcastable to ``[B, N, T, S]`` (ALiBi), added after scaling.
    mask: optional bool mask broadcastable to ``[B, N, T, S]``; True = may attend. A row with no
      visible key (masked, or a bias of -inf everywhere) returns zeros.
    precise_dims: trailing dims of q and k contracted at float32 ``HIGHEST`` precision; 0..Hq.

  Returns:
    ``[B, T, N, H]`` array of ``v.dtype``.

  Raises:
    ValueError: wrong ranks, mismatched batch/length/head/dim sizes, bias or mask that do not
      broadcast, ``scale`` not a finite number > 0, ``precise_dims`` outside 0..Hq.
    TypeError: non-float q/k/v or a non-bool mask.
  """
  _checks.check_rank("q", q, 4, "[B, T, N, Hq]")
  _checks.check_rank("k", k, 4, "[B, S, K, Hq]")
  _checks.check_rank("v", v, 4, "[B, S, K, H]")
  for name, arr in (("q", q), ("k", k), ("v", v)):
    _checks.check_float(name, arr)
  if not isinstance(scale, jax.core.Tracer):
    _checks.check_positive_float("scale", scale)
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if k.shape[0] != batch or k.shape[3] != qk_dim:
    raise ValueError(f"k must have shape [B, S, K, Hq] with B={batch}, Hq={qk_dim}, got {k.shape}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"v must have shape [B, S, K, H] with [B, S, K] = {k.shape[:3]}, got {v.shape}")
  if num_heads % num_kv:
    raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads K={num_kv}")
  full = (batch, num_heads, t_len, s_len)
  if bias is not None:
    _checks.broadcastable("bias", bias.shape, full, "[B, N, T, S]")
  if mask is not None:
    _checks.broadcastable("mask", mask.shape, full, "[B, N, T, S]")
    if jnp.result_type(mask) != jnp.bool_:
      raise TypeError(f"mask must be a bool array (True = may attend), got dtype {jnp.result_type(mask)}")

  if isinstance(precise_dims, bool) or not isinstance(precise_dims, int) or not 0 <= precise_dims <= qk_dim:
    raise ValueError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")

  group = num_heads // num_kv
  q_grouped = q.reshape(batch, t_len, num_kv, group, qk_dim)
  split = qk_dim - precise_dims
  eq = "BTKGH,BSKH->BKGTS"
  logits = jnp.einsum(eq, q_grouped[..., :split], k[..., :split], preferred_element_type=jnp.float32)
  if precise_dims:
    logits = logits + jnp.einsum(
      eq,
      q_grouped[..., split:].astype(jnp.float32),
      k[..., split:].astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32,
    )
  logits = logits.reshape(full) * jnp.float32(scale)
  lowest = jnp.finfo(jnp.float32).min
  if bias is not None:
    logits = jnp.maximum(logits + bias.astype(jnp.float32), lowest)  # a -inf bias hides a key like the mask
  if mask is not None:
    logits = jnp.where(mask, logits, lowest)
  weights = jax.nn.softmax(logits, axis=-1)
  if mask is not None or bias is not None:
    # a row with no visible key (masked, or -inf bias everywhere) gives zeros, not a mean or NaN
    visible = jnp.max(logits, axis=-1, keepdims=True) > lowest
    weights = jnp.where(visible, weights, 0.0)
  weights = weights.reshape(batch, num_kv, group, t_len, s_len).astype(v.dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", weights, v)
  return out.reshape(batch, t_len, num_heads, v.shape[-1])
