"""CoPE, contextual position encoding (Golovneva et al. 2024, "Contextual Position Encoding: Learning
to Count What's Important", arXiv 2405.18719): positions counted by context-dependent gates.

For query i and key j (j <= i under the causal mask) the position is the sum of the gates of the
keys from j to i, ``p_ij = sum_{k=j..i} sigmoid(q_i . k_k * scale)`` (a fractional count, in
"gated tokens"), clamped to ``npos_max - 1``; its embedding is interpolated between the integer
positions' learned vectors ``e[p]`` (``pos_emb [H, npos_max]``), and enters the logits as
``q_i . e[p_ij]``. Computed as the paper's code does (its ``CoPE`` module): the logits
``z[i, p] = q_i . pos_emb[:, p]`` for every integer p, gathered at ``floor(p_ij)`` and
``ceil(p_ij)`` and mixed by ``w = p_ij - floor(p_ij)``.

The gates depend on q.k, so the bias is a dense ``[B, N, T, S]`` array per layer: it reaches
attention as a dense ``bias`` (``jaxpe.attention.attention``'s ``xla`` backend; fused kernels take
no bias). Pure JAX, Flax-free; ``pos_emb`` is the caller's parameter.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
P = npos_max.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.ops import checks as _checks


def cope_positions(gate_logits: jax.Array, mask: jax.Array | None = None, *, npos_max: int) -> jax.Array:
  """CoPE's contextual positions ``p_ij = min(sum_{k >= j, visible} sigmoid(z_ik), npos_max - 1)``.

  Args:
    gate_logits: ``[..., T, S]`` float gate logits (CoPE: the scaled attention logits
      ``q.k * scale``, before any position term).
    mask: optional bool broadcastable to ``gate_logits`` (True = key visible); hidden keys get gate 0,
      as ``attn_logits += mask.log()`` before the gates in the paper's code. Under the causal mask the
      sum runs from key j up to the query itself; with padding or packed documents it counts only
      the visible keys (a query's own document).
    npos_max: the number of integer positions P (an int >= 1); positions are clamped to ``P - 1``.

  Returns:
    ``[..., T, S]`` float32 positions in ``[0, P - 1]`` (fractional counts of gated keys), each the
    float64 sum of its float32 gates rounded once (within half an ulp of the count: 1.1e-4 at
    S 4096, where a float32 ``cumsum`` was 3.8e-4 off).

  Raises:
    ValueError: rank < 2, ``npos_max`` not an int >= 1, a mask that does not broadcast.
    TypeError: non-float ``gate_logits``, non-bool mask.

  Source: arXiv 2405.18719, the paper's ``CoPE.forward`` (``gates.flip(-1).cumsum(-1).flip(-1)``).
  """
  gate_logits = _checks.as_array("gate_logits", gate_logits)
  _checks.check_float("gate_logits", gate_logits)
  if jnp.ndim(gate_logits) < 2:
    raise ValueError(f"gate_logits must have shape [..., T, S] (rank >= 2), got {jnp.shape(gate_logits)}")
  npos_max = _checks.check_positive_int("npos_max", npos_max)
  gates = jax.nn.sigmoid(jnp.asarray(gate_logits).astype(jnp.float32))
  if mask is not None:
    mask = _check_mask(mask, gate_logits.shape)
    gates = jnp.where(mask, gates, 0.0)
  positions = _suffix_sum(gates)  # sum over keys k >= j, rounded once
  return jnp.minimum(positions, jnp.float32(npos_max - 1))


@jax.custom_jvp
def _suffix_sum(gates: jax.Array) -> jax.Array:
  """``sum_{k >= j} gates[..., k]`` over the last axis, float32, as the float64 sum rounded once.

  Gates are in ``[0, 1]``; each is split into a fixed-point integer ``round(g 2^b)`` (b bits with
  ``S 2^b < 2^31``: no int32 overflow) summed exactly in int32, and a float32 remainder of at most
  ``2^-(b+1)`` whose sum is nearly exact; the whole and fractional parts are then added once. A
  float32 ``cumsum`` (XLA's scan) instead rounds every partial sum: 3.8e-4 from float64 at S 4096
  against the 1.1e-4 of one rounding. NaN gates give NaN through the remainder. The derivative is
  the suffix sum of the tangents (``custom_jvp``: the rounding carries none)."""
  axis = gates.ndim - 1
  bits = max(31 - max(int(gates.shape[-1]).bit_length(), 1), 0)
  scale = jnp.float32(2.0**bits)
  fixed = jnp.round(gates * scale)  # exact integers <= 2^bits
  remainder = gates - fixed / scale  # exact
  whole = jax.lax.cumsum(fixed.astype(jnp.int32), axis=axis, reverse=True)  # exact, < 2^31
  ints = (whole >> bits).astype(jnp.float32)  # <= S, exact
  frac = (whole & jnp.int32(2**bits - 1)).astype(jnp.float32) / scale  # < 1, exact
  return ints + (frac + jax.lax.cumsum(remainder, axis=axis, reverse=True))


@_suffix_sum.defjvp
def _suffix_sum_jvp(primals, tangents):
  (gates,), (d_gates,) = primals, tangents
  return _suffix_sum(gates), jax.lax.cumsum(d_gates, axis=gates.ndim - 1, reverse=True)


def cope_bias(
  q: jax.Array,
  k: jax.Array,
  pos_emb: jax.Array,
  *,
  scale: float,
  mask: jax.Array | None = None,
) -> jax.Array:
  """CoPE's additive attention bias ``q_i . e[p_ij]`` with interpolated position embeddings.

  Args:
    q: ``[B, T, N, H]`` float queries (the same q as the attention's; the bias ``q . e`` is not
      scaled, as in the paper's code).
    k: ``[B, S, K, H]`` float keys; ``N % K == 0`` (grouped-query heads share their kv head).
    pos_emb: ``[H, P]`` float position embeddings shared by the heads (the paper's ``pos_emb``,
      ``[1, head_dim, npos_max]``), or ``[N, H, P]`` one table per head; P = npos_max >= 1.
    scale: multiplies q.k in the gate logits (the attention's scale, usually ``1/sqrt(H)``); a
      finite number > 0.
    mask: optional bool ``[B, 1|N, T, S]`` (True = key visible; causal, padding, documents, KV-cache
      slots): hidden keys count nothing. The bias at hidden keys is finite (the attention masks it).

  Returns:
    ``[B, N, T, S]`` float32 bias, to add to the scaled logits ``q.k * scale`` before the softmax.
    Differentiable in q, k (through the gates and the interpolation weight) and ``pos_emb``;
    ``floor`` / ``ceil`` of the positions carry no gradient (the paper's ``.long()``).

  Raises:
    ValueError: ranks or sizes that do not fit (B, H, N % K, pos_emb's H or N, P = 0), ``scale`` not
      a finite number > 0, a mask that does not broadcast to ``[B, N, T, S]``.
    TypeError: non-float q, k or pos_emb, a non-bool mask.

  Source: Golovneva et al. 2024, arXiv 2405.18719, the ``CoPE`` module of the paper (gates =
  sigmoid of the masked attention logits, reverse cumsum, clamp, ``logits_int = query @ pos_emb``,
  gather at floor / ceil, linear interpolation).
  """
  q, k, pos_emb = (_checks.as_array(name, x) for name, x in (("q", q), ("k", k), ("pos_emb", pos_emb)))
  for name, arr, hint in (("q", q, "[B, T, N, H]"), ("k", k, "[B, S, K, H]")):
    _checks.check_rank(name, arr, 4, hint)
    _checks.check_float(name, arr)
  _checks.check_float("pos_emb", pos_emb)
  scale = _checks.check_positive_float("scale", scale)
  batch, t_len, num_heads, head_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if num_heads == 0 or num_kv == 0 or num_heads % num_kv or k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"q, k must be [B, T, N, H], [B, S, K, H] with N % K == 0, got {q.shape}, {k.shape}")
  if pos_emb.ndim not in (2, 3) or pos_emb.shape[-2] != head_dim or pos_emb.shape[-1] == 0:
    raise ValueError(f"pos_emb must be [H, P] or [N, H, P] with H = {head_dim}, P >= 1, got {pos_emb.shape}")
  if pos_emb.ndim == 3 and pos_emb.shape[0] != num_heads:
    raise ValueError(f"pos_emb [N, H, P] must have N = {num_heads} tables, got {pos_emb.shape}")
  npos_max = pos_emb.shape[-1]
  fix = "CoPE's gates and positions are dense [B, N, T, S]: give shorter sequences"
  _checks.check_dense_fits("q / k", (batch, num_heads, t_len, s_len), jnp.float32, fix)
  f32 = jnp.float32
  group = num_heads // num_kv
  qg = q.reshape(batch, t_len, num_kv, group, head_dim)
  z = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=f32).reshape(
    batch, num_heads, t_len, s_len
  )
  if mask is not None:
    mask = _check_mask(mask, (batch, num_heads, t_len, s_len))
  positions = cope_positions(z * f32(scale), mask, npos_max=npos_max)  # [B, N, T, S]
  eq = "BTNH,HP->BNTP" if pos_emb.ndim == 2 else "BTNH,NHP->BNTP"
  logits_int = jnp.einsum(eq, q.astype(f32), pos_emb.astype(f32), preferred_element_type=f32)  # [B, N, T, P]
  floor = jax.lax.stop_gradient(jnp.floor(positions))
  ceil = jax.lax.stop_gradient(jnp.ceil(positions))
  at_floor = jnp.take_along_axis(logits_int, floor.astype(jnp.int32), axis=-1)
  at_ceil = jnp.take_along_axis(logits_int, ceil.astype(jnp.int32), axis=-1)
  w = positions - floor
  return at_ceil * w + at_floor * (1.0 - w)


def _check_mask(mask, shape) -> jax.Array:
  mask = _checks.as_array("mask", mask)
  if jnp.result_type(mask) != jnp.bool_:
    raise TypeError(f"mask must be a bool array (True = key visible), got dtype {jnp.result_type(mask)}")
  _checks.broadcastable("mask", mask.shape, tuple(shape), "[B, N, T, S]")
  return jnp.reshape(jnp.asarray(mask), (1,) * (len(shape) - mask.ndim) + tuple(mask.shape))


__all__ = ["cope_bias", "cope_positions"]
