"""Vision encoders' ``axial`` RoPE from a Hugging Face config, as transformers 5.24 builds it.

An ``axial`` rotary module (Qwen2-VL / Qwen3-VL / GLM-4V / Pixtral / SAM2 / ... vision towers)
rotates each image patch by its (row, column) grid position: one table of ``F`` frequencies per
axis, ``base ** (-2i / s)`` over ``s = H // 2`` (Pixtral: the even and odd frequencies of the whole
head; MiniMax-M3-VL: three axes t/h/w over ``s = 2 ((H // 3) // 2)``), recomposed into the head in
a family-specific order (``recomposition_frequencies``). ``axial_rope`` gives that as jaxpe's
per-frequency form: ``inv_freq [R/2]`` (the module's frequencies in head order), the position row
each one takes (``mrope_axes``: 0 = h, 1 = w; t, h, w for three axes) and the pair layout.
``jaxpe.ops.hf_rope.rope_from_hf_config`` returns it as an ``HFRope``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from jaxpe.ops.hf_config import first, positive_int

# model_type -> (recomposition, pair layout). "hw": cat(h, w); "wh": cat(w, h); "wh_pairs": (w, h)
# per frequency (Kimi-K2.5); "thw": cat(t, h, w) (MiniMax-M3-VL); "pixtral": h on the even, w on the
# odd frequencies of the whole head. Not listed: ("hw", "half").
AXIAL_LAYOUTS: dict[str, tuple[str, Literal["half", "interleaved"]]] = {
  **{
    t: ("hw", "interleaved") for t in ("edgetam_video", "sam2_video", "sam3_tracker_video", "sam3_vit_model")
  },
  "inkling2_vision": ("wh", "interleaved"),
  "kimi_k25_vision": ("wh_pairs", "half"),
  "minimax_m3_vl_vision": ("thw", "half"),
  "pixtral": ("pixtral", "half"),
  "step3p5_vision": ("wh", "half"),
}
# Axial modules jaxpe's one rotation per pair cannot express.
AXIAL_UNSUPPORTED = {
  "gemma4_vision": "its table is h, h, w, w (cat(freq_h, freq_h, freq_w, freq_w)): the two halves of the "
  "head rotate as separate rotate-half blocks, not one rotation per pair of the head",
}
# SAM2-style memory attention: head dim = hidden // (downsample_rate * heads).
_MEMORY_ATTENTION = frozenset({"edgetam_video", "sam2_video", "sam3_tracker_video"})


def _head_dim(cfg: Mapping[str, Any], model_type: str) -> int:
  if model_type in _MEMORY_ATTENTION:
    width = positive_int(cfg, "memory_attention_hidden_size")
    rate = positive_int(cfg, "memory_attention_downsample_rate")
    heads = positive_int(cfg, "memory_attention_num_attention_heads")
    return positive_int({"head_dim": width // (rate * heads)}, "head_dim")
  if cfg.get("head_dim") is not None:
    return positive_int(cfg, "head_dim")
  hidden = (
    first(cfg, "embed_dim", "hidden_size") if model_type == "qwen2_vl_vision" else cfg.get("hidden_size")
  )
  heads = first(cfg, "num_attention_heads", "num_heads")  # vision configs: num_heads
  if hidden is None or heads is None:
    raise ValueError(
      "config needs head_dim, or hidden_size and num_attention_heads, for the axial rotary dim"
    )
  positive_int({"hidden_size": hidden}, "hidden_size")
  positive_int({"num_attention_heads": heads}, "num_attention_heads")
  return positive_int(
    {"hidden_size // num_attention_heads": hidden // heads}, "hidden_size // num_attention_heads"
  )


def _inv(base: float, width: int) -> np.ndarray:
  """transformers' ``1 / base ** (arange(0, width, 2) / width)``, float64."""
  return 1.0 / base ** (np.arange(0, width, 2, dtype=np.float64) / width)


def axial_rope(
  cfg: Mapping[str, Any], model_type: Any, base: float
) -> tuple[np.ndarray, tuple[int, ...], Literal["half", "interleaved"], int]:
  """``(inv_freq [R/2] float64, axes [R/2], layout, head_dim)`` of a vision config's ``axial`` RoPE.

  Raises:
    ValueError: a family whose axial table is not one rotation per pair (Gemma-4's vision tower),
      missing or non-positive dims, a head too narrow for its axes (named).
  """
  if model_type in AXIAL_UNSUPPORTED:
    raise ValueError(
      f"model_type {model_type!r} (rope_type 'axial') is not supported: {AXIAL_UNSUPPORTED[model_type]}"
    )
  kind, layout = AXIAL_LAYOUTS.get(model_type, ("hw", "half"))
  head_dim = _head_dim(cfg, model_type)
  if kind == "pixtral":
    table = _inv(base, head_dim)
    table = np.concatenate([table[0::2], table[1::2]])
    half = len(table) // 2
    inv_freq, axes = table, (0,) * half + (1,) * (len(table) - half)
  elif kind == "thw":
    table = _inv(base, 2 * ((head_dim // 3) // 2))
    inv_freq, axes = np.tile(table, 3), tuple(np.repeat([0, 1, 2], len(table)).tolist())
  else:
    table = _inv(base, head_dim // 2)
    n = len(table)
    if kind == "wh_pairs":
      inv_freq, axes = np.repeat(table, 2), (1, 0) * n
    else:
      first_row = 0 if kind == "hw" else 1
      inv_freq, axes = np.tile(table, 2), (first_row,) * n + (1 - first_row,) * n
  if len(inv_freq) == 0 or 2 * len(inv_freq) > head_dim:
    raise ValueError(
      f"model_type {model_type!r}: head_dim {head_dim} is too narrow for its axial RoPE "
      f"({2 * len(inv_freq)} rotated dims)"
    )
  return inv_freq, axes, layout, head_dim
