"""jaxpe: positional encodings for transformers in JAX.

Pure-functional ops (no Flax): RoPE written with complex numbers, ALiBi, RoPE-emulated ALiBi,
positions from masks and segment ids, and the attention function they all go through. A Flax NNX
decoder (``jaxpe.model``) and a trainer (``jaxpe.train``) compose them.

Shape alphabet, used in einsums, docstrings and tests:
  B batch, T query positions, S key positions, N query heads, K kv heads, H head dim,
  D model dim, F MLP dim, V vocab, L layers.
Units: positions are token indices (integers >= 0); frequencies (inv_freq, theta) are radians
per token.
"""

from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.emulated import emulated_alibi_attention
from jaxpe.attention.masks import AttentionMask, dense_attention_mask, document_mask, make_attention_mask
from jaxpe.attention.reference import dot_product_attention
from jaxpe.attention.rope_spec import RopeSpec
from jaxpe.emulation.base_constrained import base_constrained_qk, solve_base_constrained
from jaxpe.emulation.bounds import emulation_error_bound, emulation_weights
from jaxpe.emulation.ops import apply_augmented_alibi, apply_rope_alibi, pad_head_dim
from jaxpe.emulation.solver import emulation_amplitudes, emulation_theta, solve_emulation
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
from jaxpe.ops.rope_scaling import (
  ROPE_TYPES,
  normalize_rope_parameters,
  ntk_aware_base,
  p_rope_inv_freq,
  rope_frequencies,
)
from jaxpe.ops.sinusoidal import sinusoidal_embedding, sinusoidal_frequencies
from jaxpe.ops.xpos import apply_xpos, xpos_scale, xpos_zeta

__all__ = [
  "AlibiSpec",
  "AttentionMask",
  "HFRope",
  "ROPE_TYPES",
  "RopeSpec",
  "alibi_bias",
  "alibi_bias_bloom",
  "alibi_bias_causal",
  "alibi_bias_symmetric",
  "alibi_slopes",
  "alibi_slopes_for_heads",
  "apply_augmented_alibi",
  "apply_rope",
  "apply_rope_alibi",
  "apply_xpos",
  "base_constrained_qk",
  "convert_layout",
  "convert_qk_proj_weight",
  "dense_attention_mask",
  "document_mask",
  "dot_product_attention",
  "emulated_alibi_attention",
  "emulation_amplitudes",
  "emulation_error_bound",
  "emulation_theta",
  "emulation_weights",
  "layout_permutation",
  "make_attention_mask",
  "normalize_rope_parameters",
  "ntk_aware_base",
  "pad_head_dim",
  "positions_from_mask",
  "positions_from_segment_ids",
  "rope_cos_sin",
  "p_rope_inv_freq",
  "rope_frequencies",
  "rope_from_hf_config",
  "rope_inv_freq",
  "rope_phases",
  "sinusoidal_embedding",
  "sinusoidal_frequencies",
  "solve_base_constrained",
  "solve_emulation",
  "xpos_scale",
  "xpos_zeta",
]
