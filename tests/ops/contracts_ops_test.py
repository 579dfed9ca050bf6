"""Hostile inputs against the ops' contracts (docs/contracts.md, section "Ops").

One row per (entry point, argument, bad value): the expected exception and a regex of its message,
which must name the argument. Values are wrong in type, dtype, shape, rank, sign, NaN/inf, zero,
huge, empty, or of the right type but out of range. A second table checks what traced values (under
``jax.jit``, where nothing can be checked) give: the documented result, against an independent
reference. Issue 17.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe import (
  alibi_bias,
  alibi_bias_bloom,
  alibi_bias_causal,
  alibi_bias_symmetric,
  alibi_slopes,
  alibi_slopes_for_heads,
  apply_rope,
  apply_xpos,
  convert_layout,
  convert_qk_proj_weight,
  document_mask,
  layout_permutation,
  normalize_rope_parameters,
  ntk_aware_base,
  positions_from_mask,
  positions_from_segment_ids,
  rope_cos_sin,
  rope_frequencies,
  rope_from_hf_config,
  rope_inv_freq,
  rope_phases,
  sinusoidal_embedding,
  sinusoidal_frequencies,
  xpos_scale,
  xpos_zeta,
)

F32 = jnp.float32
I32 = jnp.int32


def X(b=2, t=3, n=2, h=8, dtype=F32):
  return jnp.ones((b, t, n, h), dtype)


def P(b=2, t=3, dtype=I32):
  return jnp.broadcast_to(jnp.arange(t, dtype=dtype), (b, t))


INV = np.asarray([1.0, 0.1, 0.01, 0.001])  # [R/2] for H = 8
SLOPES = jnp.asarray([0.5, 0.25], F32)
MASK = jnp.ones((2, 3), I32)
SEG = jnp.asarray([[0, 0, 1], [1, 1, 1]], I32)
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}
HUGE = 2**40
NAN, INF = float("nan"), float("inf")

# apply_rope / apply_xpos with the pair layout (a required argument) held fixed: CASES walk the others.
rope = functools.partial(apply_rope, layout="interleaved")
xpos = functools.partial(apply_xpos, layout="interleaved")

# (id, call, exception, regex of the message)
CASES = [
  # ---------------------------------------------------------------- apply_rope
  ("rope-x-ragged", lambda: rope([[[[1.0, 2.0]], [[1.0]]]], P(1, 2)), TypeError, "x must be an array"),
  ("rope-x-str", lambda: rope("abcd", P(1, 1)), TypeError, "x must be an array of numbers"),
  ("rope-x-int", lambda: rope(X(dtype=I32), P()), TypeError, "x must be a float"),
  ("rope-x-bool", lambda: rope(X(dtype=jnp.bool_), P()), TypeError, "x must be a float"),
  ("rope-x-complex", lambda: rope(X(dtype=jnp.complex64), P()), TypeError, "x must be a float"),
  (
    "rope-x-rank3",
    lambda: rope(jnp.ones((2, 3, 8)), P()),
    ValueError,
    r"x must have shape \[B, T, N, H\]",
  ),
  ("rope-x-odd-H", lambda: rope(X(h=7), P()), ValueError, "head_dim.*even"),
  (
    "rope-pos-bool",
    lambda: rope(X(), P().astype(bool)),
    TypeError,
    "positions must be an integer or float",
  ),
  ("rope-pos-complex", lambda: rope(X(), P().astype(jnp.complex64)), TypeError, "positions must be"),
  (
    "rope-pos-str",
    lambda: rope(X(), np.asarray([["a", "b", "c"]] * 2)),
    TypeError,
    "positions must be an",
  ),
  ("rope-pos-shape", lambda: rope(X(), P(2, 4)), ValueError, r"positions must have shape \[B, T\]"),
  ("rope-pos-rank3", lambda: rope(X(), P()[None]), ValueError, "positions must have shape"),
  ("rope-pos-batch", lambda: rope(X(), P(3, 3)), ValueError, "positions must have shape"),
  ("rope-pos-neg", lambda: rope(X(), P() - 1), ValueError, "positions must be >= 0"),
  (
    "rope-pos-2^31",
    lambda: rope(X(), np.full((2, 3), 2**31, np.int64)),
    ValueError,
    "positions must be < 2",
  ),
  (
    "rope-pos-nan",
    lambda: rope(X(), P(dtype=F32).at[0, 0].set(NAN)),
    ValueError,
    "positions must be finite",
  ),
  (
    "rope-pos-inf",
    lambda: rope(X(), P(dtype=F32).at[0, 0].set(INF)),
    ValueError,
    "positions must be finite",
  ),
  (
    "rope-pos-negf",
    lambda: rope(X(), P(dtype=F32) - 0.5),
    ValueError,
    r"positions must be in \[0, 2\^31\)",
  ),
  (
    "rope-pos-hugef",
    lambda: rope(X(), P(dtype=F32) + 3e9),
    ValueError,
    r"positions must be in \[0, 2\^31\)",
  ),
  ("rope-pos-f64", lambda: rope(X(), np.full((2, 3), 1e9 + 0.5)), ValueError, "float32 cannot hold"),
  (
    "rope-inv-int",
    lambda: rope(X(), P(), inv_freq=jnp.ones(4, I32)),
    TypeError,
    "inv_freq must be a float",
  ),
  (
    "rope-inv-rank2",
    lambda: rope(X(), P(), inv_freq=jnp.ones((1, 4))),
    ValueError,
    "inv_freq must have shape",
  ),
  ("rope-inv-nan", lambda: rope(X(), P(), inv_freq=INV * NAN), ValueError, "inv_freq must be finite"),
  (
    "rope-inv-long",
    lambda: rope(X(), P(), inv_freq=np.ones(5)),
    ValueError,
    "rotary_dim must be <= head_dim",
  ),
  (
    "rope-inv-empty",
    lambda: rope(X(), P(), inv_freq=np.ones(0)),
    ValueError,
    "inv_freq must have at least",
  ),
  ("rope-base-0", lambda: rope(X(), P(), base=0.0), ValueError, "base must be a finite number > 0"),
  ("rope-base-neg", lambda: rope(X(), P(), base=-1e4), ValueError, "base must be a finite number > 0"),
  ("rope-base-nan", lambda: rope(X(), P(), base=NAN), ValueError, "base must be a finite number > 0"),
  ("rope-base-inf", lambda: rope(X(), P(), base=INF), ValueError, "base must be a finite number > 0"),
  ("rope-base-str", lambda: rope(X(), P(), base="1e4"), TypeError, "base must be a finite number"),
  ("rope-base-bool", lambda: rope(X(), P(), base=True), TypeError, "base must be a finite number"),
  ("rope-layout", lambda: apply_rope(X(), P(), layout="complex"), ValueError, "layout must be one of"),
  ("rope-layout-none", lambda: apply_rope(X(), P(), layout=None), ValueError, "layout must be one of"),
  ("rope-scale-nan", lambda: rope(X(), P(), scale=NAN), ValueError, "scale must be finite"),
  ("rope-scale-str", lambda: rope(X(), P(), scale="2"), TypeError, "scale must be a float"),
  ("rope-scale-complex", lambda: rope(X(), P(), scale=1j), TypeError, "scale must be a float"),
  (
    "rope-scale-shape",
    lambda: rope(X(), P(), scale=jnp.ones((2, 3, 2, 5))),
    ValueError,
    "scale must broadcast",
  ),
  (
    "rope-scale-nan-arr",
    lambda: rope(X(), P(), scale=jnp.full((1, 1, 1, 4), NAN)),
    ValueError,
    "scale must be finite",
  ),
  ("rope-slice", lambda: rope(X(), P(), rotated_slice="middle"), ValueError, "rotated_slice must be"),
  (
    "rope-precision",
    lambda: rope(X(), P(), phase_precision="float64"),
    ValueError,
    "phase_precision must be",
  ),
  ("rope-mrope-sum", lambda: rope(X(), P()[None], mrope_section=[1, 1]), ValueError, "mrope_section"),
  # ---------------------------------------------------------------- rope_inv_freq, rope_phases, rope_cos_sin
  ("inv-H-0", lambda: rope_inv_freq(0), ValueError, "head_dim must be a positive integer"),
  ("inv-H-neg", lambda: rope_inv_freq(-8), ValueError, "head_dim must be a positive integer"),
  ("inv-H-float", lambda: rope_inv_freq(8.0), TypeError, "head_dim must be a positive integer"),
  ("inv-H-bool", lambda: rope_inv_freq(True), TypeError, "head_dim must be a positive integer"),
  ("inv-H-huge", lambda: rope_inv_freq(HUGE), ValueError, "head_dim must be <= 1048576"),
  ("inv-R-odd", lambda: rope_inv_freq(8, rotary_dim=3), ValueError, "rotary_dim must be even"),
  ("inv-R-big", lambda: rope_inv_freq(8, rotary_dim=10), ValueError, "rotary_dim must be <= head_dim"),
  ("inv-R-0", lambda: rope_inv_freq(8, rotary_dim=0), ValueError, "rotary_dim must be a positive integer"),
  ("inv-base-0", lambda: rope_inv_freq(8, base=0), ValueError, "base must be a finite number > 0"),
  ("inv-dtype-int", lambda: rope_inv_freq(8, dtype=jnp.int32), TypeError, "dtype must be float32 or float64"),
  ("inv-dtype-str", lambda: rope_inv_freq(8, dtype="foo"), TypeError, "dtype must be float32 or float64"),
  ("phases-pos-float", lambda: rope_phases(P(dtype=F32), INV), TypeError, "positions must be an integer"),
  (
    "phases-pos-rank",
    lambda: rope_phases(jnp.arange(3), INV),
    ValueError,
    r"positions must have shape \[B, T\]",
  ),
  ("phases-pos-neg", lambda: rope_phases(P() - 1, INV), ValueError, "positions must be >= 0"),
  ("phases-inv-rank", lambda: rope_phases(P(), INV[None]), ValueError, "inv_freq must have shape"),
  ("phases-inv-int", lambda: rope_phases(P(), jnp.ones(4, I32)), TypeError, "inv_freq must be a float"),
  ("cossin-pos-neg", lambda: rope_cos_sin(jnp.asarray([-1]), INV), ValueError, "positions must be >= 0"),
  (
    "cossin-inv-nan",
    lambda: rope_cos_sin(jnp.asarray([1]), INV * NAN),
    ValueError,
    "inv_freq must be finite",
  ),
  (
    "cossin-precision",
    lambda: rope_cos_sin(jnp.asarray([1]), INV, phase_precision="x"),
    ValueError,
    "phase_prec",
  ),
  # ---------------------------------------------------------------- rope_scaling
  (
    "norm-not-mapping",
    lambda: normalize_rope_parameters([("rope_type", "linear")]),
    TypeError,
    "rope_scaling must",
  ),
  (
    "norm-unknown-key",
    lambda: normalize_rope_parameters({"factr": 2.0}),
    ValueError,
    r"unknown keys \['factr'\]",
  ),
  (
    "norm-type-differ",
    lambda: normalize_rope_parameters({"type": "linear", "rope_type": "yarn"}),
    ValueError,
    "differ",
  ),
  (
    "norm-type-bogus",
    lambda: normalize_rope_parameters({"rope_type": "bogus"}),
    ValueError,
    "rope_type'] must be",
  ),
  ("norm-type-int", lambda: normalize_rope_parameters({"rope_type": 3}), ValueError, "rope_type'] must be"),
  (
    "norm-type-list",
    lambda: normalize_rope_parameters({"rope_type": ["yarn"]}),
    ValueError,
    "rope_type'] must be",
  ),
  ("norm-key-int", lambda: normalize_rope_parameters({1: 2}), ValueError, "unknown keys"),
  ("freq-H-0", lambda: rope_frequencies(None, head_dim=0), ValueError, "head_dim must be a positive integer"),
  (
    "freq-H-str",
    lambda: rope_frequencies(None, head_dim="64"),
    TypeError,
    "head_dim must be a positive integer",
  ),
  ("freq-H-huge", lambda: rope_frequencies(None, head_dim=HUGE), ValueError, "head_dim must be <="),
  (
    "freq-theta-0",
    lambda: rope_frequencies(None, head_dim=8, rope_theta=0),
    ValueError,
    "rope_theta must be",
  ),
  (
    "freq-theta-nan",
    lambda: rope_frequencies({"rope_theta": NAN}, head_dim=8),
    ValueError,
    "rope_theta'] must be",
  ),
  (
    "freq-R-odd",
    lambda: rope_frequencies(None, head_dim=8, rotary_dim=5),
    ValueError,
    "rotary_dim must be even",
  ),
  (
    "freq-R-big",
    lambda: rope_frequencies(None, head_dim=8, rotary_dim=10),
    ValueError,
    "rotary_dim must be <=",
  ),
  (
    "freq-mpe-0",
    lambda: rope_frequencies(None, head_dim=8, max_position_embeddings=0),
    ValueError,
    "max_position",
  ),
  (
    "freq-mpe-float",
    lambda: rope_frequencies(None, head_dim=8, max_position_embeddings=1.5),
    TypeError,
    "max_pos",
  ),
  ("freq-seq-neg", lambda: rope_frequencies(None, head_dim=8, seq_len=-1), ValueError, "seq_len must be"),
  ("freq-seq-float", lambda: rope_frequencies(None, head_dim=8, seq_len=1.5), TypeError, "seq_len must be"),
  (
    "freq-seq-arr",
    lambda: rope_frequencies(None, head_dim=8, seq_len=jnp.ones(2, I32)),
    ValueError,
    "seq_len must",
  ),
  (
    "freq-seq-farr",
    lambda: rope_frequencies(None, head_dim=8, seq_len=jnp.float32(3)),
    TypeError,
    "seq_len must",
  ),
  (
    "freq-yarn-nofactor",
    lambda: rope_frequencies({"rope_type": "yarn"}, head_dim=8, max_position_embeddings=64),
    ValueError,
    r"rope_type='yarn' is missing required keys \['factor'\]",
  ),
  ("ntk-factor-lt1", lambda: ntk_aware_base(1e4, factor=0.5, rotary_dim=8), ValueError, "factor must be"),
  ("ntk-factor-nan", lambda: ntk_aware_base(1e4, factor=NAN, rotary_dim=8), ValueError, "factor must be"),
  ("ntk-factor-str", lambda: ntk_aware_base(1e4, factor="2", rotary_dim=8), TypeError, "factor must be"),
  ("ntk-R-2", lambda: ntk_aware_base(1e4, factor=2.0, rotary_dim=2), ValueError, "rotary_dim must be > 2"),
  ("ntk-base-neg", lambda: ntk_aware_base(-1.0, factor=2.0, rotary_dim=8), ValueError, "base must be"),
  # ---------------------------------------------------------------- hf_rope
  ("hf-config-list", lambda: rope_from_hf_config([1, 2]), TypeError, "config must be"),
  ("hf-config-none", lambda: rope_from_hf_config(None), TypeError, "config must be"),
  (
    "hf-heads-0",
    lambda: rope_from_hf_config({**LLAMA, "num_attention_heads": 0}),
    ValueError,
    "num_attention_heads",
  ),
  ("hf-hidden-str", lambda: rope_from_hf_config({**LLAMA, "hidden_size": "64"}), ValueError, "hidden_size"),
  (
    "hf-yarn-nofactor",
    lambda: rope_from_hf_config({**LLAMA, "rope_scaling": {"rope_type": "yarn"}}),
    ValueError,
    r"missing required keys \['factor'\]",
  ),
  ("hf-layer-type", lambda: rope_from_hf_config(LLAMA, layer_type="sliding"), ValueError, "layer_type"),
  ("hf-freq-seq-neg", lambda: rope_from_hf_config(LLAMA).frequencies(-1), ValueError, "seq_len must be"),
  # ---------------------------------------------------------------- layouts
  ("perm-H-0", lambda: layout_permutation(0, src="half", dst="interleaved"), ValueError, "head_dim must be"),
  (
    "perm-H-huge",
    lambda: layout_permutation(HUGE, src="half", dst="interleaved"),
    ValueError,
    "head_dim must be <=",
  ),
  ("perm-src", lambda: layout_permutation(8, src="meta", dst="half"), ValueError, "src must be one of"),
  ("perm-dst", lambda: layout_permutation(8, src="half", dst=None), ValueError, "dst must be one of"),
  (
    "perm-R-odd",
    lambda: layout_permutation(8, src="half", dst="interleaved", rotary_dim=3),
    ValueError,
    "rotary_dim",
  ),
  (
    "perm-R-big",
    lambda: layout_permutation(8, src="half", dst="interleaved", rotary_dim=10),
    ValueError,
    "rotary_d",
  ),
  (
    "conv-x-str",
    lambda: convert_layout("abcd", src="half", dst="interleaved"),
    TypeError,
    "x must be an array",
  ),
  (
    "qkw-w-str",
    lambda: convert_qk_proj_weight("ab", num_heads=1, head_dim=2, src="half", dst="interleaved"),
    TypeError,
    "w must be an array",
  ),
  (
    "conv-x-scalar",
    lambda: convert_layout(np.float32(1), src="half", dst="interleaved"),
    ValueError,
    "axis must",
  ),
  (
    "conv-axis-float",
    lambda: convert_layout(X(), src="half", dst="interleaved", axis=1.0),
    TypeError,
    "axis must",
  ),
  (
    "conv-axis-range",
    lambda: convert_layout(X(), src="half", dst="interleaved", axis=4),
    ValueError,
    "axis must",
  ),
  (
    "conv-odd",
    lambda: convert_layout(jnp.ones((3, 5)), src="half", dst="interleaved"),
    ValueError,
    "rotary_dim",
  ),
  (
    "qkw-rank3",
    lambda: convert_qk_proj_weight(
      jnp.ones((2, 8, 4)), num_heads=2, head_dim=4, src="half", dst="interleaved"
    ),
    ValueError,
    r"w must have shape \[N\*H, D\]",
  ),
  (
    "qkw-heads-0",
    lambda: convert_qk_proj_weight(jnp.ones((8, 4)), num_heads=0, head_dim=4, src="half", dst="interleaved"),
    ValueError,
    "num_heads must be",
  ),
  (
    "qkw-heads-float",
    lambda: convert_qk_proj_weight(
      jnp.ones((8, 4)), num_heads=2.0, head_dim=4, src="half", dst="interleaved"
    ),
    TypeError,
    "num_heads must be",
  ),
  (
    "qkw-transposed",
    lambda: convert_qk_proj_weight(jnp.ones((4, 8)), num_heads=2, head_dim=4, src="half", dst="interleaved"),
    ValueError,
    "pass w.T",
  ),
  # ---------------------------------------------------------------- positions
  (
    "mask-float",
    lambda: positions_from_mask(MASK.astype(F32)),
    TypeError,
    "attention_mask must be a bool or int",
  ),
  ("mask-rank", lambda: positions_from_mask(MASK[0]), ValueError, r"attention_mask must have shape \[B, S\]"),
  ("mask-ragged", lambda: positions_from_mask([[1, 1], [0]]), TypeError, "attention_mask must be an array"),
  (
    "mask-start-neg",
    lambda: positions_from_mask(MASK, start=-1),
    ValueError,
    "start must be >= 0",
  ),
  ("mask-start-float", lambda: positions_from_mask(MASK, start=1.5), TypeError, "start must be"),
  ("mask-start-bool", lambda: positions_from_mask(MASK, start=True), TypeError, "start must be"),
  (
    "mask-start-huge",
    lambda: positions_from_mask(MASK, start=2**31 - 2),
    ValueError,
    r"start must be <= 2\^31 - S",
  ),
  ("mask-start-shape", lambda: positions_from_mask(MASK, start=jnp.zeros(3, I32)), ValueError, "start.shape"),
  ("mask-start-farr", lambda: positions_from_mask(MASK, start=jnp.zeros(2, F32)), TypeError, "start must be"),
  (
    "mask-start-arr-huge",
    lambda: positions_from_mask(MASK, start=np.asarray([0, 2**31 - 2])),
    ValueError,
    r"start \+ S must be <= 2\^31",
  ),
  ("hf-freq-seq-float", lambda: rope_from_hf_config(LLAMA).frequencies(2.5), TypeError, "seq_len must be"),
  (
    "seg-float",
    lambda: positions_from_segment_ids(SEG.astype(F32)),
    TypeError,
    "segment_ids must be an integer",
  ),
  (
    "seg-bool",
    lambda: positions_from_segment_ids(SEG.astype(bool)),
    TypeError,
    "segment_ids must be an integer",
  ),
  (
    "seg-rank",
    lambda: positions_from_segment_ids(SEG[0]),
    ValueError,
    r"segment_ids must have shape \[B, T\]",
  ),
  ("seg-str", lambda: positions_from_segment_ids([["a", "b"]]), TypeError, "segment_ids must be an array"),
  ("doc-q-float", lambda: document_mask(SEG.astype(F32), SEG), TypeError, "q_segment_ids must be an integer"),
  ("doc-k-rank", lambda: document_mask(SEG, SEG[0]), ValueError, "k_segment_ids must have shape"),
  ("doc-batch", lambda: document_mask(SEG, SEG[:1]), ValueError, "same batch size"),
  ("doc-offset-neg", lambda: document_mask(SEG, SEG, q_offset=-1), ValueError, "q_offset must be"),
  ("doc-offset-float", lambda: document_mask(SEG, SEG, q_offset=1.0), TypeError, "q_offset must be"),
  (
    "doc-offset-huge",
    lambda: document_mask(SEG, SEG, q_offset=HUGE),
    ValueError,
    r"q_offset \+ T must be <= 2\^31",
  ),
  ("doc-causal-str", lambda: document_mask(SEG, SEG, causal="no"), TypeError, "causal must be a bool"),
  ("doc-none", lambda: document_mask(None, SEG), TypeError, "q_segment_ids must be an array"),
  # ---------------------------------------------------------------- alibi
  ("slopes-N-0", lambda: alibi_slopes(0), ValueError, "num_heads must be a positive integer"),
  ("slopes-N-float", lambda: alibi_slopes(8.0), TypeError, "num_heads must be a positive integer"),
  ("slopes-N-huge", lambda: alibi_slopes(HUGE), ValueError, "num_heads must be <="),
  ("slopes-dtype", lambda: alibi_slopes(8, dtype=jnp.int32), TypeError, "dtype must be float32 or float64"),
  (
    "bias-slopes-rank",
    lambda: alibi_bias(SLOPES[None], P(), P()),
    ValueError,
    r"slopes must have shape \[N\]",
  ),
  ("bias-slopes-bool", lambda: alibi_bias(SLOPES > 0, P(), P()), TypeError, "slopes must be a float"),
  (
    "bias-slopes-complex",
    lambda: alibi_bias(SLOPES.astype(jnp.complex64), P(), P()),
    TypeError,
    "slopes must be",
  ),
  ("bias-slopes-nan", lambda: alibi_bias(SLOPES * NAN, P(), P()), ValueError, "slopes must be finite"),
  ("bias-slopes-neg", lambda: alibi_bias(-SLOPES, P(), P()), ValueError, "slopes must be finite and >= 0"),
  ("bias-slopes-list", lambda: alibi_bias([0.5, "a"], P(), P()), TypeError, "slopes must be"),
  (
    "bias-q-float",
    lambda: alibi_bias(SLOPES, P(dtype=F32), P()),
    TypeError,
    "q_positions must be an integer",
  ),
  ("bias-k-neg", lambda: alibi_bias(SLOPES, P(), P() - 1), ValueError, "k_positions must be >= 0"),
  (
    "bias-k-2^31",
    lambda: alibi_bias(SLOPES, P(), np.full((2, 3), 2**31)),
    ValueError,
    "k_positions must be < 2",
  ),
  ("bias-q-rank", lambda: alibi_bias(SLOPES, P()[0], P()), ValueError, "q_positions must have shape"),
  ("bias-batch", lambda: alibi_bias(SLOPES, P(1, 3), P()), ValueError, "same batch size"),
  ("bias-str", lambda: alibi_bias(SLOPES, "01", [[0, 1]]), TypeError, "q_positions must be an array"),
  ("sym-k-neg", lambda: alibi_bias_symmetric(SLOPES, P(), P() - 1), ValueError, "k_positions must be >= 0"),
  ("heads-0", lambda: alibi_slopes_for_heads(4, alibi_heads=0), ValueError, "alibi_heads must be in"),
  ("heads-big", lambda: alibi_slopes_for_heads(4, alibi_heads=5), ValueError, "alibi_heads must be in"),
  (
    "heads-empty",
    lambda: alibi_slopes_for_heads(4, alibi_heads=[]),
    ValueError,
    "alibi_heads must be distinct",
  ),
  (
    "heads-repeat",
    lambda: alibi_slopes_for_heads(4, alibi_heads=[1, 1]),
    ValueError,
    "alibi_heads must be distinct",
  ),
  (
    "heads-range",
    lambda: alibi_slopes_for_heads(4, alibi_heads=[4]),
    ValueError,
    "alibi_heads must be distinct",
  ),
  (
    "heads-neg",
    lambda: alibi_slopes_for_heads(4, alibi_heads=[-1]),
    ValueError,
    "alibi_heads must be distinct",
  ),
  ("heads-float", lambda: alibi_slopes_for_heads(4, alibi_heads=1.5), TypeError, "alibi_heads must be"),
  ("heads-floats", lambda: alibi_slopes_for_heads(4, alibi_heads=[0.7]), TypeError, "alibi_heads must be"),
  ("heads-str", lambda: alibi_slopes_for_heads(4, alibi_heads="01"), TypeError, "alibi_heads must be"),
  ("heads-bool", lambda: alibi_slopes_for_heads(4, alibi_heads=True), TypeError, "alibi_heads must be"),
  ("causal-q-0", lambda: alibi_bias_causal(SLOPES, q_len=0, k_len=3), ValueError, "q_len must be a positive"),
  (
    "causal-k-lt-q",
    lambda: alibi_bias_causal(SLOPES, q_len=4, k_len=3),
    ValueError,
    r"k_len \(3\) must be >= q_len",
  ),
  (
    "causal-k-float",
    lambda: alibi_bias_causal(SLOPES, q_len=1, k_len=3.0),
    TypeError,
    "k_len must be a positive",
  ),
  (
    "causal-off-neg",
    lambda: alibi_bias_causal(SLOPES, q_len=1, k_len=3, q_offset=-1),
    ValueError,
    "q_offset must",
  ),
  (
    "causal-off-big",
    lambda: alibi_bias_causal(SLOPES, q_len=1, k_len=3, q_offset=3),
    ValueError,
    "q_offset must",
  ),
  (
    "causal-off-float",
    lambda: alibi_bias_causal(SLOPES, q_len=1, k_len=3, q_offset=1.0),
    TypeError,
    "q_offset must",
  ),
  (
    "causal-k-huge",
    lambda: alibi_bias_causal(SLOPES, q_len=1, k_len=2**31 + 1),
    ValueError,
    "k_len must be <= 2147483648",
  ),
  (
    "bloom-mask-float",
    lambda: alibi_bias_bloom(SLOPES, MASK.astype(F32)),
    TypeError,
    "attention_mask must be",
  ),
  ("bloom-slopes-neg", lambda: alibi_bias_bloom(-SLOPES, MASK), ValueError, "slopes must be finite and >= 0"),
  # ---------------------------------------------------------------- xpos
  ("zeta-R-odd", lambda: xpos_zeta(7), ValueError, "rotary_dim must be even"),
  ("zeta-R-huge", lambda: xpos_zeta(HUGE), ValueError, "rotary_dim must be <="),
  ("zeta-gamma-0", lambda: xpos_zeta(8, gamma=0), ValueError, "gamma must be a finite number > 0"),
  ("zeta-gamma-nan", lambda: xpos_zeta(8, gamma=NAN), ValueError, "gamma must be a finite number > 0"),
  (
    "xscale-kind",
    lambda: xpos_scale(P(), rotary_dim=8, kind="value"),
    ValueError,
    "kind must be 'query' or 'key'",
  ),
  (
    "xscale-pos-float",
    lambda: xpos_scale(P(dtype=F32), rotary_dim=8, kind="key"),
    TypeError,
    "positions must be an",
  ),
  (
    "xscale-pos-rank",
    lambda: xpos_scale(P()[0], rotary_dim=8, kind="key"),
    ValueError,
    "positions must have shape",
  ),
  (
    "xscale-base-0",
    lambda: xpos_scale(P(), rotary_dim=8, kind="key", scale_base=0),
    ValueError,
    "scale_base must",
  ),
  (
    "xscale-offset-neg",
    lambda: xpos_scale(P(), rotary_dim=8, kind="key", offset=-1),
    ValueError,
    "offset must be in",
  ),
  (
    "xscale-offset-huge",
    lambda: xpos_scale(P(), rotary_dim=8, kind="key", offset=2**31),
    ValueError,
    "offset must",
  ),
  (
    "xscale-offset-float",
    lambda: xpos_scale(P(), rotary_dim=8, kind="key", offset=0.0),
    TypeError,
    "offset must be",
  ),
  (
    "xscale-far",
    lambda: xpos_scale(P() + 10**6, rotary_dim=8, kind="key"),
    ValueError,
    "too far from offset=0",
  ),
  ("xpos-x-int", lambda: xpos(X(dtype=I32), P(), kind="query"), TypeError, "x must be a float"),
  ("xpos-x-rank", lambda: xpos(jnp.ones((3, 8)), P(), kind="query"), ValueError, "x must have shape"),
  ("xpos-x-odd", lambda: xpos(X(h=7), P(), kind="query"), ValueError, "head_dim.*even"),
  (
    "xpos-pos-float",
    lambda: xpos(X(), P(dtype=F32), kind="query"),
    TypeError,
    "positions must be an integer",
  ),
  ("xpos-pos-shape", lambda: xpos(X(), P(2, 4), kind="query"), ValueError, "positions must have shape"),
  ("xpos-far", lambda: xpos(X(), P() + 10**9, kind="query"), ValueError, "too far from offset=0"),
  (
    "xpos-att-0",
    lambda: xpos(X(), P(), kind="query", attention_factor=0),
    ValueError,
    "attention_factor must",
  ),
  (
    "xpos-att-nan",
    lambda: xpos(X(), P(), kind="key", attention_factor=NAN),
    ValueError,
    "attention_factor",
  ),
  ("xpos-layout", lambda: apply_xpos(X(), P(), kind="key", layout="x"), ValueError, "layout must be one of"),
  # ---------------------------------------------------------------- sinusoidal
  ("sinf-D-odd", lambda: sinusoidal_frequencies(7), ValueError, "d_model must be even"),
  ("sinf-D-0", lambda: sinusoidal_frequencies(0), ValueError, "d_model must be a positive integer"),
  ("sinf-D-huge", lambda: sinusoidal_frequencies(HUGE), ValueError, "d_model must be <="),
  ("sinf-D-float", lambda: sinusoidal_frequencies(8.0), TypeError, "d_model must be a positive integer"),
  (
    "sinf-base-neg",
    lambda: sinusoidal_frequencies(8, base=-1.0),
    ValueError,
    "base must be a finite number > 0",
  ),
  (
    "sinf-conv",
    lambda: sinusoidal_frequencies(8, convention="fairseq"),
    ValueError,
    "convention must be one of",
  ),
  ("sine-pos-neg", lambda: sinusoidal_embedding(P() - 1, d_model=8), ValueError, "positions must be >= 0"),
  (
    "sine-pos-nan",
    lambda: sinusoidal_embedding(P(dtype=F32) * NAN, d_model=8),
    ValueError,
    "positions must be fin",
  ),
  (
    "sine-pos-bool",
    lambda: sinusoidal_embedding(P() > 0, d_model=8),
    TypeError,
    "positions must be an integer or",
  ),
  (
    "sine-dtype-int",
    lambda: sinusoidal_embedding(P(), d_model=8, dtype=jnp.int32),
    TypeError,
    "dtype must be a float",
  ),
  (
    "sine-dtype-str",
    lambda: sinusoidal_embedding(P(), d_model=8, dtype="foo"),
    TypeError,
    "dtype must be a float",
  ),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


# ---------------------------------------------------------------- traced values: the documented results


def _rope_f64(x, positions, inv_freq):
  """Interleaved RoPE in float64 numpy (RoFormer arXiv 2104.09864), at any integer or float positions."""
  x = np.asarray(x, np.float64)
  ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
  c, s = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
  return out


XR = jax.random.normal(jax.random.key(0), (1, 5, 2, 8), F32)
ROPE_JIT = jax.jit(lambda x, p: apply_rope(x, p, inv_freq=INV, layout="interleaved"))


def test_traced_negative_and_far_integer_positions_rotate_exactly():
  # Eager calls refuse negative positions; traced ones (not checkable) rotate by p * theta exactly.
  p = jnp.asarray([[-1, -777, -(2**31), 2**31 - 1, 0]], I32)
  np.testing.assert_allclose(ROPE_JIT(XR, p), _rope_f64(XR, p, INV), atol=5e-7 * 4)


def test_traced_non_finite_or_huge_float_positions_give_nan_rows_only():
  p = jnp.asarray([[NAN, INF, -INF, 3e9, 2.5]], F32)
  out = np.asarray(ROPE_JIT(XR, p))
  assert np.all(np.isnan(out[0, :4])) and np.all(np.isfinite(out[0, 4]))
  np.testing.assert_allclose(out[0, 4], _rope_f64(XR, p.at[0, :4].set(0.0), INV)[0, 4], atol=2e-6)
  # Negative float positions under jit are exact too (eager refuses them).
  q = jnp.asarray([[-0.5, -1e6, 0.25, 7.0, 1e9]], F32)
  np.testing.assert_allclose(ROPE_JIT(XR, q), _rope_f64(XR, q, INV), atol=2e-6)
  emb = jax.jit(lambda p: sinusoidal_embedding(p, d_model=8))(p)
  assert np.all(np.isnan(emb[0, :4])) and np.all(np.isfinite(emb[0, 4]))
  c, s = jax.jit(lambda p: rope_cos_sin(p, INV, phase_precision="float32"))(p)
  assert np.all(np.isnan(c[0, :3])) and np.all(np.isnan(s[0, :3]))


def test_traced_int64_positions_beyond_int32_give_nan_under_x64():
  with jax.enable_x64(True):
    p = jnp.asarray([[2**31 - 1, 2**31, -(2**31) - 1, 2**40, 5]], jnp.int64)
    out = np.asarray(jax.jit(lambda x, p: apply_rope(x, p, inv_freq=INV, layout="interleaved"))(XR, p))
    assert np.all(np.isnan(out[0, 1:4]))
    keep = [0, 4]
    np.testing.assert_allclose(out[0, keep], _rope_f64(XR[:, keep], p[:, keep], INV)[0], atol=2e-6)
    # Concrete int64 beyond int32 is refused, as without x64.
    with pytest.raises(ValueError, match="positions must be"):
      apply_rope(XR, p, layout="interleaved")


def test_traced_far_alibi_positions_are_exact_to_float32():
  q = jnp.asarray([[2**31 - 1, 2**30, 0]], I32)
  k = jnp.asarray([[0, 2**31 - 1, 123456789, 2**31 - 2]], I32)
  out = jax.jit(alibi_bias)(SLOPES, q, k)
  dist = np.asarray(q, np.float64)[0, :, None] - np.asarray(k, np.float64)[0, None, :]
  ref = -np.asarray(SLOPES, np.float64)[:, None, None] * dist
  np.testing.assert_allclose(out[0], ref, rtol=2**-23)
  sym = jax.jit(alibi_bias_symmetric)(SLOPES, q, k)
  np.testing.assert_allclose(sym[0], -np.abs(ref), rtol=2**-23)
  # Traced negative positions: the bias depends only on i - j (not checked under jit).
  shifted = jax.jit(alibi_bias)(SLOPES, q - 2**30, k - 2**30)
  np.testing.assert_array_equal(shifted, jax.jit(alibi_bias)(SLOPES, q - 1, k - 1))


def test_empty_batches_and_sequences_keep_their_shapes():
  # Under jit (one compile per op and shape; eager op-by-op dispatch is slower).
  for b, t in ((0, 3), (2, 0)):
    x, p, k = jnp.ones((b, t, 2, 8), F32), jnp.zeros((b, t), I32), jnp.zeros((b, 4), I32)
    assert jax.jit(rope)(x, p).shape == (b, t, 2, 8)
    assert jax.jit(lambda x, p: xpos(x, p, kind="key"))(x, p).shape == (b, t, 2, 8)
    assert jax.jit(lambda p: sinusoidal_embedding(p, d_model=8))(p).shape == (b, t, 8)
    assert jax.jit(positions_from_mask)(p).shape == (b, t)
    assert jax.jit(positions_from_segment_ids)(p).shape == (b, t)
    assert jax.jit(alibi_bias)(SLOPES, p, k).shape == (b, 2, t, 4)
    assert jax.jit(document_mask)(p, k).shape == (b, 1, t, 4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_low_precision_x_is_rotated_in_float32_and_cast_back(dtype):
  x = XR.astype(dtype)
  p = jnp.asarray([[0, 1, 2**20, 2**31 - 1, 17]], I32)
  out = apply_rope(x, p, inv_freq=INV, layout="interleaved")
  assert out.dtype == dtype
  ref = _rope_f64(x.astype(F32), p, INV)
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=float(jnp.finfo(dtype).eps) * 4)


def test_list_inputs_are_read_as_arrays():
  np.testing.assert_array_equal(positions_from_mask([[0, 1, 1]]), [[0, 0, 1]])
  np.testing.assert_array_equal(positions_from_segment_ids([[3, 3, 4]]), [[0, 1, 0]])
  np.testing.assert_array_equal(alibi_bias([0.5], [[1]], [[0, 1]])[0, 0], [[-0.5, 0.0]])
  np.testing.assert_array_equal(
    alibi_slopes_for_heads(4, alibi_heads=np.asarray([2, 0])), [0.00390625, 0, 0.0625, 0]
  )


def test_traced_wide_xpos_positions_give_nan_and_hfrope_query_scale_refuses_negative():
  with jax.enable_x64(True):
    p = jnp.asarray([[2**31 + 3, 5]], jnp.int64)
    s = jax.jit(lambda p: xpos_scale(p, rotary_dim=8, kind="query"))(p)
    assert np.all(np.isnan(s[0, 0])) and np.all(np.isfinite(s[0, 1]))
  r = rope_from_hf_config(
    {**LLAMA, "llama_4_scaling_beta": 0.1, "rope_scaling": {"rope_type": "default"}}
  )  # HFRope
  with pytest.raises(ValueError, match="positions must be >= 0"):
    r.query_scale(jnp.asarray([[-1, 3]], I32))
  with pytest.raises(TypeError, match="positions must be"):
    r.query_scale(jnp.asarray([[1.0, 3.0]], F32))


def test_int64_positions_without_x64_equal_int32_ones():
  p64 = np.asarray([[0, 7, 2**31 - 1, 5, 2**24 + 1]], np.int64)
  np.testing.assert_array_equal(
    apply_rope(XR, p64, inv_freq=INV, layout="interleaved"),
    apply_rope(XR, p64.astype(np.int32), inv_freq=INV, layout="interleaved"),
  )
  np.testing.assert_array_equal(alibi_bias(SLOPES, p64, p64), alibi_bias(SLOPES, p64.astype(np.int32), p64))
