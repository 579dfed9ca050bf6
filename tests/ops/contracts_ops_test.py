"""Hostile inputs against the other ops' contracts (docs/contracts.md, section "Ops"): layouts,
positions, ALiBi, sinusoids (and every op on empty batches). RoPE and xPos: contracts_rope_test.py;
scaling and HF configs: contracts_rope_scaling_test.py.

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
  positions_from_mask,
  positions_from_segment_ids,
  rope_from_hf_config,
  sinusoidal_embedding,
  sinusoidal_frequencies,
)

F32 = jnp.float32
I32 = jnp.int32


def X(b=2, t=3, n=2, h=8, dtype=F32):
  return jnp.ones((b, t, n, h), dtype)


def P(b=2, t=3, dtype=I32):
  return jnp.broadcast_to(jnp.arange(t, dtype=dtype), (b, t))


SLOPES = jnp.asarray([0.5, 0.25], F32)
MASK = jnp.ones((2, 3), I32)
SEG = jnp.asarray([[0, 0, 1], [1, 1, 1]], I32)
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}
HUGE = 2**40
NAN = float("nan")

# apply_rope / apply_xpos with the pair layout (a required argument) held fixed: CASES walk the others.
rope = functools.partial(apply_rope, layout="interleaved")
xpos = functools.partial(apply_xpos, layout="interleaved")

# (id, call, exception, regex of the message)
CASES = [
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


def test_list_inputs_are_read_as_arrays():
  np.testing.assert_array_equal(positions_from_mask([[0, 1, 1]]), [[0, 0, 1]])
  np.testing.assert_array_equal(positions_from_segment_ids([[3, 3, 4]]), [[0, 1, 0]])
  np.testing.assert_array_equal(alibi_bias([0.5], [[1]], [[0, 1]])[0, 0], [[-0.5, 0.0]])
  np.testing.assert_array_equal(
    alibi_slopes_for_heads(4, alibi_heads=np.asarray([2, 0])), [0.00390625, 0, 0.0625, 0]
  )


def test_int64_positions_without_x64_equal_int32_ones():
  p64 = np.asarray([[0, 7, 2**31 - 1, 5, 2**24 + 1]], np.int64)
  np.testing.assert_array_equal(alibi_bias(SLOPES, p64, p64), alibi_bias(SLOPES, p64.astype(np.int32), p64))
