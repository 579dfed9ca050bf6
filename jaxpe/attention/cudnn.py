"""The ``cudnn`` backend: cuDNN flash attention through ``jax.nn.dot_product_attention`` (NVIDIA GPU).

q, k, v go in as bf16 (float16 when the values are float16), head dims up to
``CUDNN_MAX_HEAD_DIM`` in multiples of 8 (``jaxpe.attention.fused`` prepares them). No segment ids:
padding and packing go in as a dense mask.

Shape alphabet: B batch, T query positions, N heads, K kv heads, D kernel head dim.
"""

from __future__ import annotations

import jax

from jaxpe.attention.masks import AttentionMask, kernel_segment_ids
from jaxpe.attention.patterns import Pattern

NOT_DETECTED = (
  "attention implementation 'cudnn' cannot be traced on this host: jax finds no cuDNN here (it reads "
  "the version from the jax CUDA plugin, pip install 'jax[cuda12]'), so a program for 'cuda' cannot be "
  "lowered with it; lower with implementation='flash' or 'auto' (which then uses flash on cuda)"
)
"""The refusal of ``cudnn`` on ``cuda`` from a host whose jax has no CUDA plugin."""


def detected() -> bool:
  """Whether jax can trace cuDNN attention here: ``jax.nn.dot_product_attention(implementation="cudnn")``
  reads the cuDNN version at trace time from the jax CUDA plugin and raises without it (a CPU-only host)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo  # noqa: PLC0415  (private: the version check)

    fused_attention_stablehlo.check_cudnn_version()
  except (ImportError, RuntimeError, AttributeError):
    return False
  return True


def local_window(mask: AttentionMask, pattern: Pattern | None) -> tuple[int, int] | None:
  """``jax.nn.dot_product_attention``'s ``local_window_size`` for cuDNN (its ``sliding_window_length``
  = left + 1): ``(left, 0)`` under a causal mask; None without a window.

  Raises:
    ValueError: a window without a causal mask (cuDNN's sliding window is a left window of a causal
      mask), ``chunk_size`` or ``logits_soft_cap`` (cuDNN has neither here).
  """
  if pattern is None:
    return None
  if pattern.chunk is not None or pattern.cap is not None:
    option = "chunk_size" if pattern.chunk is not None else "logits_soft_cap"
    raise ValueError(
      f"attention implementation 'cudnn' cannot run {option} (cuDNN's fused attention has no such option "
      "through jax.nn.dot_product_attention); implementation='xla' runs it, and 'auto' picks a backend that can"
    )
  if pattern.window is None:
    return None
  if not mask.causal:
    raise ValueError(
      "attention implementation 'cudnn' runs local_window_size with a causal mask only (cuDNN's sliding "
      "window is a left window, sliding_window_length = left + 1); implementation='xla' runs two-sided windows"
    )
  return (pattern.window[0], 0)


def attend(
  q, k, v, mask: AttentionMask, *, scale: float, interpret: bool = False, pattern: Pattern | None = None
) -> jax.Array:
  """Self-attention ``[B, T, N, D]`` of q ``[B, T, N, D]``, k, v ``[B, T, K, D]`` (cuDNN; no interpret mode).

  ``pattern``: a causal left window through ``jax.nn.dot_product_attention(local_window_size=)``
  (``local_window``); chunks and the soft cap are refused.

  cuDNN has no segment ids here: padding/packing go in as a dense ``[B, 1, T, S]`` mask (O(T^2))
  built from the same ids as the Pallas kernels' (padding tokens see each other), so no query row is
  fully masked (cuDNN gives NaN there, e.g. left padding under causality); ``attention`` zeroes the
  padding rows.
  """
  del interpret  # the GPU kernel only (resolve_backend refuses cudnn elsewhere)
  window = local_window(mask, pattern)
  ids = kernel_segment_ids(mask, q.shape[0], q.shape[1])
  dense = None if ids is None else ids[:, None, :, None] == ids[:, None, None, :]
  return jax.nn.dot_product_attention(
    q, k, v, mask=dense, scale=scale, is_causal=mask.causal, implementation="cudnn", local_window_size=window
  )
