"""Scaled dot-product attention that every positional-encoding variant goes through: the dense
reference (einsum, float32 logits), the ``xla`` backend of ``jaxpe.attention.attention``.

Einsum equations use the shape alphabet of the package docstring (B, T, S, N, K, H).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.interpreters.ad import JVPTracer

from jaxpe.attention import numerics
from jaxpe.attention import patterns as pattern_lib
from jaxpe.attention.masks import AttentionMask
from jaxpe.ops import checks as _checks


def default_precise_dims(precise_dims, qk_dim: int, v_dim: int):
  """``precise_dims`` as given, or, when None (the default of every attention entry point), the q/k
  dims beyond v's width, ``max(Hq - H, 0)``: dims that q and k carry and v does not are an emulation
  (``apply_rope_alibi``'s pairs, values ~1e5 whose products cancel down to the ALiBi bias), so they
  are contracted at float32 ``HIGHEST`` unless the caller says otherwise (``precise_dims=0``). A
  raw-ops user who composes ``apply_rope_alibi`` with attention and forgets the argument would
  otherwise get the default matmul precision on them: whole logits off on TF32 GPUs and bf16-pass
  TPUs (docs/emulation.md). With ``H = 0`` the default is 0. Other values are returned unchanged (the
  caller checks them)."""
  if precise_dims is None:
    # v without dims (H = 0) has no content to emulate a bias beside: nothing is precise
    return max(int(qk_dim) - int(v_dim), 0) if v_dim else 0
  return precise_dims


def check_precise_dims(precise_dims, qk_dim: int, v_dim: int) -> int:
  """``default_precise_dims``, then checked: an int in ``0..Hq``.

  Raises:
    TypeError: not an int (a bool, a float, a string).
    ValueError: outside ``0..Hq``.
  """
  precise_dims = default_precise_dims(precise_dims, qk_dim, v_dim)
  if isinstance(precise_dims, bool) or not isinstance(precise_dims, int | np.integer):
    raise TypeError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  if not 0 <= precise_dims <= qk_dim:
    raise ValueError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  return precise_dims


def check_scale(name: str, scale, *, traced_ok: bool = False):
  """A score scale: a real number, finite and > 0 (a Python bool is refused); under jit a traced
  scale passes when ``traced_ok`` (its value cannot be checked: NaN gives NaN outputs).

  Raises:
    TypeError: not a real number (None, a bool, a string, an array of more than one value).
    ValueError: NaN, inf, 0 or negative.
  """
  if isinstance(scale, jax.core.Tracer):
    if not traced_ok:
      raise TypeError(_checks.traced_message(name, "a concrete Python number here"))
    if jnp.ndim(scale) != 0 or not jnp.issubdtype(scale.dtype, jnp.floating):
      raise TypeError(f"{name} must be a float scalar, got a traced {scale.dtype} of shape {scale.shape}")
    return scale
  if scale is None or isinstance(scale, bool | np.bool_ | str | bytes) or np.ndim(scale) != 0:
    raise TypeError(f"{name} must be a real number (finite, > 0), got {scale!r}")
  if np.iscomplexobj(scale):
    raise TypeError(f"{name} must be a real number (finite, > 0), got {scale!r}")
  return _checks.check_positive_float(name, scale)


def check_not_forward_mode(name: str, *arrays) -> None:
  """TypeError naming the alternatives when any of ``arrays`` is differentiated in forward mode
  (``jax.jvp``, ``jax.jacfwd``: a ``JVPTracer`` at the top of the trace), for the paths whose
  derivative is a ``jax.custom_vjp`` (the blockwise online softmax, the CPU kernel), on which jax
  would raise only "can't apply forward-mode autodiff (jvp) to a custom_vjp function". Reverse mode
  (``jax.grad``, ``jax.vjp``, ``jax.jacrev``; ``jax.hessian``, forward over reverse) passes."""
  if any(isinstance(x, JVPTracer) for x in arrays):
    raise TypeError(
      f"{name} has no forward-mode derivative (jax.jvp, jax.jacfwd): its backward pass is a "
      "jax.custom_vjp. Use jaxpe.dot_product_attention (the dense reference, forward and reverse "
      "mode) with mask=mask.dense(...) and ALiBi as bias=jaxpe.alibi_bias(...), or reverse mode "
      "(jax.jacrev, jax.vjp, jax.grad), which gives the same derivatives"
    )


def dot_product_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float | None = None,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  is_causal: bool = False,
  precise_dims: int | None = None,
  causal_block: int | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
) -> jax.Array:
  """``softmax(softcap(q.k * scale) + bias, masked) . v`` with float32 logits and softmax.

  q and k may carry more dims than v (the RoPE-emulated ALiBi pair); ``scale`` is then still
  ``1/sqrt(H)`` of the original head dim. Grouped-query attention: the N query heads are split into
  K groups of N/K heads that share one kv head.

  Precision: the last ``precise_dims`` dims of q and k (the emulation dims, values ~1e5-1e6 whose
  products cancel down to the ALiBi bias) are contracted in float32 with ``precision=HIGHEST``,
  whatever ``jax.default_matmul_precision`` says (TF32 on recent NVIDIA GPUs, one bf16 pass on TPU
  would cost whole logits there), in the forward and the backward pass; the other dims use the
  default precision like every other score.

  Execution (results equal the textbook formula to float32 rounding): one softmax pass structure
  over the ``[B, N, T, S]`` scores (the row max, reused for the no-visible-key rule; unnormalised
  ``exp``; the row sum; the normalisation applied to the ``[B, T, N, H]`` output) and a hand-written
  backward pass (FlashAttention's ``dS = P * (dP - rowsum(dO * O))``, Dao et al. 2022, arXiv
  2205.14135, as the transpose of a hand-written ``jax.custom_jvp`` rule) that keeps the
  unnormalised probabilities instead of autodiff's chain of temporaries. With ``causal_block``, queries go in static blocks of that many tokens and each block
  meets only the keys up to its own end (about half the score work and memory of a causal mask).

  Differentiation: forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) and reverse mode
  (``jax.grad``, ``jax.vjp``, ``jax.jacrev``, grad of grad, ``jax.hessian``) in q, k, v and a float
  bias; the mask carries no tangent.

  Args:
    q: ``[B, T, N, Hq]`` float queries.
    k: ``[B, S, K, Hq]`` float keys; ``N % K == 0``.
    v: ``[B, S, K, H]`` float values.
    scale: multiplies q.k; a traced scale is folded into q (float32). Default None:
      ``1/sqrt(Hq - precise_dims)``, which is ``jax.nn.dot_product_attention``'s ``1/sqrt(Hq)``
      when q, k and v have one width, and ``1/sqrt(H)`` of the original head dim when q and k carry
      the emulation dims beyond v's width (the default ``precise_dims``). q/k wider than v for
      another reason (MLA's ``[nope | rope]`` heads) take ``scale`` explicitly.
    bias: optional float bias broadcastable to ``[B, N, T, S]`` (ALiBi), added after scaling.
    mask: optional bool mask broadcastable to ``[B, N, T, S]``; True = may attend. A row with no
      visible key (masked, a bias of -inf everywhere, or S = 0) returns zeros. For padding and
      packed documents: ``AttentionMask(valid=..., segment_ids=...).dense(B, T)`` (not a mask from
      positions, which padding and packing repeat).
    is_causal: static bool, default False; True hides key ``s > t`` from query ``t`` (the
      ``[T, S]`` lower triangle aligned at the top left, as ``jax.nn.dot_product_attention``),
      combined with ``mask`` and ``bias``; with T == S the keys past each query block are skipped
      (``causal_block``, default ``XLA_CAUSAL_BLOCK`` = 128 then).
    precise_dims: trailing dims of q and k contracted at float32 ``HIGHEST`` precision; 0..Hq.
      Default None: the dims beyond v's width, ``Hq - H`` (``default_precise_dims``).
    causal_block: optional query block size (int > 0) for self-attention with a causal mask: the
      caller promises that ``mask`` (or ``bias``) hides every key slot ``s > t`` from query slot
      ``t`` (so T == S); keys past a block's last query are then skipped, not computed and masked.
    local_window_size: optional ``(left, right)`` ints >= 0 (an int w: ``(w, w)``), as
      ``jax.nn.dot_product_attention``: query ``t`` sees key ``s`` only if ``t - left <= s <= t + right``
      (indices aligned at the top left, as ``is_causal``), combined with the other masks.
      transformers' ``sliding_window = w`` is ``(w - 1, 0)`` (with ``is_causal``).
    chunk_size: optional int >= 1 (Llama 4's ``attention_chunk_size``): query ``t`` sees key ``s``
      only if ``t // chunk_size == s // chunk_size``.
    logits_soft_cap: optional finite float > 0 (Gemma 2's ``attn_logit_softcapping``): the scaled
      scores become ``cap * tanh(q.k * scale / cap)`` before ``bias`` and the mask (transformers'
      ``gemma2.eager_attention_forward``). Not with ``precise_dims > 0`` (an emulated bias in q.k).

  Returns:
    ``[B, T, N, H]`` array of ``v.dtype``.

  Raises:
    ValueError: wrong ranks, mismatched batch/length/head/dim sizes, no heads (N or K = 0), float32
      scores ``[B, N, T, S]`` larger than the device's memory (named before allocation), bias
      or mask that do not broadcast, a concrete ``scale`` not a finite number > 0,
      ``precise_dims`` outside 0..Hq, ``causal_block`` not an int > 0, given with T != S, or given
      with neither ``mask`` nor ``bias``; ``local_window_size`` sides < 0 or not a pair,
      ``chunk_size`` < 1, ``logits_soft_cap`` NaN, inf or <= 0, or given with ``precise_dims > 0``.
    TypeError: ``local_window_size`` / ``chunk_size`` not ints (bools, floats), ``logits_soft_cap``
      not a concrete real number; non-float q/k/v/bias, a non-bool mask (an ``AttentionMask`` too: it goes to
      ``jaxpe.kernels.attention``), a ``scale`` that is not a real number (bool, string, array),
      a non-bool ``is_causal``.

  Under jit: a traced ``scale`` is not checked (NaN or inf give NaN outputs); a bias of -inf on a
  whole row, or a mask that hides a whole row, gives zeros for that row (and zero gradients); NaN in
  q, k, v or bias propagates to the rows it reaches (a NaN score gives its row NaN, never the zeros
  of an empty row); the values of keys that ``mask`` hides from every query (padding, empty cache
  slots) are replaced by zeros before ``P . V``: whatever they hold, NaN too, changes nothing.
  """
  q, k, v = (_checks.as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
  _checks.check_rank("q", q, 4, "[B, T, N, Hq]")
  _checks.check_rank("k", k, 4, "[B, S, K, Hq]")
  _checks.check_rank("v", v, 4, "[B, S, K, H]")
  for name, arr in (("q", q), ("k", k), ("v", v)):
    _checks.check_float(name, arr)
  is_causal = _checks.check_bool("is_causal", is_causal)
  if scale is not None:
    scale = check_scale("scale", scale, traced_ok=True)
  pattern = pattern_lib.check_pattern(local_window_size, chunk_size, logits_soft_cap)
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if num_kv == 0 or num_heads == 0:
    raise ValueError(f"q and k need at least one head (N >= 1, K >= 1), got N={num_heads}, K={num_kv}")
  if k.shape[0] != batch or k.shape[3] != qk_dim:
    raise ValueError(f"k must have shape [B, S, K, Hq] with B={batch}, Hq={qk_dim}, got {k.shape}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"v must have shape [B, S, K, H] with [B, S, K] = {k.shape[:3]}, got {v.shape}")
  if num_heads % num_kv:
    raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads K={num_kv}")
  full = (batch, num_heads, t_len, s_len)
  if bias is not None:
    bias = _checks.as_array("bias", bias)
    _checks.check_float("bias", bias)
    _checks.broadcastable("bias", bias.shape, full, "[B, N, T, S]")
  if mask is not None:
    if isinstance(mask, AttentionMask):
      raise TypeError(
        "mask must be a dense bool array here; an AttentionMask goes to jaxpe.kernels.attention "
        "(or use mask.dense(B, T))"
      )
    mask = _checks.as_array("mask", mask)
    _checks.broadcastable("mask", mask.shape, full, "[B, N, T, S]")
    if jnp.result_type(mask) != jnp.bool_:
      raise TypeError(f"mask must be a bool array (True = may attend), got dtype {jnp.result_type(mask)}")

  precise_dims = default_precise_dims(precise_dims, qk_dim, v.shape[-1])
  if not _checks.is_int(precise_dims) or not 0 <= precise_dims <= qk_dim:
    raise ValueError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  precise_dims = int(precise_dims)
  pattern_lib.check_cap_precise_dims(pattern, precise_dims)
  if pattern.masks:  # top-left aligned indices, as is_causal and jax.nn.dot_product_attention
    local = pattern_lib.dense_visible(
      pattern, pattern_lib.arange_positions(t_len), pattern_lib.arange_positions(s_len)
    )
    mask = local if mask is None else mask & local
  if scale is None:
    scale = 1.0 / math.sqrt(max(qk_dim - precise_dims, 1))
  if is_causal:
    causal = jnp.tril(jnp.ones((t_len, s_len), bool))[None, None]
    mask = causal if mask is None else mask & causal
    if causal_block is None and t_len == s_len:
      causal_block = DEFAULT_CAUSAL_BLOCK
  if causal_block is not None:
    if not _checks.is_int(causal_block) or causal_block <= 0:
      raise ValueError(f"causal_block must be an int > 0 (query block size), got {causal_block!r}")
    causal_block = int(causal_block)
    if s_len != t_len:
      raise ValueError(f"causal_block is for causal self-attention (T == S), got T={t_len}, S={s_len}")
    if mask is None and bias is None:
      raise ValueError(
        "causal_block needs the causal mask (or bias) it skips keys for; with mask=None and bias=None "
        "every key is visible (pass a causal mask, or drop causal_block)"
      )

  rows = t_len if causal_block is None else min(causal_block, t_len)  # the scores one einsum holds
  _checks.check_dense_fits(
    "q / k", (batch, num_heads, rows, s_len), np.float32,
    "the dense reference holds [B, N, T, S] float32 scores (T: causal_block rows when given); use "
    "blockwise_attention, or attention (its xla backend runs blockwise)",
  )  # fmt: skip
  if mask is not None:  # keys no query sees weigh 0, and their values (NaN too) never reach P.V
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))  # reduced before it is broadcast
    k, v = numerics.zero_hidden_keys(k, v, jnp.broadcast_to(jnp.any(m, axis=(1, 2)), (batch, s_len)))
  if s_len == 0:  # no key at all: every row is a row with no visible key
    return jnp.zeros((batch, t_len, num_heads, v.shape[-1]), v.dtype)
  if isinstance(scale, jax.core.Tracer):
    q, scale = q.astype(jnp.float32) * scale.astype(jnp.float32), 1.0
  group = num_heads // num_kv
  q = q.reshape(batch, t_len, num_kv, group, qk_dim)
  bias, mask = (None if x is None else _grouped(x, num_kv, group) for x in (bias, mask))
  attend = functools.partial(_attend_grouped, scale=scale, precise_dims=precise_dims, cap=pattern.cap)
  if causal_block is None or causal_block >= t_len:
    out = attend(q, k, v, bias, mask)
  else:
    outs = []
    for start in range(0, t_len, causal_block):
      end = min(start + causal_block, t_len)
      # the queries [start, end) see no key past end - 1: their rows of the scores stop there
      cut = functools.partial(_block, start=start, end=end)
      outs.append(attend(q[:, start:end], k[:, :end], v[:, :end], cut(bias), cut(mask)))
    out = jnp.concatenate(outs, axis=1)
  return out.reshape(batch, t_len, num_heads, v.shape[-1])


_LOWEST = float(jnp.finfo(jnp.float32).min)
DEFAULT_CAUSAL_BLOCK = 128  # the query block of is_causal (jaxpe.attention.xla.XLA_CAUSAL_BLOCK)


def _grouped(x: jax.Array, num_kv: int, group: int) -> jax.Array:
  """A bias or mask broadcastable to ``[B, N, T, S]`` as one broadcastable to ``[B, K, G, T, S]``."""
  b, n, t, s = x.shape
  return x.reshape(b, 1, 1, t, s) if n == 1 else x.reshape(b, num_kv, group, t, s)


def _block(x: jax.Array | None, *, start: int, end: int) -> jax.Array | None:
  """Rows ``start:end`` and columns ``:end`` of a bias or mask broadcastable to ``[..., T, S]``."""
  if x is None:
    return None
  rows = x[..., start:end, :] if x.shape[-2] > 1 else x
  return rows[..., :end] if x.shape[-1] > 1 else rows


def _attend_grouped(q, k, v, bias, mask, *, scale: float, precise_dims: int, cap=None) -> jax.Array:
  """q ``[B, T, K, G, Hq]``, k ``[B, S, K, Hq]``, v ``[B, S, K, H]``, bias/mask broadcastable to
  ``[B, K, G, T, S]`` -> ``[B, T, K, G, H]``, through ``_attend`` in the batched-matmul layout
  ``[B, K, G*T, .]`` (the G heads of a kv head share one matmul; the big operands stay row-major)."""
  batch, t_len, num_kv, group, _ = q.shape
  rows = group * t_len

  def flat(x):  # [b, k|1, g|1, T|1, S|1] -> [b, K|1, G*T|1, S|1]
    if x is None:
      return None
    if x.shape[2] == 1 and (x.shape[3] == 1 or group == 1):
      return x.reshape(x.shape[0], x.shape[1], x.shape[3], x.shape[4])
    x = jnp.broadcast_to(x, (x.shape[0], x.shape[1], group, t_len, x.shape[4]))
    return x.reshape(x.shape[0], x.shape[1], rows, x.shape[4])

  q_rows = jnp.moveaxis(q, 1, 3).reshape(batch, num_kv, rows, q.shape[-1])
  if cap is None:
    out = _attend(q_rows, k, v, flat(bias), flat(mask), scale, precise_dims)
  else:  # soft-capped scores: plain autodiff (forward and reverse mode) through the same formula
    out = _attention_forward(q_rows, k, v, flat(bias), flat(mask), scale, precise_dims, cap)[0].astype(
      v.dtype
    )
  return jnp.moveaxis(out.reshape(batch, num_kv, group, t_len, v.shape[-1]), 3, 1)


def _precise(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(
    eq,
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )


def _attention_forward(q, k, v, bias, mask, scale: float, precise_dims: int, cap: float | None = None):
  """(output ``[B, K, Q, H]`` float32, unnormalised probabilities ``e`` ``[B, K, Q, S]`` float32,
  ``1 / row sum`` ``[B, K, Q, 1]``, 0 on rows with no visible key)."""
  split = q.shape[-1] - precise_dims
  logits = jnp.einsum("BKQH,BSKH->BKQS", q[..., :split], k[..., :split], preferred_element_type=jnp.float32)
  if precise_dims:
    logits = logits + _precise("BKQH,BSKH->BKQS", q[..., split:], k[..., split:])
  logits = logits * jnp.float32(scale)
  if cap is not None:  # Gemma 2: cap * tanh(s / cap) before the bias and the mask
    logits = jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))
  if bias is not None:
    logits = jnp.maximum(logits + bias.astype(jnp.float32), _LOWEST)  # a -inf bias hides a key like the mask
  if mask is not None:
    logits = jnp.where(mask, logits, _LOWEST)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.exp(logits - row_max)
  total = jnp.sum(e, axis=-1, keepdims=True)
  inv_sum = 1.0 / total
  if mask is not None or bias is not None:
    # a row with no visible key (masked, or -inf bias everywhere) gives zeros, not a mean or NaN
    # (a NaN maximum or sum is seen: the row gives NaN)
    inv_sum = jnp.where(numerics.row_seen(row_max, total), inv_sum, 0.0)
  out = jnp.einsum("BKQS,BSKH->BKQH", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out * inv_sum, e, inv_sum


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _attend(q, k, v, bias, mask, scale: float, precise_dims: int):
  """``q [B, K, Q, Hq], k [B, S, K, Hq], v [B, S, K, H] -> [B, K, Q, H]`` (``v.dtype``); bias and
  mask broadcastable to ``[B, K, Q, S]``."""
  return _attention_forward(q, k, v, bias, mask, scale, precise_dims)[0].astype(v.dtype)


def _zero(tangent) -> bool:
  return tangent is None or isinstance(tangent, SymbolicZero)


@functools.partial(_attend.defjvp, symbolic_zeros=True)
def _attend_jvp(scale, precise_dims, primals, tangents):
  """The forward-mode rule, written so that its transpose is FlashAttention's backward pass.

  With ``P = e * inv_sum`` and ``ds`` the tangent of the scaled logits plus bias,
  ``d out = (P * ds) V - rowsum(P * ds) * out + P dV``. ``jax.jvp`` / ``jax.jacfwd`` evaluate it;
  reverse mode (``jax.grad``, ``jax.vjp``) transposes it: ``dV = P^T dO``,
  ``dS = P * (dO V^T - rowsum(dO * out))`` (Dao et al. 2022, arXiv 2205.14135), then
  ``dq = dS k * scale``, ``dk = dS^T q * scale`` (the precise dims at ``HIGHEST`` both ways) and
  ``d bias = dS`` summed over its broadcast axes, from the residuals ``e`` (one score-sized array),
  ``inv_sum``, ``out``, q, k, v, as the earlier ``custom_vjp`` kept. Tangents that are symbolic
  zeros (the arguments not differentiated) cost nothing.
  """
  q, k, v, bias, mask = primals
  d_q, d_k, d_v, d_bias, _ = tangents
  out, e, inv_sum = _attention_forward(q, k, v, bias, mask, scale, precise_dims)
  f32 = dict(preferred_element_type=jnp.float32)
  split = q.shape[-1] - precise_dims
  terms = []
  # the scale multiplies the small tangent operand, not the [Q, S] product (whose transpose would
  # then be a score-sized broadcast of the scale that XLA:CPU materialises)
  for a, b in ((None if _zero(d_q) else d_q * scale, k), (q, None if _zero(d_k) else d_k * scale)):
    if a is None or b is None:
      continue
    term = jnp.einsum("BKQH,BSKH->BKQS", a[..., :split], b[..., :split], **f32)
    if precise_dims:
      term = term + _precise("BKQH,BSKH->BKQS", a[..., split:], b[..., split:])
    terms.append(term)
  d_s = sum(terms[1:], terms[0]) if terms else None
  if bias is not None and not _zero(d_bias):
    d_bias = d_bias.astype(jnp.float32)
    d_s = d_bias if d_s is None else d_s + d_bias
  # e is the one score-sized residual of reverse mode: every product with it takes a tangent
  # (e * (d_s * inv_sum), not (e * inv_sum) * d_s, which would keep P = e * inv_sum as well)
  d_out = jnp.zeros(out.shape, jnp.float32)
  if d_s is not None:
    p_ds = e * (d_s * inv_sum)
    d_out = jnp.einsum("BKQS,BSKH->BKQH", p_ds.astype(v.dtype), v, **f32)
    d_out = d_out - jnp.sum(p_ds, axis=-1, keepdims=True) * out
  if not _zero(d_v):
    d_out = d_out + jnp.einsum("BKQS,BSKH->BKQH", e.astype(v.dtype), d_v.astype(v.dtype), **f32) * inv_sum
  return out.astype(v.dtype), d_out.astype(v.dtype)
