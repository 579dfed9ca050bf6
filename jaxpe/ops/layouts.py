"""The two RoPE pair layouts: the ``layout`` argument every RoPE op requires, and conversion
between the layouts for activations and q/k projection weights.

* ``"interleaved"`` (Meta LLaMA, complex): rotary pair i is dims ``(2i, 2i + 1)``.
* ``"half"`` (GPT-NeoX / HF ``rotate_half``): rotary pair i is dims ``(i, i + R/2)``.

No default layout. The field has no single convention, and the wrong one raises nothing: the
attention runs and its scores are silently wrong. HF transformers rotates halves (``rotate_half``
in ``models/llama/modeling_llama.py``, no option; its ``convert_llama_weights_to_hf.py`` permutes
Meta's q/k weights to fit), and so does Google's Gemma (``gemma/gm/math/_positional_embeddings.py``
``apply_rope``: ``jnp.split(inputs, 2, axis=-1)``, no option). Meta's reference (``llama/model.py``
``apply_rotary_emb``: ``view_as_complex``) and EasyLM (``EasyLM/models/llama/llama_model.py``
``apply_rotary_emb``: ``jax.lax.complex`` of ``reshape(..., -1, 2)``) rotate interleaved pairs.
MaxText has both and names the choice: ``RotaryEmbedding`` rotates halves, ``LLaMARotaryEmbedding``
interleaved pairs (HF Llama checkpoints are permuted on import, ``permute_to_match_maxtext_rope``),
and its YaRN embedding takes an explicit ``rope_interleave`` flag set per model config (true for
DeepSeek, false for gpt-oss and OLMo-3). Each library fixes the layout with the model, so a default
in a library of ops would be wrong for half of the weights a user brings. jaxpe's RoPE ops
(``apply_rope``, ``apply_xpos``) therefore take ``layout=`` from the caller, with a ``TypeError``
naming it and both values when it is missing, or from the model's config:
``rope_from_hf_config(config).layout`` (``HFRope.apply`` passes it).

Only the first R (``rotary_dim``) dims of each head are paired; dims ``R..H-1`` stay in place.
Converting the q and k projection weights (and biases) of a model with this permutation of each
head's dims makes it give the same attention scores with RoPE in the other layout: the score sums
over all head dims, so a permutation applied to both q and k does not change it, and the
permutation maps each interleaved pair onto the matching rotate-half pair.

This is the permutation HF's ``convert_llama_weights_to_hf.py`` applies to Meta checkpoints
(``w.view(n_heads, H // 2, 2, D).transpose(1, 2).reshape(n_heads * H, D)``), generalised to partial
rotary and to either direction. Values (v), the output projection and everything else are unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks

Array = jax.Array | np.ndarray
Layout = Literal["interleaved", "half"]
LAYOUTS: tuple[str, ...] = ("interleaved", "half")


class _Required:
  """The default of a ``layout`` argument, which has none: a call without it raises TypeError."""

  __slots__ = ()

  def __repr__(self) -> str:
    return "<required>"


REQUIRED: Any = _Required()
"""Placeholder default of the RoPE ops' ``layout`` (``check_layout`` refuses it)."""


def check_layout(layout: Any, caller: str) -> str:
  """``layout`` of the RoPE op ``caller``: one of ``LAYOUTS``.

  Raises:
    TypeError: ``layout`` not given (``REQUIRED``); the message names ``layout``, both values and
      the convention of each.
    ValueError: any other value (``layout must be one of ...``).
  """
  if layout is REQUIRED:
    raise TypeError(
      f"{caller}() missing required keyword argument 'layout': pass layout='half' (pairs (i, i + R/2), "
      "rotate_half: HF transformers checkpoints of Llama, Mistral, Qwen, Gemma, GPT-NeoX) or "
      "layout='interleaved' (pairs (2i, 2i + 1), complex: Meta's llama reference, EasyLM, GPT-J). There is "
      "no default: the wrong layout gives wrong attention without an error. For an HF model, "
      "jaxpe.rope_from_hf_config(config).layout"
    )
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  return layout


def _check_layouts(src: str, dst: str) -> None:
  for name, value in (("src", src), ("dst", dst)):
    if value not in LAYOUTS:
      raise ValueError(f"{name} must be one of {LAYOUTS}, got {value!r}")


def layout_permutation(head_dim: int, *, src: str, dst: str, rotary_dim: int | None = None) -> np.ndarray:
  """Index permutation ``perm`` with ``x_dst = x_src[..., perm]`` along the head dim.

  Args:
    head_dim: H, positive.
    src, dst: ``"interleaved"`` or ``"half"``.
    rotary_dim: R, even, ``0 < R <= H``; default H.

  Returns:
    ``[H]`` int64 numpy permutation (identity when ``src == dst``).

  Raises:
    ValueError: bad ``head_dim``/``rotary_dim``, unknown layout.
  """
  _check_layouts(src, dst)
  head_dim = _checks.check_positive_int("head_dim", head_dim, maximum=_checks.MAX_DIM)
  rotary_dim = head_dim if rotary_dim is None else rotary_dim
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  if rotary_dim > head_dim:
    raise ValueError(f"rotary_dim must be <= head_dim = {head_dim}, got {rotary_dim}")
  rest = np.arange(rotary_dim, head_dim)
  if src == dst:
    return np.arange(head_dim)
  # interleaved -> half: real parts (even dims) first, then imaginary parts (odd dims).
  to_half = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)])
  rot = to_half if dst == "half" else np.argsort(to_half)
  return np.concatenate([rot, rest]).astype(np.int64)


def _take(x: Array, perm: np.ndarray, axis: int) -> Array:
  if isinstance(x, np.ndarray):
    return np.take(x, perm, axis=axis)
  return jnp.take(x, jnp.asarray(perm), axis=axis)


def convert_layout(x: Array, *, src: str, dst: str, rotary_dim: int | None = None, axis: int = -1) -> Array:
  """Permutes one head-dim axis of ``x`` from layout ``src`` to ``dst``.

  Use it on activations ``[B, T, N, H]`` and on jaxpe q/k kernels ``[D, N, H]`` / ``[D, K, H]`` and
  biases ``[N, H]`` (head dim last, the default ``axis``).

  Args:
    x: numpy or JAX array with the head dim H on ``axis``.
    src, dst: ``"interleaved"`` or ``"half"``.
    rotary_dim: R, even, ``<= H``; default H (partial rotary: dims R.. stay in place).
    axis: the head-dim axis.

  Returns:
    Array of the same shape, dtype and kind (numpy in, numpy out).

  Raises:
    ValueError: bad layout or ``rotary_dim``; ``axis`` out of range (a 0-d ``x`` has no head axis).
    TypeError: ``x`` not an array of numbers; ``axis`` not an int.
  """
  x = _checks.as_array("x", x)
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise _checks.ArgTypeError(f"axis must be an int, got {axis!r}")
  ndim = np.ndim(x)
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis must be in [-{ndim}, {ndim}) for x of shape {np.shape(x)}, got {axis}")
  perm = layout_permutation(np.shape(x)[axis], src=src, dst=dst, rotary_dim=rotary_dim)
  return _take(x, perm, axis)


def convert_qk_proj_weight(
  w: Array, *, num_heads: int, head_dim: int, src: str, dst: str, rotary_dim: int | None = None
) -> Array:
  """Converts a fused q or k projection weight ``[N*H, D]`` (or bias ``[N*H]``), the PyTorch/HF layout.

  The fused axis must come first. A Flax/JAX ``[D, N*H]`` kernel is the other orientation: transpose
  it (``w.T``) first. ``head_dim`` is required so that such a kernel is refused (``w.shape[0]`` must
  be ``N*H``); a square kernel (``N*H == D``) cannot be told apart from its transpose by shape, so
  its orientation is the caller's to get right.

  Args:
    w: ``[N*H, D]`` or ``[N*H]`` (torch ``nn.Linear.weight`` / ``.bias``), numpy or JAX. For the k
      projection of grouped-query attention pass ``num_heads=K``.
    num_heads: heads in the fused axis (N for q, K for k); positive.
    head_dim: H, positive; ``w.shape[0]`` must be ``num_heads * head_dim``.
    src, dst: ``"interleaved"`` or ``"half"``.
    rotary_dim: R, even, ``<= H``; default H.

  Returns:
    Same shape, dtype and kind as ``w``.

  Raises:
    ValueError: wrong rank, ``w.shape[0] != num_heads * head_dim`` (the message says when ``w``
      looks transposed), bad layout or ``rotary_dim``, ``num_heads``/``head_dim`` not positive.
    TypeError: ``w`` not an array of numbers; ``num_heads``/``head_dim`` not ints.
  """
  w = _checks.as_array("w", w)
  if np.ndim(w) not in (1, 2):
    raise ValueError(f"w must have shape [N*H, D] or [N*H], got shape {np.shape(w)}")
  num_heads = _checks.check_positive_int("num_heads", num_heads)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  if np.shape(w)[0] != num_heads * head_dim:
    transposed = np.ndim(w) == 2 and np.shape(w)[1] == num_heads * head_dim
    hint = "; it looks like a Flax/JAX [D, N*H] kernel: pass w.T" if transposed else ""
    raise ValueError(
      f"w must have shape [N*H, D] or [N*H] with N*H = num_heads * head_dim = {num_heads} * {head_dim}, "
      f"got shape {np.shape(w)}{hint}"
    )
  perm = layout_permutation(head_dim, src=src, dst=dst, rotary_dim=rotary_dim)
  full = (np.arange(num_heads)[:, None] * head_dim + perm[None, :]).reshape(-1)
  return _take(w, full, 0)
