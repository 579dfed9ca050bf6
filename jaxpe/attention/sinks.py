"""Attention sinks: a learned logit per head in the softmax denominator, with no value.

``softmax`` over a row's keys gets one more term, ``exp(sink_h)``, that attends to nothing: row
weights ``p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k))`` sum to less than one, so a head can
put its weight "nowhere" instead of on the first tokens (Xiao et al. 2023, "Efficient Streaming
Language Models with Attention Sinks", arXiv 2309.17453, learned form as in gpt-oss: HF
transformers ``models/gpt_oss/modeling_gpt_oss.py``, ``eager_attention_forward``, ``module.sinks``
``[N]``). ``sinks`` are in logit units: the same units as the scaled, biased scores ``q.k * scale
+ bias``.

Two exact ways, one per ``xla`` path of ``jaxpe.attention.attention``:

- blockwise (structured masks): from the log-sum-exp of the row, ``out_sink = out *
  sigmoid(lse - sink)`` (``e^lse / (e^lse + e^sink)`` rescales the normalised output), one
  elementwise pass over ``[B, T, N, H]`` after the online softmax; gradients reach q, k, v through
  the output and the lse (``flash`` takes an lse cotangent) and ``sinks`` through the sigmoid.
- dense (a bias or dense mask the caller built): one more key slot with k = 0, v = 0, bias
  ``sink_h`` and always visible (``with_sink_key``), through the dense reference.

Rows with no visible key stay zeros (``lse = -inf``: sigmoid 0; the sink key has v = 0).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.ops import checks as _checks


def check_sinks(sinks, num_heads: int) -> jax.Array:
  """``sinks`` as a float array ``[N]`` (traced values are fine: a learned parameter).

  Raises:
    ValueError: not of shape ``[N]`` = ``[num_heads]``.
    TypeError: not a float array.
  """
  sinks = _checks.as_array("sinks", sinks)
  _checks.check_float("sinks", sinks)
  if tuple(sinks.shape) != (num_heads,):
    raise ValueError(
      f"sinks must be a float array [N] = [{num_heads}] (one logit per query head), got shape "
      f"{tuple(sinks.shape)}"
    )
  return jnp.asarray(sinks)


def apply_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Adds the sink term to an attention given with its log-sum-exp.

  Args:
    out: ``[B, T, N, H]`` attention output normalised over the keys alone.
    lse: ``[B, T, N]`` float32 log-sum-exp of the row's scaled, biased scores (``-inf``: no key).
    sinks: ``[N]`` float sink logits.

  Returns:
    ``(out * sigmoid(lse - sink) [B, T, N, H] of out's dtype, logaddexp(lse, sink) [B, T, N]
    float32)``: the attention with the sink in the denominator and that denominator's log.
  """
  sinks = sinks.astype(jnp.float32)[None, None, :]
  weight = jax.nn.sigmoid(lse - sinks)  # e^lse / (e^lse + e^sink); 0 where lse = -inf
  out = (out.astype(jnp.float32) * weight[..., None]).astype(out.dtype)
  return out, jnp.logaddexp(lse, sinks)


def with_sink_key(q, k, v, bias, mask, sinks):
  """The dense path's sink: ``(k, v, bias, mask)`` with one more key slot ``S`` that every query
  sees, k = 0 and v = 0 there (score ``q.0 = 0``) and bias ``sink_h`` (its logit).

  Args:
    q: ``[B, T, N, Hq]``; k: ``[B, S, K, Hq]``; v: ``[B, S, K, H]``.
    bias: None or float broadcastable to ``[B, N, T, S]``; mask: None or bool broadcastable to it.
    sinks: ``[N]`` float.

  Returns:
    k ``[B, S+1, K, Hq]``, v ``[B, S+1, K, H]``, bias ``[B, N, T, S+1]`` float32, mask None or
    ``[B, 1|N, T, S+1]`` bool.
  """
  batch, t_len, num_heads = q.shape[:3]
  s_len = k.shape[1]
  k = jnp.concatenate([k, jnp.zeros((batch, 1, *k.shape[2:]), k.dtype)], axis=1)
  v = jnp.concatenate([v, jnp.zeros((batch, 1, *v.shape[2:]), v.dtype)], axis=1)
  full = (batch, num_heads, t_len, s_len)
  bias = jnp.zeros(full, jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32), full)
  sink_col = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (batch, num_heads, t_len, 1))
  bias = jnp.concatenate([bias, sink_col], axis=-1)
  if mask is not None:
    mask = jnp.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))
    heads = 1 if mask.shape[1] == 1 else num_heads
    mask = jnp.broadcast_to(mask, (batch, heads, t_len, s_len))
    mask = jnp.concatenate([mask, jnp.ones((batch, heads, t_len, 1), bool)], axis=-1)
  return k, v, bias, mask


__all__ = ["apply_sinks", "check_sinks", "with_sink_key"]
