"""Positional-encoding ops: pure JAX functions, Flax-free (they import jax and numpy only).

RoPE (complex-number form, every HF ``rope_scaling``, pair layouts, HF configs), ALiBi, xPos,
sinusoidal embeddings, positions from masks and segment ids, and the argument checks they share.
"""

from jaxpe.ops.alibi import (
  alibi_bias,
  alibi_bias_bloom,
  alibi_bias_causal,
  alibi_bias_symmetric,
  alibi_slopes,
  alibi_slopes_for_heads,
)
from jaxpe.ops.hf_rope import HFRope, rope_from_hf_config
from jaxpe.ops.layouts import convert_layout, convert_qk_proj_weight, layout_permutation
from jaxpe.ops.positions import positions_from_mask, positions_from_segment_ids
from jaxpe.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq, rope_phases
from jaxpe.ops.rope_scaling import ROPE_TYPES, normalize_rope_parameters, ntk_aware_base, rope_frequencies
from jaxpe.ops.sinusoidal import sinusoidal_embedding, sinusoidal_frequencies
from jaxpe.ops.xpos import apply_xpos, xpos_scale, xpos_zeta

__all__ = [
  "HFRope",
  "ROPE_TYPES",
  "alibi_bias",
  "alibi_bias_bloom",
  "alibi_bias_causal",
  "alibi_bias_symmetric",
  "alibi_slopes",
  "alibi_slopes_for_heads",
  "apply_rope",
  "apply_xpos",
  "convert_layout",
  "convert_qk_proj_weight",
  "layout_permutation",
  "normalize_rope_parameters",
  "ntk_aware_base",
  "positions_from_mask",
  "positions_from_segment_ids",
  "rope_cos_sin",
  "rope_frequencies",
  "rope_from_hf_config",
  "rope_inv_freq",
  "rope_phases",
  "sinusoidal_embedding",
  "sinusoidal_frequencies",
  "xpos_scale",
  "xpos_zeta",
]
