"""Positional-encoding ops: pure JAX functions, Flax-free (they import jax and numpy only).

RoPE (complex-number form with exact phases, every HF ``rope_scaling``, pair layouts, HF configs),
ALiBi, xPos, sinusoidal embeddings, CoPE (contextual positions from gates), positions from masks and segment ids, and the argument checks
they share. The ops that rotate (``apply_rope``, ``apply_xpos``) take the pair layout from the
caller (``layout=``, no default: ``jaxpe.ops.layouts`` says why) or from an HF config
(``rope_from_hf_config(config).apply``).

Modules: ``rope`` (inverse frequencies, phases, cos/sin, ``apply_rope``), ``exact_phases`` (the
fixed-point phase reduction), ``layouts`` (the two pair layouts and conversion between them),
``rope_parameters`` (HF rope dicts: spelling, keys, values), ``rope_scaling`` (the frequencies of
each HF ``rope_type``), ``hf_families`` / ``hf_config`` / ``hf_rope`` (what transformers does per
model family, reading a config, ``HFRope``), ``xpos``, ``sinusoidal``, ``positions``, ``alibi``,
``cope``, ``relative_bias`` (T5's buckets, Kerple), ``fire`` (FIRE), ``checks``.
"""

from jaxpe.ops.alibi import (
  alibi_bias,
  alibi_bias_bloom,
  alibi_bias_causal,
  alibi_bias_symmetric,
  alibi_slopes,
  alibi_slopes_for_heads,
)
from jaxpe.ops.cope import cope_bias, cope_positions
from jaxpe.ops.fire import fire_bias, fire_interpolation
from jaxpe.ops.hf_rope import HFRope, rope_from_hf_config
from jaxpe.ops.hf_verified import UnverifiedFamilyError
from jaxpe.ops.layouts import convert_layout, convert_qk_proj_weight, layout_permutation
from jaxpe.ops.positions import positions_from_mask, positions_from_segment_ids
from jaxpe.ops.relative_bias import kerple_log_bias, kerple_power_bias, t5_bias, t5_relative_position_bucket
from jaxpe.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq, rope_phases
from jaxpe.ops.rope_parameters import ROPE_TYPES, normalize_rope_parameters
from jaxpe.ops.rope_scaling import ntk_aware_base, p_rope_inv_freq, rope_frequencies
from jaxpe.ops.sinusoidal import sinusoidal_embedding, sinusoidal_frequencies
from jaxpe.ops.xpos import apply_xpos, xpos_scale, xpos_zeta

__all__ = [
  "HFRope",
  "ROPE_TYPES",
  "UnverifiedFamilyError",
  "alibi_bias",
  "alibi_bias_bloom",
  "alibi_bias_causal",
  "alibi_bias_symmetric",
  "alibi_slopes",
  "alibi_slopes_for_heads",
  "apply_rope",
  "apply_xpos",
  "convert_layout",
  "cope_bias",
  "cope_positions",
  "convert_qk_proj_weight",
  "fire_bias",
  "fire_interpolation",
  "kerple_log_bias",
  "kerple_power_bias",
  "layout_permutation",
  "normalize_rope_parameters",
  "ntk_aware_base",
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
  "t5_bias",
  "t5_relative_position_bucket",
  "xpos_scale",
  "xpos_zeta",
]
