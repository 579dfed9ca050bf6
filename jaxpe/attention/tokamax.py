"""The ``tokamax`` backend: ``tokamax.dot_product_attention`` with ALiBi as a native broadcast bias.

Present only where the optional package ``tokamax`` (openxla/tokamax) is installed
(``backends.available_backends`` lists it then). tokamax picks its own kernel: Pallas Mosaic GPU
(sm90/sm100), Pallas Triton (GPU), else its XLA implementation (CPU: dense logits, no interpret mode).
Its kernels broadcast size-1 bias axes, so ALiBi goes in as BLOOM's key-only bias
``m_h * (k_j - min_j k_j)`` (``[B, N, 1, S]`` float32: O(S) memory, no emulation dims; the row's
smallest key position subtracted in int32). That bias differs from ALiBi's ``-m_h (i - j)`` by
``-m_h (i - min_j k_j)``, constant along each softmax row, so the attention output is the same;
its float32 rounding grows with ``m_h * S`` (about ``2^-24 * 0.5 * S`` logits, 2e-3 at S 64k).

Masks: ``AttentionMask.causal`` as ``is_causal``; padding and packed segments as a dense bool
``[B, 1, T, S]`` mask (O(T^2) bool, as for cudnn), padding rows zeroed; a dense bool mask and a dense
float bias pass through. No KV cache (``IndexMask``), no attention sinks. tokamax reads its
options as absl flags parsed from ``sys.argv``; where absl has parsed nothing, the first call marks
absl's flags parsed with their defaults (so another program's command line is not read as absl's).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
Source: openxla/tokamax ``tokamax/_src/ops/attention/api.py`` (``dot_product_attention``); ALiBi,
Press et al., arXiv 2108.12409; BLOOM's key-only form, HF ``build_alibi_tensor``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.masks import AttentionMask, IndexMask, kernel_segment_ids


def alibi_key_bias(spec: AlibiSpec) -> jax.Array:
  """BLOOM's key-only ALiBi bias ``m_h * (k_positions[b, j] - min_j k_positions[b, j])``: ``[B, N, 1, S]`` float32.

  ``spec`` already checked (``check_alibi_spec``). Differs from ``-m_h (i - j)`` by a per-row
  constant, which softmax ignores. The row's smallest key position is subtracted in int32 first, so
  the distances are exact (spans below 2^24) whatever the positions' size.
  """
  slopes = jnp.asarray(spec.slopes, jnp.float32)
  k_pos = jnp.asarray(spec.k_positions).astype(jnp.int32)
  if k_pos.shape[1]:
    k_pos = k_pos - jnp.min(k_pos, axis=1, keepdims=True)
  k_pos = k_pos.astype(jnp.float32)
  return slopes[None, :, None, None] * k_pos[:, None, None, :]


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: AttentionMask | jax.Array | None,
  *,
  scale: float,
  interpret: bool = False,
  bias: jax.Array | None = None,
  alibi_spec: AlibiSpec | None = None,
  precise_dims: int = 0,
  sinks: jax.Array | None = None,
  pattern=None,
) -> jax.Array:
  """``jaxpe.attention.attention`` on tokamax, its shared checks done: ``[B, T, N, H]`` of ``v.dtype``.

  Args:
    q: ``[B, T, N, Hq]``; k: ``[B, S, K, Hq]``; v: ``[B, S, K, H]`` (tokamax takes H != Hq and N % K == 0).
    mask: a checked ``AttentionMask``, a dense bool ``[B, 1|N, T, S]`` mask, or None.
    scale: score scale (checked). interpret: unused (tokamax has no interpret mode; on CPU it runs
      its XLA implementation).
    bias: optional dense float ``[B, N, T, S]`` bias. alibi_spec: checked ``AlibiSpec``, native.
    precise_dims: > 0 contracts q.k at ``precision=HIGHEST`` (tokamax takes one precision for all dims).
    sinks: must be None.
    pattern: a checked ``jaxpe.attention.patterns.Pattern``: its window as tokamax's
      ``local_window_size`` (the same convention), its cap as ``logits_soft_cap`` (tokamax caps
      ``scale * q.k + bias``: the same as Gemma 2's cap only without a bias, so a bias or ALiBi
      with the cap is refused); no chunks (``patterns.refuse``).

  Raises:
    ValueError: ``sinks`` given; an ``IndexMask`` (the KV cache runs on ``xla``); ``logits_soft_cap``
      with a bias or ALiBi.
  """
  import tokamax  # optional: on first use
  from absl import flags  # tokamax's dependency

  if not flags.FLAGS.is_parsed():
    # tokamax reads its config flags by parsing sys.argv with absl, which fails on any other program's
    # options (pytest's, argparse's): take absl's defaults instead (an absl app parses its own first).
    flags.FLAGS.mark_as_parsed()
  del interpret
  if sinks is not None:
    raise ValueError(
      "attention implementation 'tokamax' takes no attention sinks; sinks run on 'xla' and 'splash'"
    )
  if isinstance(mask, IndexMask):
    raise ValueError(
      "attention implementation 'tokamax' takes an AttentionMask or a dense bool mask, not an IndexMask; "
      "KV-cache decoding runs on implementation='xla'"
    )
  batch, t_len = q.shape[:2]
  causal, dense, valid = False, None, None
  if isinstance(mask, AttentionMask):
    causal, valid = mask.causal, mask.valid
    ids = kernel_segment_ids(mask, batch, t_len)
    dense = None if ids is None else ids[:, None, :, None] == ids[:, None, None, :]
  elif mask is not None:
    dense = jnp.asarray(mask, bool)
  window = cap = None
  if pattern is not None:
    window, cap = pattern.window, pattern.cap
    if cap is not None and (bias is not None or alibi_spec is not None):
      raise ValueError(
        "attention implementation 'tokamax' with logits_soft_cap and a bias or alibi_spec: tokamax caps "
        "scale * q.k + bias, Gemma 2 caps before the bias; use implementation='xla'"
      )
  if alibi_spec is not None:
    native = alibi_key_bias(alibi_spec)
    bias = native if bias is None else bias.astype(jnp.float32) + native
  precision = jax.lax.Precision.HIGHEST if precise_dims else None
  # tokamax relies on implicit rank promotion and standard dtype promotion inside
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    out = tokamax.dot_product_attention(
      q, k, v, bias=bias, mask=dense, scale=scale, is_causal=causal, precision=precision,
      **({} if window is None else {"local_window_size": window}),
      **({} if cap is None else {"logits_soft_cap": cap}),
    )  # fmt: skip
  if valid is not None:
    out = jnp.where(valid.astype(bool)[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out.astype(v.dtype)
