"""The masks' contract (docs/contracts.md, attention section), walked with hostile values.

1. Every mask form reaches every backend of ``kernels.attention`` (xla, splash, pallas_gpu in
   interpret mode) with the same meaning, checked against a float64 numpy reference, or is refused by
   every backend with the same error.
2. A table of (argument, bad value, exception, message regex) for ``dense_attention_mask``.
3. Rows with no visible key give zeros, also under jit (documented, not NaN).

The deprecated name ``make_attention_mask`` is walked in contracts_deprecated_test.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import kernels, masks
from jaxpe.attention import reference as attention
from jaxpe.attention.masks import AttentionMask

B, T, N, K, H = 2, 16, 2, 1, 8
FUSED = ("splash", "pallas_gpu")
I32 = np.iinfo(np.int32)


def _qkv(seed=0, t_len=T):
  rng = np.random.default_rng(seed)
  shapes = ((B, t_len, N, H), (B, t_len, K, H), (B, t_len, K, H))
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)


# row 0: right padding (3 tokens), row 1: left padding (2 tokens)
VALID = np.arange(T)[None] < np.array([[T - 3], [T]])
VALID[1, :2] = False


def _numpy_reference(q, k, v, scale, ids, valid, causal):
  """float64 attention with the mask built from ``ids`` compared in numpy, in their own dtype."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  ids = np.asarray(ids)
  visible = ids[:, :, None] == ids[:, None, :]
  visible = visible & np.asarray(valid)[:, None, :]
  if causal:
    visible = visible & np.tril(np.ones((T, T), bool))[None]
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  logits = np.where(visible[:, None], logits, -np.inf)
  top = np.max(logits, axis=-1, keepdims=True)
  w = np.where(visible[:, None], np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bnts,bsnh->btnh", w, v)


def _ids(values_row0, values_row1, dtype, lib=np):
  return lib.asarray(np.array([values_row0, values_row1]).astype(dtype))


def _docs(a, b, c, n=(5, 6, 5)):
  return [a] * n[0] + [b] * n[1] + [c] * n[2]


# Segment-id forms every backend must read like xla (and like numpy's exact comparison).
ACCEPTED_IDS = {
  "int32 packed": lambda: _ids(_docs(0, 1, 2), [3] * T, np.int32, jnp),
  "int32 min/max beside padding": lambda: _ids(
    _docs(I32.min, I32.max, I32.min), [I32.min] * T, np.int32, jnp
  ),
  "int8 negative": lambda: _ids(_docs(-128, 127, -1), [0] * T, np.int8, jnp),
  "uint8": lambda: _ids(_docs(255, 0, 1), [7] * T, np.uint8, jnp),
  "int16": lambda: _ids(_docs(-32768, 32767, 0), [1] * T, np.int16, jnp),
  "uint16": lambda: _ids(_docs(65535, 0, 65535), [2] * T, np.uint16, jnp),
  "uint32 huge": lambda: _ids(_docs(2**32 - 1, 0, 2**31), [2**31] * T, np.uint32, jnp),
  "numpy int64 0 and 2^32 (wrapped to one id before)": lambda: _ids(_docs(0, 2**32, 0), [0] * T, np.int64),
  "numpy int64 equal after an int32 cast": lambda: _ids(_docs(5, 5 + 2**32, -(2**40)), [1] * T, np.int64),
  "numpy uint64 2^63": lambda: _ids(_docs(2**63, 0, 2**64 - 1), [0] * T, np.uint64),
  "interleaved documents": lambda: _ids([0, 1] * (T // 2), [4, 4, 9] * 5 + [4], np.int32, jnp),
  "python list": lambda: [_docs(0, 2**40, 0), [1] * T],
}


@pytest.mark.parametrize("name", list(ACCEPTED_IDS))
def test_every_backend_reads_every_segment_id_form_like_xla_and_numpy(name):
  ids = ACCEPTED_IDS[name]()
  q, k, v = _qkv()
  mask = AttentionMask(valid=jnp.asarray(VALID), segment_ids=ids, causal=False)
  want = _numpy_reference(q, k, v, 0.3, ids, VALID, causal=False)
  ref = kernels.attention(q, k, v, scale=0.3, mask=mask, implementation="xla")
  np.testing.assert_allclose(np.asarray(ref)[VALID], want[VALID], atol=2e-5, rtol=0)
  for impl in FUSED:
    out = kernels.attention(q, k, v, scale=0.3, mask=mask, implementation=impl, interpret=True)
    # padding query rows: zeros on the fused kernels (documented); every real row as xla
    np.testing.assert_allclose(np.asarray(out)[VALID], want[VALID], atol=2e-5, rtol=0, err_msg=impl)
    np.testing.assert_array_equal(np.asarray(out)[~VALID], 0.0)


def test_segment_ids_are_ranked_exactly_in_their_own_dtype_also_with_x64():
  # dense_segment_ids (the fused kernels' int32 ids) keeps equality exactly, numpy and jax inputs,
  # with and without jax_enable_x64; the reference is numpy's own == on the original values.
  cases = [
    np.array([[2**32, 0, 2**32, -1, 2**32 - 1, -1]], np.int64),
    np.array([[2**64 - 1, 0, 2**63, 0]], np.uint64),
  ]
  with jax.enable_x64(True):
    traced = [jax.jit(masks.dense_segment_ids)(jnp.asarray(c)) for c in cases]
  for ids, from_jax in zip(cases, traced):
    for got in (masks.dense_segment_ids(ids), from_jax):
      got = np.asarray(got)
      assert got.dtype == np.int32
      np.testing.assert_array_equal(got[:, :, None] == got[:, None, :], ids[:, :, None] == ids[:, None, :])


def test_pallas_gpu_runs_under_x64_like_xla():
  # jax's Triton kernel breaks its causal loop bound under jax_enable_x64 (int32 vs int64);
  # kernels.attention runs it with 32-bit operands.
  q, k, v = _qkv(1)
  with jax.enable_x64(True):
    ids = jnp.asarray(np.array([_docs(0, 2**32, 7), [1] * T], np.int64))
    assert ids.dtype == jnp.int64
    mask = AttentionMask(valid=jnp.asarray(VALID), segment_ids=ids, causal=True)
    out = kernels.attention(q, k, v, scale=0.3, mask=mask, implementation="pallas_gpu", interpret=True)
  want = _numpy_reference(q, k, v, 0.3, np.asarray(ids), VALID, causal=True)
  np.testing.assert_allclose(np.asarray(out)[VALID], want[VALID], atol=2e-5, rtol=0)


def test_splash_runs_under_x64_like_xla():
  # jax's splash kernel divides int32 by int64 in its index maps under jax_enable_x64;
  # kernels.attention runs it with 32-bit operands (as pallas_gpu).
  q, k, v = _qkv(1)
  with jax.enable_x64(True):
    mask = AttentionMask(valid=jnp.asarray(VALID), causal=True)
    out = kernels.attention(q, k, v, scale=0.3, mask=mask, implementation="splash", interpret=True)
  ids = np.where(np.asarray(VALID), 1, 0)
  want = _numpy_reference(q, k, v, 0.3, ids, VALID, causal=True)
  np.testing.assert_allclose(np.asarray(out)[VALID], want[VALID], atol=2e-5, rtol=0)


def test_traced_segment_ids_under_jit_match_xla_on_every_backend():
  # int32.min ids next to padding (the kernels' old padding id) and causal, all traced.
  q, k, v = _qkv(2)
  ids = jnp.asarray(np.array([_docs(I32.min, 3, I32.min), [I32.min] * T], np.int32))

  def run(impl):
    fn = lambda q, k, v, valid, ids: kernels.attention(  # noqa: E731
      q,
      k,
      v,
      scale=0.3,
      mask=AttentionMask(valid=valid, segment_ids=ids, causal=True),
      implementation=impl,
      interpret=True,
    )
    return np.asarray(jax.jit(fn)(q, k, v, jnp.asarray(VALID), ids))

  want = _numpy_reference(q, k, v, 0.3, ids, VALID, causal=True)
  for impl in ("xla", *FUSED):
    np.testing.assert_allclose(run(impl)[VALID], want[VALID], atol=2e-5, rtol=0, err_msg=impl)


# Mask forms refused by every backend with the same error.
REFUSED_MASKS = [
  (
    "float ids 0 and 0.5",
    dict(segment_ids=_ids(_docs(0, 0.5, 0), [0] * T, np.float32, jnp)),
    TypeError,
    r"AttentionMask.segment_ids must be an integer array .*float32",
  ),
  (
    "float64 numpy ids",
    dict(segment_ids=_ids([0.0] * T, [1.0] * T, np.float64)),
    TypeError,
    r"segment_ids must be an integer array",
  ),
  (
    "bool ids",
    dict(segment_ids=_ids([True] * T, [False] * T, bool, jnp)),
    TypeError,
    r"segment_ids .*got dtype bool",
  ),
  ("bfloat16 ids", dict(segment_ids=jnp.zeros((B, T), jnp.bfloat16)), TypeError, r"segment_ids .*bfloat16"),
  ("complex ids", dict(segment_ids=np.zeros((B, T), np.complex64)), TypeError, r"segment_ids .*complex64"),
  ("string ids", dict(segment_ids=[["a"] * T] * B), TypeError, r"AttentionMask.segment_ids must be an array"),
  (
    "ids [B, T+1]",
    dict(segment_ids=jnp.zeros((B, T + 1), jnp.int32)),
    ValueError,
    r"AttentionMask.segment_ids must have shape \[B, T\] = \[2, 16\], got \(2, 17\)",
  ),
  (
    "ids [T]",
    dict(segment_ids=jnp.zeros((T,), jnp.int32)),
    ValueError,
    r"segment_ids must have shape \[B, T\]",
  ),
  (
    "ids [B+1, T]",
    dict(segment_ids=jnp.zeros((B + 1, T), jnp.int32)),
    ValueError,
    r"segment_ids must have shape",
  ),
  (
    "ids [B, T-1]",
    dict(segment_ids=jnp.zeros((B, T - 1), jnp.int32)),
    ValueError,
    r"segment_ids must have shape",
  ),
  (
    "ids [B, T, 1]",
    dict(segment_ids=jnp.zeros((B, T, 1), jnp.int32)),
    ValueError,
    r"segment_ids must have shape",
  ),
  (
    "float valid",
    dict(valid=jnp.ones((B, T), jnp.float32)),
    TypeError,
    r"AttentionMask.valid must be a bool array",
  ),
  (
    "valid [B, T+1]",
    dict(valid=jnp.ones((B, T + 1), bool)),
    ValueError,
    r"AttentionMask.valid must have shape \[B, T\]",
  ),
  ("valid [T]", dict(valid=jnp.ones((T,), bool)), ValueError, r"AttentionMask.valid must have shape"),
  ("causal 'yes'", dict(causal="yes"), TypeError, r"AttentionMask.causal must be a Python bool"),
  ("causal array", dict(causal=np.array(True)), TypeError, r"AttentionMask.causal must be a Python bool"),
  ("causal None", dict(causal=None), TypeError, r"AttentionMask.causal must be a Python bool"),
]


@pytest.mark.parametrize("name,fields,exc,match", REFUSED_MASKS, ids=[c[0] for c in REFUSED_MASKS])
def test_every_backend_refuses_a_bad_mask_with_the_same_error(name, fields, exc, match):
  q, k, v = _qkv()
  mask = AttentionMask(**fields)
  messages = set()
  for impl in ("xla", *FUSED):
    with pytest.raises(exc, match=match) as info:
      kernels.attention(q, k, v, scale=0.3, mask=mask, implementation=impl, interpret=True)
    messages.add(str(info.value))
  assert len(messages) == 1, messages
  with pytest.raises(exc, match=match):
    mask.dense(B, T)


# ------------------------------------------------------------------------------------ the table

POS = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (B, 8))
Q, KK, V = _qkv(3, t_len=8)


def _mam(**kw):
  args = dict(q_index=POS, k_index=POS) | kw
  return masks.dense_attention_mask(args.pop("q_index"), args.pop("k_index"), **args)


MASK_ROWS = [
  ("mam", "q_index", dict(q_index=POS.astype(jnp.float32)), TypeError, r"q_index must be an integer array"),
  ("mam", "q_index", dict(q_index=POS[0]), ValueError, r"q_index must have shape \[B, T\] \(rank 2\)"),
  ("mam", "q_index", dict(q_index=POS - 1), ValueError, r"q_index must be >= 0"),
  ("mam", "k_index", dict(k_index=np.full((B, 8), 2**31, np.int64)), ValueError, r"k_index must be < 2\^31"),
  ("mam", "k_index", dict(k_index=POS[:1]), ValueError, r"same batch size B"),
  ("mam", "k_index", dict(k_index="slots"), TypeError, r"k_index must be an array"),
  ("mam", "causal", dict(causal="no"), TypeError, r"causal must be a Python bool"),
  ("mam", "causal", dict(causal=1), TypeError, r"causal must be a Python bool"),
  ("mam", "k_valid", dict(k_valid=jnp.ones((B, 8), jnp.float32)), TypeError, r"k_valid must be a bool array"),
  ("mam", "k_valid", dict(k_valid=jnp.ones((B, 9), bool)), ValueError, r"k_valid must have shape \[2, 8\]"),
  ("mam", "q_segment_ids", dict(q_segment_ids=POS), ValueError, r"must be given together"),
  (
    "mam",
    "q_segment_ids",
    dict(q_segment_ids=POS.astype(jnp.float32), k_segment_ids=POS),
    TypeError,
    r"q_segment_ids must be an integer array",
  ),
  (
    "mam",
    "k_segment_ids",
    dict(q_segment_ids=POS, k_segment_ids=POS > 3),
    TypeError,
    r"k_segment_ids must be an integer array .*bool",
  ),
  (
    "mam",
    "k_segment_ids",
    dict(q_segment_ids=POS, k_segment_ids=POS.astype(jnp.int8)),
    TypeError,
    r"same integer dtype",
  ),
  (
    "mam",
    "k_segment_ids",
    dict(q_segment_ids=POS, k_segment_ids=POS[:, :4]),
    ValueError,
    r"k_segment_ids must have shape \[2, 8\]",
  ),
]


@pytest.mark.parametrize(
  "arg,kwargs,exc,match", [r[1:] for r in MASK_ROWS], ids=[f"{r[1]}-{i}" for i, r in enumerate(MASK_ROWS)]
)
def test_dense_attention_mask_refuses_bad_arguments(arg, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    _mam(**kwargs)


# ------------------------------------------------------------------------------------ traced values


def test_rows_with_no_visible_key_give_zeros_under_jit_on_every_path():
  # A fully masked row (mask or -inf bias) is the documented zero row, not NaN, also when the mask
  # is traced; gradients there are zero and finite.
  q, k, v = Q[:, :4], KK[:, :4], V[:, :4]
  mask = jnp.asarray(
    np.array([[True, True, True, True], [False] * 4, [True, False, False, False], [False] * 4])
  )
  mask = jnp.broadcast_to(mask[None, None], (B, 1, 4, 4))
  bias = jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)

  def loss(q, mask, bias):
    out = attention.dot_product_attention(q, k, v, scale=0.5, mask=mask)
    out_b = attention.dot_product_attention(q, k, v, scale=0.5, bias=bias)
    return (
      out,
      out_b,
      jax.grad(lambda q: jnp.sum(attention.dot_product_attention(q, k, v, scale=0.5, mask=mask)))(q),
    )

  out, out_b, grad = jax.jit(loss)(q, mask, bias)
  for x in (out, out_b):
    np.testing.assert_array_equal(np.asarray(x)[:, [1, 3]], 0.0)
    np.testing.assert_allclose(
      np.asarray(x)[:, 2], np.broadcast_to(np.asarray(v)[:, 0], (B, N, H)), atol=1e-6
    )
  assert np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_array_equal(np.asarray(grad)[:, [1, 3]], 0.0)
  # kernels.attention with an all-padding batch row: every backend gives zeros there (the shapes
  # and mask structure of the segment-id forms above, so the kernels are compiled once)
  valid = jnp.asarray(np.array([[True] * T, [False] * T]))
  mask = AttentionMask(valid=valid, segment_ids=jnp.zeros((B, T), jnp.int32), causal=False)
  q, k, v = _qkv(4)
  for impl in ("xla", *FUSED):
    got = kernels.attention(q, k, v, scale=0.3, mask=mask, implementation=impl, interpret=True)
    np.testing.assert_array_equal(np.asarray(got)[1], 0.0, err_msg=impl)
    assert np.all(np.isfinite(np.asarray(got)))
