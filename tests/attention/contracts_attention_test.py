"""The attention surface's contract (docs/contracts.md, attention section), walked with hostile values.

1. Every mask form reaches every backend of ``kernels.attention`` (xla, splash, pallas_gpu in
   interpret mode) with the same meaning, checked against a float64 numpy reference, or is refused by
   every backend with the same error.
2. A table of (entry point, argument, bad value, exception, message regex) over attention.py,
   kernels.py, emulation.py, bf16_exact.py and emulation_report.py.
3. The documented results for values jit cannot check (fully masked rows, traced segment ids).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe import emulation
from jaxpe.attention import backends, emulated, kernels, masks
from jaxpe.attention import reference as attention
from jaxpe.attention.masks import AttentionMask
from jaxpe.emulation import bf16_exact
from jaxpe.emulation import report as emulation_report

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

nan, inf = float("nan"), float("inf")
Q, KK, V = _qkv(3, t_len=8)
POS = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (B, 8))
SLOPES = np.array([0.5, 0.25])


def _dpa(**kw):
  args = dict(q=Q, k=KK, v=V, scale=0.5) | kw
  return attention.dot_product_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _mam(**kw):
  args = dict(q_index=POS, k_index=POS) | kw
  return masks.dense_attention_mask(args.pop("q_index"), args.pop("k_index"), **args)


def _spec(**kw):
  return backends.AlibiSpec(**(dict(slopes=SLOPES, q_positions=POS, k_positions=POS, max_position=8) | kw))


def _att(impl):
  def call(**kw):
    args = dict(q=Q, k=KK, v=V, scale=0.5, implementation=impl, interpret=True) | kw
    return kernels.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)

  return call


def _rand(*shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(9).normal(size=shape), dtype)


ATTENTION_ROWS = [
  # dot_product_attention: q, k, v
  ("dpa", "q", dict(q=Q.astype(jnp.int32)), TypeError, r"q must be a float array"),
  ("dpa", "q", dict(q=Q.astype(bool)), TypeError, r"q must be a float array"),
  ("dpa", "q", dict(q=Q.astype(jnp.complex64)), TypeError, r"q must be a float array"),
  ("dpa", "q", dict(q=Q[0]), ValueError, r"q must have shape \[B, T, N, Hq\] \(rank 4\)"),
  ("dpa", "q", dict(q=Q[None]), ValueError, r"q must have shape \[B, T, N, Hq\] \(rank 4\)"),
  (
    "dpa",
    "k",
    dict(q=_rand(B, 8, 3, H), k=_rand(B, 8, 2, H), v=_rand(B, 8, 2, H)),
    ValueError,
    r"query heads N=3 must be a multiple of kv heads K=2",
  ),
  ("dpa", "q", dict(q=_rand(B, 8, 0, H)), ValueError, r"at least one head"),
  ("dpa", "k", dict(k=_rand(B, 8, 0, H), v=_rand(B, 8, 0, H)), ValueError, r"at least one head"),
  ("dpa", "k", dict(k=_rand(B + 1, 8, K, H)), ValueError, r"k must have shape \[B, S, K, Hq\]"),
  ("dpa", "k", dict(k=_rand(B, 8, K, H + 1)), ValueError, r"k must have shape \[B, S, K, Hq\]"),
  ("dpa", "v", dict(v=_rand(B, 7, K, H)), ValueError, r"v must have shape \[B, S, K, H\]"),
  ("dpa", "v", dict(v=V.astype(jnp.int8)), TypeError, r"v must be a float array"),
  # scale
  ("dpa", "scale", dict(scale=nan), ValueError, r"scale must be a finite number > 0, got nan"),
  ("dpa", "scale", dict(scale=inf), ValueError, r"scale must be a finite number > 0"),
  ("dpa", "scale", dict(scale=-inf), ValueError, r"scale must be a finite number > 0"),
  ("dpa", "scale", dict(scale=0.0), ValueError, r"scale must be a finite number > 0"),
  ("dpa", "scale", dict(scale=-0.5), ValueError, r"scale must be a finite number > 0"),
  ("dpa", "scale", dict(scale=True), TypeError, r"scale must be a real number"),
  ("dpa", "scale", dict(scale="0.5"), TypeError, r"scale must be a real number"),
  ("dpa", "scale", dict(scale=None), TypeError, r"scale must be a real number"),
  ("dpa", "scale", dict(scale=1j), TypeError, r"scale must be a real number"),
  ("dpa", "scale", dict(scale=np.array([0.5, 0.5])), TypeError, r"scale must be a real number"),
  # bias and mask
  ("dpa", "bias", dict(bias=jnp.zeros((B, N, 8, 7))), ValueError, r"bias must broadcast to \[B, N, T, S\]"),
  ("dpa", "bias", dict(bias=jnp.zeros((N, 8, 8))), ValueError, r"bias must broadcast to \[B, N, T, S\]"),
  ("dpa", "bias", dict(bias=jnp.zeros((B, N, 8, 8), bool)), TypeError, r"bias must be a float array"),
  ("dpa", "bias", dict(bias="alibi"), TypeError, r"bias must be an array"),
  ("dpa", "mask", dict(mask=jnp.ones((B, 1, 8, 8), jnp.int32)), TypeError, r"mask must be a bool array"),
  (
    "dpa",
    "mask",
    dict(mask=jnp.ones((B, 1, 8, 9), bool)),
    ValueError,
    r"mask must broadcast to \[B, N, T, S\]",
  ),
  ("dpa", "mask", dict(mask=jnp.ones((8, 8), bool)), ValueError, r"mask must broadcast"),
  ("dpa", "mask", dict(mask="causal"), TypeError, r"mask must be an array"),
  ("dpa", "mask", dict(mask=AttentionMask()), TypeError, r"mask must be a dense bool array here"),
  # precise_dims and causal_block
  ("dpa", "precise_dims", dict(precise_dims=-1), ValueError, r"precise_dims must be an int in 0..Hq = 8"),
  ("dpa", "precise_dims", dict(precise_dims=9), ValueError, r"precise_dims must be an int in 0..Hq = 8"),
  ("dpa", "precise_dims", dict(precise_dims=2.0), ValueError, r"precise_dims must be an int"),
  ("dpa", "precise_dims", dict(precise_dims=True), ValueError, r"precise_dims must be an int"),
  ("dpa", "causal_block", dict(causal_block=0), ValueError, r"causal_block must be an int > 0"),
  # without a mask or bias nothing hides the keys causal_block skips (gave neither plain nor causal attention)
  (
    "dpa",
    "causal_block",
    dict(causal_block=2, mask=None, bias=None),
    ValueError,
    r"causal_block needs the causal mask",
  ),
  ("dpa", "causal_block", dict(causal_block=-4), ValueError, r"causal_block must be an int > 0"),
  ("dpa", "causal_block", dict(causal_block=4.0), ValueError, r"causal_block must be an int > 0"),
  (
    "dpa",
    "causal_block",
    dict(causal_block=4, k=_rand(B, 4, K, H), v=_rand(B, 4, K, H)),
    ValueError,
    r"causal_block is for causal self-attention \(T == S\)",
  ),
  # make_attention_mask
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

# kernels.attention: every backend the same error where the argument means the same everywhere.
for _impl in ("xla", *FUSED):
  ATTENTION_ROWS += [
    (_impl, "q", dict(q=Q.astype(jnp.int32)), TypeError, r"q must be a float array"),
    (_impl, "q", dict(q=Q[0]), ValueError, r"q must have shape \[B, T, N, Hq\] \(rank 4\)"),
    (_impl, "k", dict(k=_rand(B, 8, 0, H), v=_rand(B, 8, 0, H)), ValueError, r"at least one head"),
    (
      _impl,
      "k",
      dict(q=_rand(B, 8, 3, H), k=_rand(B, 8, 2, H), v=_rand(B, 8, 2, H)),
      ValueError,
      r"N % K == 0",
    ),
    (_impl, "v", dict(v=_rand(B, 7, K, H)), ValueError, r"q, k, v must be"),
    (_impl, "scale", dict(scale=nan), ValueError, r"scale must be a finite number > 0"),
    (_impl, "scale", dict(scale=0), ValueError, r"scale must be a finite number > 0"),
    (_impl, "scale", dict(scale=-1.0), ValueError, r"scale must be a finite number > 0"),
    (_impl, "scale", dict(scale=False), TypeError, r"scale must be a real number"),
    (_impl, "precise_dims", dict(precise_dims=-1), ValueError, r"precise_dims must be an int in 0..Hq = 8"),
    (_impl, "precise_dims", dict(precise_dims=9), ValueError, r"precise_dims must be an int in 0..Hq = 8"),
    (_impl, "precise_dims", dict(precise_dims=1.0), TypeError, r"precise_dims must be an int"),
    (_impl, "mask", dict(mask="causal"), TypeError, r"mask must be an AttentionMask, a bool array"),
    (
      _impl,
      "mask",
      dict(mask=AttentionMask(), k=_rand(B, 4, K, H), v=_rand(B, 4, K, H)),
      ValueError,
      r"AttentionMask is for self-attention",
    ),
    (
      _impl,
      "implementation",
      dict(implementation="flash"),
      ValueError,
      r"attention implementation must be one of",
    ),
    (_impl, "interpret", dict(interpret="yes"), TypeError, r"interpret must be a bool"),
    (_impl, "alibi_spec", dict(alibi_spec="alibi"), TypeError, r"alibi_spec must be an AlibiSpec"),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(slopes=np.array([0.5]))),
      ValueError,
      r"AlibiSpec.slopes must have shape \[N\] = \[2\]",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(slopes=np.array([nan, 1.0]))),
      ValueError,
      r"AlibiSpec.slopes must be finite and >= 0",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(slopes=np.array([-1.0, 1.0]))),
      ValueError,
      r"AlibiSpec.slopes must be finite and >= 0",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(slopes=np.array([inf, 1.0]))),
      ValueError,
      r"AlibiSpec.slopes must be finite",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(slopes=np.array(["a", "b"]))),
      TypeError,
      r"AlibiSpec.slopes must be a float array",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(q_positions=POS[:, :4])),
      ValueError,
      r"AlibiSpec.q_positions must have shape \[2, 8\]",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(k_positions=POS[0])),
      ValueError,
      r"AlibiSpec.k_positions must have shape \[2, 8\]",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(q_positions=POS.astype(jnp.float32))),
      TypeError,
      r"AlibiSpec.q_positions must be an integer array",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(k_positions=POS - 1)),
      ValueError,
      r"AlibiSpec.k_positions must be >= 0",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(max_position=0)),
      ValueError,
      r"AlibiSpec.max_position must be in 1..2\^24",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(max_position=2**25)),
      ValueError,
      r"AlibiSpec.max_position must be in",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(max_position=8.0)),
      TypeError,
      r"AlibiSpec.max_position must be an int",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(form="linear")),
      ValueError,
      r"AlibiSpec.form must be 'exact' or",
    ),
    (_impl, "alibi_spec", dict(alibi_spec=_spec(order=0)), ValueError, r"AlibiSpec.order must be in 1..8"),
    (_impl, "alibi_spec", dict(alibi_spec=_spec(order=9)), ValueError, r"AlibiSpec.order must be in 1..8"),
    (_impl, "alibi_spec", dict(alibi_spec=_spec(order=2.0)), TypeError, r"AlibiSpec.order must be an int"),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(theta=nan)),
      ValueError,
      r"AlibiSpec.theta must be a finite number > 0",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(theta=-0.1)),
      ValueError,
      r"AlibiSpec.theta must be a finite number",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(theta="0.1")),
      TypeError,
      r"AlibiSpec.theta must be None or a number",
    ),
  ]
for _impl in FUSED:  # what only the fused kernels refuse (xla takes it)
  ATTENTION_ROWS += [
    (_impl, "bias", dict(bias=jnp.zeros((B, N, 8, 8))), ValueError, r"takes no bias tensor.*alibi_spec"),
    (_impl, "mask", dict(mask=jnp.ones((B, 1, 8, 8), bool)), ValueError, r"takes an AttentionMask"),
    (_impl, "k", dict(k=_rand(B, 4, K, H), v=_rand(B, 4, K, H)), ValueError, r"self-attention \(T == S\)"),
    (_impl, "v", dict(v=_rand(B, 8, K, 0)), ValueError, r"content dims plus precise_dims"),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(max_position=4)),
      ValueError,
      r"AlibiSpec.q_positions must be in \[0, AlibiSpec.max_position = 4\)",
    ),
    (
      _impl,
      "alibi_spec",
      dict(alibi_spec=_spec(form="rotated", slopes=np.array([0.0, 1.0]), theta=0.01)),
      ValueError,
      r"rotated ALiBi emulation needs every slope > 0",
    ),
    (_impl, "alibi_spec", dict(alibi_spec=_spec(form="rotated", theta=1.0)), ValueError, r"theta too large"),
  ]
ATTENTION_ROWS += [
  (
    "xla",
    "impl",
    dict(implementation="splash", interpret=False),
    ValueError,
    r"'splash' is not available.*interpret=True",
  ),
  (
    "xla",
    "implementation",
    dict(implementation=None),
    ValueError,
    r"attention implementation must be one of",
  ),
]

ENTRY = {"dpa": _dpa, "mam": _mam, **{i: _att(i) for i in ("xla", *FUSED)}}


@pytest.mark.parametrize(
  "entry,arg,kwargs,exc,match",
  ATTENTION_ROWS,
  ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(ATTENTION_ROWS)],
)
def test_attention_entry_points_refuse_bad_arguments(entry, arg, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    ENTRY[entry](**kwargs)


# ------------------------------------------------------------------------------------ emulation

PLAN = emulation.solve_base_constrained(SLOPES, head_dim=H, rotary_dim=8, max_len=8, max_phase=0.1)
EMUL_Q, EMUL_K = _rand(1, 8, 2, 4), _rand(1, 8, 1, 4)
EPOS = jnp.arange(8, dtype=jnp.int32)[None]


def _kw(fn, base, *args):
  return lambda **kw: fn(*args, **(base | kw))


_ROPE = _kw(emulation.apply_rope_alibi, dict(slopes=SLOPES, theta=0.01))
_AUG = _kw(emulation.apply_augmented_alibi, dict(slopes=SLOPES))


def _rope(**kw):
  args = dict(q=EMUL_Q, k=EMUL_K, q_positions=EPOS, k_positions=EPOS) | kw
  return _ROPE(**args)


def _aug(**kw):
  args = dict(q=EMUL_Q, k=EMUL_K, q_positions=EPOS, k_positions=EPOS) | kw
  return _AUG(**args)


def _emul_attn(**kw):
  args = (
    dict(q=EMUL_Q, k=EMUL_K, v=EMUL_K, q_positions=EPOS, k_positions=EPOS, slopes=SLOPES, theta=0.01) | kw
  )
  return emulated.emulated_alibi_attention(
    args.pop("q"), args.pop("k"), args.pop("v"), args.pop("q_positions"), args.pop("k_positions"), **args
  )


EMULATION_ENTRY = {
  "emulation_weights": emulation.emulation_weights,
  "emulation_theta": _kw(emulation.emulation_theta, dict(max_phase=0.1, max_len=8)),
  "emulation_amplitudes": _kw(emulation.emulation_amplitudes, dict(slopes=[0.5], head_dim=4, theta=0.01)),
  "emulation_error_bound": _kw(
    emulation.emulation_error_bound, dict(slopes=[0.5], theta=0.01, distance=3, position=5)
  ),
  "solve_emulation": _kw(
    emulation.solve_emulation, dict(slopes=[0.5, 0.25], head_dim=4, max_len=8, max_phase=0.1)
  ),
  "solve_base_constrained": _kw(
    emulation.solve_base_constrained,
    dict(slopes=[0.5, 0.25], head_dim=4, rotary_dim=8, max_len=8, max_phase=0.1),
  ),
  "pad_head_dim": lambda **kw: emulation.pad_head_dim(**(dict(x=EMUL_Q) | kw)),
  "apply_rope_alibi": _rope,
  "apply_augmented_alibi": _aug,
  "base_constrained_qk": lambda **kw: emulation.base_constrained_qk(
    **(dict(q=_rand(1, 8, 2, H), k=_rand(1, 8, 1, H), plan=PLAN) | kw)
  ),
  "emulated_alibi_attention": _emul_attn,
  "split_bf16": lambda **kw: bf16_exact.split_bf16(**(dict(x=EMUL_Q) | kw)),
  "split_product_dims": lambda **kw: bf16_exact.split_product_dims(
    **(dict(q_extra=EMUL_Q, k_extra=EMUL_K) | kw)
  ),
  "position_digits": bf16_exact.position_digits,
  "exact_alibi_dims": _kw(
    bf16_exact.exact_alibi_dims,
    dict(q_positions=EPOS, k_positions=EPOS, slopes=SLOPES, dot_scale=0.5, max_position=8, num_kv_heads=1),
  ),
  "round_mantissa": _kw(bf16_exact.round_mantissa, dict(x=[1.0], fmt="tf32")),
  "alibi_term_dims": _kw(
    bf16_exact.alibi_term_dims,
    dict(form="exact", q_positions=[0, 1], k_positions=[0, 1], slopes=[0.5], head_dim=4, max_len=8),
  ),
  "report": _kw(
    emulation_report.report, dict(num_heads=2, head_dim=4, contexts=[16], dtypes=["float32"], plot=None)
  ),
}

EMULATION_ROWS = [
  ("emulation_weights", "order", dict(order=0), ValueError, r"order must be a positive integer"),
  ("emulation_weights", "order", dict(order=9), ValueError, r"order must be in 1..8"),
  ("emulation_weights", "order", dict(order=2.0), ValueError, r"order must be a positive integer"),
  ("emulation_weights", "order", dict(order=True), ValueError, r"order must be a positive integer"),
  ("emulation_weights", "order", dict(order=None), ValueError, r"order must be a positive integer"),
  ("emulation_theta", "max_phase", dict(max_phase=nan), ValueError, r"max_phase must be in \(0, pi/2\)"),
  ("emulation_theta", "max_phase", dict(max_phase=0.0), ValueError, r"max_phase must be in \(0, pi/2\)"),
  ("emulation_theta", "max_phase", dict(max_phase=-0.1), ValueError, r"max_phase must be in \(0, pi/2\)"),
  (
    "emulation_theta",
    "max_phase",
    dict(max_phase=math.pi / 2),
    ValueError,
    r"max_phase must be in \(0, pi/2\)",
  ),
  ("emulation_theta", "max_phase", dict(max_phase=inf), ValueError, r"max_phase must be in \(0, pi/2\)"),
  ("emulation_theta", "max_phase", dict(max_phase="0.1"), TypeError, r"max_phase must be a real number"),
  ("emulation_theta", "max_phase", dict(max_phase=True), TypeError, r"max_phase must be a real number"),
  ("emulation_theta", "max_len", dict(max_len=0), ValueError, r"max_len must be a positive integer"),
  ("emulation_theta", "max_len", dict(max_len=8.0), ValueError, r"max_len must be a positive integer"),
  ("emulation_theta", "max_len", dict(max_len=2**40), ValueError, r"max_len must be <= 2\^24"),
  ("emulation_amplitudes", "slopes", dict(slopes=[nan]), ValueError, r"slopes must be finite and > 0"),
  ("emulation_amplitudes", "slopes", dict(slopes=[-1.0]), ValueError, r"slopes must be finite and > 0"),
  ("emulation_amplitudes", "slopes", dict(slopes=[0.0]), ValueError, r"slopes must be finite and > 0"),
  (
    "emulation_amplitudes",
    "slopes",
    dict(slopes=[]),
    ValueError,
    r"slopes must have shape \[N\] with N >= 1",
  ),
  ("emulation_amplitudes", "slopes", dict(slopes=[[0.5]]), ValueError, r"slopes must have shape \[N\]"),
  ("emulation_amplitudes", "slopes", dict(slopes=["a"]), TypeError, r"slopes must be a \[N\] float array"),
  ("emulation_amplitudes", "slopes", dict(slopes=[True]), TypeError, r"slopes must be a \[N\] float array"),
  ("emulation_amplitudes", "head_dim", dict(head_dim=0), ValueError, r"head_dim must be a positive integer"),
  ("emulation_amplitudes", "theta", dict(theta=nan), ValueError, r"theta must be a finite number > 0"),
  ("emulation_amplitudes", "theta", dict(theta=0), ValueError, r"theta must be a finite number > 0"),
  ("emulation_amplitudes", "theta", dict(theta=inf), ValueError, r"theta must be a finite number > 0"),
  ("emulation_amplitudes", "theta", dict(theta="0.01"), TypeError, r"theta must be a real number"),
  (
    "emulation_amplitudes",
    "theta",
    dict(theta=[0.1, 0.2]),
    ValueError,
    r"theta must be a number > 0 or \[N\]",
  ),
  ("emulation_error_bound", "slopes", dict(slopes=[nan]), ValueError, r"slopes must be finite and > 0"),
  ("emulation_error_bound", "theta", dict(theta=nan), ValueError, r"theta must be finite and > 0"),
  (
    "emulation_error_bound",
    "theta",
    dict(theta=[0.1, 0.1]),
    ValueError,
    r"theta must be a number or \[N\] = \[1\]",
  ),
  ("emulation_error_bound", "distance", dict(distance=-1), ValueError, r"distance must be finite and >= 0"),
  ("emulation_error_bound", "distance", dict(distance=nan), ValueError, r"distance must be finite and >= 0"),
  ("emulation_error_bound", "position", dict(position=inf), ValueError, r"position must be finite and >= 0"),
  ("emulation_error_bound", "position", dict(position="5"), TypeError, r"position must be a number"),
  (
    "emulation_error_bound",
    "position",
    dict(distance=[1, 2], position=[1, 2, 3]),
    ValueError,
    r"distance and position must broadcast together",
  ),
  ("emulation_error_bound", "order", dict(order=0), ValueError, r"order must be a positive integer"),
  ("emulation_error_bound", "dtype", dict(dtype="float64"), ValueError, r"dtype must be one of"),
  ("solve_emulation", "max_len", dict(max_len=0), ValueError, r"max_len must be a positive integer"),
  ("solve_emulation", "max_len", dict(max_len=2**25), ValueError, r"max_len must be <= 2\^24"),
  ("solve_emulation", "head_dim", dict(head_dim=-4), ValueError, r"head_dim must be a positive integer"),
  ("solve_emulation", "order", dict(order=9), ValueError, r"order must be in 1..8"),
  ("solve_emulation", "max_phase", dict(max_phase=nan), ValueError, r"max_phase must be in \(0, pi/2\)"),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error=nan),
    ValueError,
    r"target_error must be a finite number > 0",
  ),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error=0.0),
    ValueError,
    r"target_error must be",
  ),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error=1e-30),
    ValueError,
    r"rounding floor",
  ),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error="0.1"),
    TypeError,
    r"target_error must be a real number",
  ),
  ("solve_emulation", "max_phase", dict(target_error=0.1), ValueError, r"exactly one of max_phase"),
  ("solve_emulation", "slopes", dict(slopes=None), ValueError, r"exactly one of slopes"),
  (
    "solve_emulation",
    "num_heads",
    dict(slopes=None, num_heads=0),
    ValueError,
    r"num_heads must be a positive integer",
  ),
  (
    "solve_emulation",
    "dtype",
    dict(dtype="float16", max_len=2**20),
    ValueError,
    r"not representable in float16",
  ),
  ("solve_emulation", "dtype", dict(dtype="int8"), ValueError, r"dtype must be one of"),
  ("solve_emulation", "shared_theta", dict(shared_theta="no"), TypeError, r"shared_theta must be a bool"),
  ("solve_base_constrained", "base", dict(base=1.0), ValueError, r"base must be > 1"),
  ("solve_base_constrained", "base", dict(base=nan), ValueError, r"base must be a finite number > 0"),
  ("solve_base_constrained", "rotary_dim", dict(rotary_dim=3), ValueError, r"rotary_dim must be even"),
  ("solve_base_constrained", "rotary_dim", dict(rotary_dim=0), ValueError, r"rotary_dim must be a positive"),
  (
    "solve_base_constrained",
    "layout",
    dict(layout="neox"),
    ValueError,
    r"layout must be 'interleaved' or 'half'",
  ),
  ("solve_base_constrained", "max_len", dict(max_len=10**6), ValueError, r"raise the base"),
  ("solve_base_constrained", "max_phase", dict(max_phase=None), ValueError, r"give max_phase"),
  ("solve_base_constrained", "target_error", dict(target_error=-1), ValueError, r"target_error must be"),
  ("pad_head_dim", "multiple", dict(multiple=0), ValueError, r"multiple must be a positive integer"),
  ("pad_head_dim", "multiple", dict(multiple=8.0), ValueError, r"multiple must be a positive integer"),
  ("pad_head_dim", "multiple", dict(multiple=10**9), ValueError, r"multiple must be in 1..4096"),
  ("pad_head_dim", "x", dict(x=[1.0, 2.0]), TypeError, r"x must be an array of rank >= 1"),
  ("pad_head_dim", "x", dict(x=jnp.zeros(())), TypeError, r"x must be an array of rank >= 1"),
  ("apply_rope_alibi", "slopes", dict(slopes=[0.5]), ValueError, r"one entry per head \(N = 2\)"),
  ("apply_rope_alibi", "slopes", dict(slopes=[nan, 1.0]), ValueError, r"slopes must be finite and > 0"),
  ("apply_rope_alibi", "slopes", dict(slopes=[0.0, 1.0]), ValueError, r"slopes must be finite and > 0"),
  ("apply_rope_alibi", "theta", dict(theta=nan), ValueError, r"theta must be a finite number > 0"),
  ("apply_rope_alibi", "theta", dict(theta=0.0), ValueError, r"theta must be a finite number > 0"),
  ("apply_rope_alibi", "theta", dict(theta=1.0), ValueError, r"theta too large for these positions"),
  ("apply_rope_alibi", "theta", dict(theta="0.01"), TypeError, r"theta must be a real number"),
  ("apply_rope_alibi", "theta", dict(theta=[0.01]), ValueError, r"theta must be a number > 0 or \[N\]"),
  ("apply_rope_alibi", "order", dict(order=0), ValueError, r"order must be a positive integer"),
  ("apply_rope_alibi", "out_dtype", dict(out_dtype="float64"), ValueError, r"dtype must be one of"),
  (
    "apply_rope_alibi",
    "out_dtype",
    dict(out_dtype=jnp.float16, theta=1e-5),
    ValueError,
    r"not representable in float16",
  ),
  (
    "apply_rope_alibi",
    "pad_multiple",
    dict(pad_multiple=0),
    ValueError,
    r"pad_multiple must be an int in 1\.\.4096, got 0",
  ),
  (
    "apply_rope_alibi",
    "q_positions",
    dict(q_positions=EPOS.astype(jnp.float32)),
    TypeError,
    r"q_positions must be an integer array",
  ),
  ("apply_rope_alibi", "q_positions", dict(q_positions=EPOS[:, :4]), ValueError, r"q_positions shape"),
  ("apply_rope_alibi", "k_positions", dict(k_positions=EPOS - 1), ValueError, r"k_positions must be >= 0"),
  (
    "apply_rope_alibi",
    "k_positions",
    dict(q_positions=EPOS + 2**24, k_positions=EPOS + 2**24),
    ValueError,
    r"< 2\^24",
  ),
  ("apply_rope_alibi", "k", dict(k=_rand(1, 8, 0, 4)), ValueError, r"at least one head"),
  ("apply_rope_alibi", "k", dict(k=_rand(1, 8, 3, 4)), ValueError, r"multiple of kv heads"),
  ("apply_rope_alibi", "q", dict(q=EMUL_Q.astype(jnp.int32)), TypeError, r"q must be a float array"),
  ("apply_augmented_alibi", "slopes", dict(slopes=[-1.0, 1.0]), ValueError, r"slopes must be finite and > 0"),
  ("apply_augmented_alibi", "slopes", dict(slopes="ab"), TypeError, r"slopes must be a \[N\] float array"),
  ("apply_augmented_alibi", "k", dict(k=_rand(1, 8, 0, 4)), ValueError, r"at least one head"),
  (
    "apply_augmented_alibi",
    "q_positions",
    dict(q_positions=EPOS[0]),
    ValueError,
    r"q_positions must have shape",
  ),
  ("apply_augmented_alibi", "out_dtype", dict(out_dtype=jnp.int32), ValueError, r"dtype must be one of"),
  ("base_constrained_qk", "plan", dict(plan="plan"), TypeError, r"plan must be a BaseConstrainedPlan"),
  ("base_constrained_qk", "q", dict(q=_rand(1, 8, 3, H)), ValueError, r"q must have N = 2 heads"),
  (
    "base_constrained_qk",
    "q",
    dict(q=_rand(1, 8, 2, H).astype(jnp.int32)),
    TypeError,
    r"q must be a float array",
  ),
  ("base_constrained_qk", "k", dict(k=_rand(1, 8, 1, H + 1)), ValueError, r"must have H = plan.head_dim"),
  ("base_constrained_qk", "k", dict(k=_rand(2, 8, 1, H)), ValueError, r"same batch size"),
  (
    "emulated_alibi_attention",
    "theta",
    dict(theta=None),
    ValueError,
    r"theta \(radians per token\) is required",
  ),
  ("emulated_alibi_attention", "is_causal", dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
  ("emulated_alibi_attention", "interpret", dict(interpret=1), TypeError, r"interpret must be a bool"),
  (
    "emulated_alibi_attention",
    "implementation",
    dict(implementation="flash"),
    ValueError,
    r"impl must be one of",
  ),
  ("emulated_alibi_attention", "v", dict(v=_rand(1, 8, 1, 3)), ValueError, r"v must have the shape of k"),
  (
    "emulated_alibi_attention",
    "mask",
    dict(mask=jnp.ones((1, 1, 8, 8), jnp.int32)),
    TypeError,
    r"mask must be a bool",
  ),
  (
    "emulated_alibi_attention",
    "mask",
    dict(mask=jnp.ones((1, 1, 8, 8), bool), implementation="splash", interpret=True),
    ValueError,
    r"takes no dense mask",
  ),
  ("emulated_alibi_attention", "slopes", dict(slopes=[nan, 1.0]), ValueError, r"slopes must be finite"),
  ("emulated_alibi_attention", "order", dict(order=0), ValueError, r"order must be a positive integer"),
  ("split_bf16", "parts", dict(parts=0), ValueError, r"parts must be a positive integer"),
  ("split_bf16", "x", dict(x=EMUL_Q.astype(jnp.int32)), TypeError, r"x must be a float array"),
  ("split_product_dims", "k_extra", dict(k_extra=_rand(1, 8, 1, 3)), ValueError, r"same last dim E"),
  (
    "position_digits",
    "max_position",
    dict(max_position=0),
    ValueError,
    r"max_position must be a positive integer",
  ),
  ("position_digits", "max_position", dict(max_position=2**25), ValueError, r"max_position must be <= 2\^24"),
  (
    "exact_alibi_dims",
    "dot_scale",
    dict(dot_scale=nan),
    ValueError,
    r"dot_scale must be a finite number > 0",
  ),
  (
    "exact_alibi_dims",
    "dot_scale",
    dict(dot_scale=0.0),
    ValueError,
    r"dot_scale must be a finite number > 0",
  ),
  ("exact_alibi_dims", "num_kv_heads", dict(num_kv_heads=0), ValueError, r"num_kv_heads must be a positive"),
  ("exact_alibi_dims", "slopes", dict(slopes=[-1.0]), ValueError, r"slopes must be finite and >= 0"),
  (
    "exact_alibi_dims",
    "max_position",
    dict(max_position=4),
    ValueError,
    r"q_positions must be in \[0, max_position",
  ),
  ("exact_alibi_dims", "q_positions", dict(q_positions=EPOS[0]), ValueError, r"q_positions must have shape"),
  ("round_mantissa", "fmt", dict(fmt="fp8"), ValueError, r"fmt must be one of"),
  ("alibi_term_dims", "form", dict(form="linear"), ValueError, r"form must be 'exact' or 'rotated'"),
  ("alibi_term_dims", "representation", dict(representation="fp8"), ValueError, r"representation must be"),
  ("alibi_term_dims", "head_dim", dict(head_dim=0), ValueError, r"head_dim must be a positive integer"),
  ("alibi_term_dims", "q_positions", dict(q_positions=[-1]), ValueError, r"q_positions must be >= 0"),
  ("alibi_term_dims", "q_positions", dict(q_positions=[2**31]), ValueError, r"q_positions must be < 2\^31"),
  (
    "alibi_term_dims",
    "k_positions",
    dict(k_positions=[0.5]),
    TypeError,
    r"k_positions must be an integer array",
  ),
  ("report", "num_heads", dict(num_heads=0), ValueError, r"num_heads must be a positive integer"),
  ("report", "head_dim", dict(head_dim=-1), ValueError, r"head_dim must be a positive integer"),
  ("report", "contexts", dict(contexts=[]), ValueError, r"contexts must be a non-empty list"),
  ("report", "contexts", dict(contexts=[1]), ValueError, r"contexts must be ints in 2..2\^24"),
  ("report", "contexts", dict(contexts="2048"), ValueError, r"contexts must be a non-empty list"),
  ("report", "dtypes", dict(dtypes=["float16"]), ValueError, r"dtypes must each be 'float32' or 'bfloat16'"),
  ("report", "queries", dict(queries=0), ValueError, r"queries must be a positive integer"),
  ("report", "max_phase", dict(max_phase=nan), ValueError, r"max_phase must be in"),
  ("report", "target_error", dict(target_error=-1.0), ValueError, r"target_error must be"),
  ("report", "rotary_dim", dict(rotary_dim=3), ValueError, r"rotary_dim must be even"),
  ("report", "base", dict(base=0.5), ValueError, r"base must be > 1"),
]


@pytest.mark.parametrize(
  "entry,arg,kwargs,exc,match",
  EMULATION_ROWS,
  ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(EMULATION_ROWS)],
)
def test_emulation_entry_points_refuse_bad_arguments(entry, arg, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    EMULATION_ENTRY[entry](**kwargs)


def test_traced_slopes_are_refused_with_a_message():
  with pytest.raises(ValueError, match="slopes must be concrete"):
    jax.jit(lambda s: _rope(slopes=s))(jnp.asarray(SLOPES))
  spec = lambda s: _spec(slopes=s)  # noqa: E731
  with pytest.raises(ValueError, match="AlibiSpec.slopes must be concrete"):
    jax.jit(lambda s: _att("xla")(alibi_spec=spec(s)))(jnp.asarray(SLOPES))


def test_emulation_report_command_line_gives_one_line_and_status_2(capsys):
  with pytest.raises(SystemExit) as info:
    emulation_report.main(["--num-heads", "0", "--plot", ""])
  assert info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].endswith("num_heads must be a positive integer, got 0")
  assert not any("Traceback" in line for line in err)


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


def test_traced_scale_is_used_as_given_and_nan_gives_nan():
  # dot_product_attention takes a traced scale (folded into q); its value cannot be checked under jit.
  fn = jax.jit(lambda s: attention.dot_product_attention(Q, KK, V, scale=s))
  np.testing.assert_allclose(np.asarray(fn(jnp.float32(0.5))), np.asarray(_dpa(scale=0.5)), atol=1e-6)
  assert np.all(np.isnan(np.asarray(fn(jnp.float32(jnp.nan)))))
  with pytest.raises(TypeError, match="scale must be a float scalar"):
    jax.jit(lambda s: attention.dot_product_attention(Q, KK, V, scale=s))(jnp.ones(2, jnp.float32))
  with pytest.raises(TypeError, match="scale must be a concrete Python number"):
    jax.jit(lambda s: kernels.attention(Q, KK, V, scale=s))(jnp.float32(0.5))


def test_alibi_spec_slopes_of_zero_per_head_give_the_closed_form_bias_on_xla():
  # AlibiSpec.slopes may hold 0 (no ALiBi on that head): against the closed form -m (i - j) (the
  # fused kernels' exact form with slope 0 runs in kernels_test, alibi_heads=3 on splash).
  slopes = np.array([0.0, 0.5])
  mask = AttentionMask(causal=True)
  d = np.arange(8)[:, None] - np.arange(8)[None, :]
  bias = jnp.asarray(np.broadcast_to(-slopes[:, None, None] * d, (B, N, 8, 8)), jnp.float32)
  want = attention.dot_product_attention(Q, KK, V, scale=0.5, bias=bias, mask=mask.dense(B, 8))
  got = kernels.attention(
    Q, KK, V, scale=0.5, mask=mask, alibi_spec=_spec(slopes=slopes), implementation="xla"
  )
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_empty_sizes_give_empty_or_zero_results_on_every_backend():
  # S = 0 (no key): every row has no visible key, so zeros; B = 0 or T = 0: empty outputs.
  q = _rand(1, 4, N, H)
  no_keys = attention.dot_product_attention(q, _rand(1, 0, K, H), _rand(1, 0, K, H), scale=0.5)
  np.testing.assert_array_equal(np.asarray(no_keys), np.zeros((1, 4, N, H)))
  for impl in ("xla", *FUSED):
    for b, t in ((0, 4), (1, 0)):
      x = jnp.zeros((b, t, N, H)), jnp.zeros((b, t, K, H))
      out = kernels.attention(
        x[0], x[1], x[1], scale=0.5, mask=AttentionMask(), implementation=impl, interpret=True
      )
      assert out.shape == (b, t, N, H), impl
