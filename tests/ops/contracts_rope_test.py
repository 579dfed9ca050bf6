"""Hostile inputs against the RoPE ops' contracts (docs/contracts.md, section "Ops"): apply_rope,
rope_inv_freq, rope_phases, rope_cos_sin, xPos. Scaling and HF configs: contracts_rope_scaling_test.py;
layouts, positions, ALiBi, sinusoids: contracts_ops_test.py.

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
  apply_rope,
  apply_xpos,
  rope_cos_sin,
  rope_from_hf_config,
  rope_inv_freq,
  rope_phases,
  sinusoidal_embedding,
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
  (
    "rope-attention-factor-nan",
    lambda: rope(X(), P(), attention_factor=NAN),
    ValueError,
    "attention_factor must be finite",
  ),
  (
    "rope-attention-factor-str",
    lambda: rope(X(), P(), attention_factor="2"),
    TypeError,
    "attention_factor must be a float",
  ),
  (
    "rope-attention-factor-complex",
    lambda: rope(X(), P(), attention_factor=1j),
    TypeError,
    "attention_factor must be a float",
  ),
  (
    "rope-attention-factor-shape",
    lambda: rope(X(), P(), attention_factor=jnp.ones((2, 3, 2, 5))),
    ValueError,
    "attention_factor must broadcast",
  ),
  (
    "rope-attention-factor-nan-arr",
    lambda: rope(X(), P(), attention_factor=jnp.full((1, 1, 1, 4), NAN)),
    ValueError,
    "attention_factor must be finite",
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


XR = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 8), np.float32))
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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_low_precision_x_is_rotated_in_float32_and_cast_back(dtype):
  x = XR.astype(dtype)
  p = jnp.asarray([[0, 1, 2**20, 2**31 - 1, 17]], I32)
  out = apply_rope(x, p, inv_freq=INV, layout="interleaved")
  assert out.dtype == dtype
  ref = _rope_f64(x.astype(F32), p, INV)
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=float(jnp.finfo(dtype).eps) * 4)


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


def test_apply_rope_scale_is_the_deprecated_spelling_of_attention_factor():
  """Issue 48 "one idea, two names": apply_rope(scale=) is RopeSpec's / HFRope's attention_factor (HF:
  attention_scaling). The old spelling still works, with a DeprecationWarning that says what it is not
  (position interpolation: gemma's scale_factor passed as scale=8.0 ran without a word, 24.7 off);
  apply_rope_alibi's content_scale alike. The reference: the pairs rotated by hand in numpy float64."""
  import warnings

  from jaxpe.emulation import apply_rope_alibi

  x, p = np.asarray(X(), np.float64), np.asarray(P())
  inv = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)
  phase = p[:, :, None, None] * inv  # [B, T, 1, 4]
  z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * phase) * 1.5
  want = np.stack([z.real, z.imag], -1).reshape(x.shape)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the new name warns nothing
    new = rope(X(), P(), attention_factor=1.5)
  np.testing.assert_allclose(np.asarray(new, np.float64), want, rtol=2e-6, atol=2e-6)
  with pytest.warns(DeprecationWarning) as caught:
    old = rope(X(), P(), scale=1.5)
  message = str(caught[0].message)
  assert message.startswith("apply_rope(scale=) is deprecated: use attention_factor= (the same value).")
  assert "it is NOT position interpolation (gemma's scale_factor" in message and "/ factor" in message
  np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
  with pytest.raises(TypeError, match=r"apply_rope: give attention_factor= only \(scale= is its deprecated"):
    rope(X(), P(), scale=1.5, attention_factor=1.5)

  q, k = X(n=2), X(n=2)
  kw = dict(
    slopes=[0.5, 0.25],
    theta=0.01,
    content_inv_freq=jnp.asarray(inv, jnp.float32),
    content_layout="interleaved",
  )
  new = apply_rope_alibi(q, k, P(), P(), content_attention_factor=1.5, **kw)
  with pytest.warns(
    DeprecationWarning,
    match=r"apply_rope_alibi\(content_scale=\) is deprecated: use content_attention_factor=",
  ):
    old = apply_rope_alibi(q, k, P(), P(), content_scale=1.5, **kw)
  for a, b in zip(old, new):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(np.asarray(new[0][..., :8], np.float64), want, rtol=2e-6, atol=2e-6)
  with pytest.raises(TypeError, match="give content_attention_factor= only"):
    apply_rope_alibi(q, k, P(), P(), content_scale=1.5, content_attention_factor=1.5, **kw)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_frequencies_narrower_than_float32_are_refused_naming_the_phase_error(dtype):
  """Issue 48: a bfloat16 inv_freq rotated silently; its rounding (2^-9 of each frequency) times the
  position is the phase error (here checked against float64: 1000 x that bound is reached)."""
  inv = np.asarray(1.0 / 10000 ** (np.arange(0, 8, 2) / 8))
  narrow = jnp.asarray(inv, dtype)
  err = np.max(np.abs(np.asarray(narrow, np.float64) - inv) / inv)
  assert err > 2.0 ** -(jnp.finfo(dtype).nmant + 4)  # the rounding the message speaks of is real
  name = jnp.dtype(dtype).name
  message = rf"inv_freq must be float32 or float64, got {name}: .* pass the frequencies as float32"
  for call in (
    lambda: rope(X(), P(), inv_freq=narrow),
    lambda: rope_cos_sin(P(), narrow),
    lambda: apply_xpos(X(), P(), kind="query", layout="interleaved", inv_freq=narrow),
  ):
    with pytest.raises(TypeError, match=message):
      call()
  from jaxpe.attention.rope_spec import RopeSpec, check_rope_spec

  spec = RopeSpec(inv_freq=narrow, q_positions=P(), k_positions=P(), layout="interleaved")
  with pytest.raises(TypeError, match=rf"RopeSpec\.inv_freq must be float32 or float64, got {name}"):
    check_rope_spec(spec, 2, 3, 3, 8)
  rope(X(), P(), inv_freq=jnp.asarray(inv, jnp.float32))  # float32 and float64 rotate
  rope(X(), P(), inv_freq=inv)


def test_base_with_inv_freq_is_refused():
  """Issue 48: base= was ignored without a word when inv_freq= was given."""
  inv = 1.0 / 500.0 ** (np.arange(0, 8, 2) / 8)
  for call in (
    lambda: rope(X(), P(), inv_freq=inv, base=500.0),
    lambda: apply_xpos(X(), P(), kind="query", layout="interleaved", inv_freq=inv, base=500.0),
  ):
    with pytest.raises(ValueError, match=r"give base= or inv_freq=, not both \(got base=500\.0\)"):
      call()
  # base alone builds the frequencies it names; the default is 10000.
  np.testing.assert_array_equal(
    np.asarray(rope(X(), P(), base=500.0)), np.asarray(rope(X(), P(), inv_freq=inv))
  )
  default = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
  np.testing.assert_array_equal(np.asarray(rope(X(), P())), np.asarray(rope(X(), P(), inv_freq=default)))
