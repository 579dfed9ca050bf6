"""Attention backends (jaxpe.kernels): the Pallas kernels in interpret mode against the xla path,
errors, and the precision of the emulation term on xla."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.attention import backends, blockwise, kernels, masks
from jaxpe.attention import reference as attention
from jaxpe.emulation import bf16_exact
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.ops import alibi

B, T, N, K, H = 2, 256, 4, 2, 64
PAD = 37  # left padding of batch row 1


def _tokens_and_masks():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32)
  valid = jnp.asarray(np.arange(T)[None, :] >= np.array([[0], [PAD]]))
  # row 0: three packed documents; row 1: one document after left padding
  segments = jnp.asarray(np.stack([np.repeat([0, 1, 2], [100, 60, 96]), np.zeros(T, int)]), jnp.int32)
  return tokens, valid, segments


# Each kernel sees every attention-level form: plain q.k (none/learned/sinusoidal/rope/xpos), native
# ALiBi through the exact and the rotated emulation, and rope_alibi's float32 emulation dims.
MODEL_CASES = [
  ("pallas_gpu", dict(pos_encoding="none")),
  ("pallas_gpu", dict(pos_encoding="sinusoidal")),
  ("pallas_gpu", dict(pos_encoding="rope", rope_scaling=dict(rope_type="linear", factor=2.0))),
  ("pallas_gpu", dict(pos_encoding="alibi", alibi_emulation="exact")),
  ("pallas_gpu", dict(pos_encoding="alibi", alibi_emulation="rotated", rope_alibi_order=3)),
  ("pallas_gpu", dict(pos_encoding="rope_alibi", rope_alibi_order=2)),
  ("splash", dict(pos_encoding="learned")),
  ("splash", dict(pos_encoding="xpos")),
  ("splash", dict(pos_encoding="alibi", alibi_emulation="exact", alibi_heads=3)),
  ("splash", dict(pos_encoding="alibi", alibi_emulation="rotated", rope_alibi_order=3)),
  ("splash", dict(pos_encoding="rope_alibi", rope_alibi_order=1)),
  # flash: RoPE / xPos rotated inside the kernel (RopeSpec), ALiBi native in the kernel
  ("flash", dict(pos_encoding="rope", rope_scaling=dict(rope_type="yarn", factor=2.0), rotary_dim=32)),
  ("flash", dict(pos_encoding="xpos")),
  ("flash", dict(pos_encoding="alibi")),  # native ALiBi in the kernel
  ("flash", dict(pos_encoding="rope", attention_sinks=True)),  # sinks in the kernel's online softmax
]


@pytest.mark.parametrize(
  "impl,extra", MODEL_CASES, ids=[f"{i}-{e['pos_encoding']}-{len(e)}" for i, e in MODEL_CASES]
)
def test_decoder_on_pallas_kernel_matches_xla(impl, extra):
  # B 2, T 256, N 4, K 2, H 64; causal, packed segments (row 0) and left padding (row 1).
  base = dict(vocab_size=64, d_model=N * H, num_layers=1, num_heads=N, num_kv_heads=K, max_len=T, **extra)
  ref_model = Decoder(ModelConfig(**base), rngs=nnx.Rngs(0))
  model = Decoder(ModelConfig(**base, attn_implementation=impl, attention_interpret=True), rngs=nnx.Rngs(0))
  tokens, valid, segments = _tokens_and_masks()

  def run(m):
    return nnx.jit(lambda m, t, v, s: m(t, attention_mask=v, segment_ids=s))(m, tokens, valid, segments)

  ref, out = run(ref_model), run(model)
  ok = np.asarray(valid)
  # exact (up to float32 reordering) for every form; the rotated ALiBi at order 3 and phase
  # 0.1 deviates ~1e-9 relative from native ALiBi (emulation bound), far below the tolerance.
  np.testing.assert_allclose(np.asarray(out)[ok], np.asarray(ref)[ok], atol=2e-4, rtol=0)


def test_rotated_alibi_on_kernel_matches_its_closed_form():
  # The rotated form against xla with the closed-form bias -(m/theta) sum_r w_r sin(r d theta)
  # (float64): the kernel path adds no error beyond the emulation's truncation.
  rng = np.random.default_rng(1)
  q, k, v = (
    jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, 128, N, H), (1, 128, K, H), (1, 128, K, H))
  )
  pos = jnp.arange(128, dtype=jnp.int32)[None]
  slopes, order, theta = alibi.alibi_slopes_f64(N), 2, 0.5 / 128
  spec = backends.AlibiSpec(slopes, pos, pos, max_position=128, form="rotated", order=order, theta=theta)
  mask = masks.AttentionMask(causal=True)
  out = kernels.attention(
    q, k, v, scale=H**-0.5, mask=mask, alibi_spec=spec, implementation="pallas_gpu", interpret=True
  )
  d = np.arange(128)[:, None] - np.arange(128)[None, :]
  w = np.asarray([4 / 3, -1 / 6])
  bias = -(slopes[:, None, None] / theta) * sum(w[r] * np.sin((r + 1) * d * theta) for r in range(order))
  ref = attention.dot_product_attention(
    q, k, v, scale=H**-0.5, bias=jnp.asarray(bias[None], jnp.float32), mask=mask.dense(1, 128)
  )
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=0)


def test_unavailable_backend_names_the_available_ones():
  x = jnp.zeros((1, 128, 2, 8))
  with pytest.raises(ValueError, match=r"not available.*available: \('xla',\).*interpret=True"):
    kernels.attention(x, x, x, scale=1.0, implementation="splash")
  with pytest.raises(ValueError, match="'cudnn' is not available"):
    kernels.attention(x, x, x, scale=1.0, implementation="cudnn", interpret=True)
  with pytest.raises(ValueError, match="must be one of"):
    kernels.attention(x, x, x, scale=1.0, implementation="triton")
  assert backends.resolve_backend("auto") == "xla"  # on CPU


def test_native_bias_on_a_bias_free_kernel_says_to_use_the_emulation():
  x = jnp.zeros((1, 128, 2, 8))
  with pytest.raises(ValueError, match="takes no bias.*alibi_spec.*emulated"):
    kernels.attention(
      x, x, x, scale=1.0, bias=jnp.zeros((1, 2, 128, 128)), implementation="pallas_gpu", interpret=True
    )
  with pytest.raises(ValueError, match="AttentionMask"):
    kernels.attention(
      x, x, x, scale=1.0, mask=jnp.ones((1, 1, 128, 128), bool), implementation="splash", interpret=True
    )


def _dot_general_eqns(jaxpr) -> list:
  """Every ``dot_general`` equation of ``jaxpr``, inner jaxprs (custom_vjp, cond, loops) included."""
  dots = []
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      dots.append(e)
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      dots += _dot_general_eqns(sub)
  return dots


_ENTRY_POINTS = {
  "dot_product_attention": lambda q, k, v, **kw: attention.dot_product_attention(q, k, v, scale=1.0, **kw),
  "blockwise_attention": lambda q, k, v, **kw: blockwise.blockwise_attention(
    q, k, v, scale=1.0, mask=masks.AttentionMask(causal=True), **kw
  ),
  "kernels.attention": lambda q, k, v, **kw: kernels.attention(
    q, k, v, scale=1.0, mask=masks.AttentionMask(causal=True), implementation="xla", **kw
  ),
}


@pytest.mark.parametrize("given", [{"precise_dims": 2}, {}], ids=["precise_dims=2", "default"])
@pytest.mark.parametrize("entry", list(_ENTRY_POINTS))
def test_emulation_dims_are_contracted_at_highest_precision_on_xla(entry, given, monkeypatch):
  # CPU ignores jax.default_matmul_precision, so check what the jaxpr asks for: under a bf16 default
  # every dot over the emulation dims (the q.k logits, and dq, dk in the backward pass) is a float32
  # dot with precision HIGHEST, the content dots are not. By default (precise_dims=None) the dims
  # q/k carry beyond v's width are the precise ones, so a raw-ops user who forgets the argument
  # still gets them at HIGHEST.
  # the XLA loops (the fused CPU kernel, which blockwise takes where it applies, has no jaxpr dots: it
  # contracts every dim in float32; tests/attention/cpu_flash_test.py checks its emulation dims)
  monkeypatch.setattr(blockwise, "_cpu_kernel_applies", lambda *a: False)
  q = jnp.zeros((1, 8, 2, 8), jnp.float32)  # H = 6 content dims + 2 emulation dims

  def loss(q, k):
    return _ENTRY_POINTS[entry](q, k, q[..., :6], **given).sum()

  with jax.default_matmul_precision("bfloat16"):
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, q)
  dots = _dot_general_eqns(jaxpr.jaxpr)
  # an operand whose last dim is 2 holds emulation dims (T = S = 8 and H = 6 are other sizes)
  emul = [e for e in dots if any(v.aval.shape[-1] == 2 for v in e.invars)]
  content = [e for e in dots if e not in emul]
  highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
  assert len(emul) >= 3 and content  # forward logits, dq, dk
  for e in emul:
    assert e.params["precision"] == highest
    assert all(v.aval.dtype == jnp.float32 for v in e.invars)
    assert e.params["preferred_element_type"] == jnp.float32
  assert all(e.params["precision"] != highest for e in content)


def test_precise_dims_zero_opts_out_of_highest_precision():
  q = jnp.zeros((1, 8, 2, 8), jnp.float32)
  fn = lambda q: attention.dot_product_attention(q, q, q[..., :6], scale=1.0, precise_dims=0)  # noqa: E731
  with jax.default_matmul_precision("bfloat16"):
    jaxpr = jax.make_jaxpr(fn)(q)
  highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
  dots = _dot_general_eqns(jaxpr.jaxpr)
  assert dots and all(e.params["precision"] != highest for e in dots)


def test_row_with_minus_inf_bias_gives_zeros_like_a_masked_row():
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 3, 1, 4)), jnp.float32) for _ in range(3))
  bias = np.zeros((1, 1, 3, 3), np.float32)
  bias[0, 0, 1, :] = -np.inf  # row 1: no key visible
  bias[0, 0, 2, 0] = -np.inf  # row 2: key 0 hidden
  out = np.asarray(attention.dot_product_attention(q, k, v, scale=0.5, bias=jnp.asarray(bias)))
  mask = jnp.asarray(np.isfinite(bias))
  masked = np.asarray(attention.dot_product_attention(q, k, v, scale=0.5, mask=mask))
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[:, 1], 0.0)
  np.testing.assert_allclose(out, masked, atol=1e-6)


def test_exact_alibi_dims_are_bf16_exact_with_exact_float32_products():
  pos_q = jnp.asarray([[0, 5, 255, 256, 1000, 65535]], jnp.int32)
  pos_k = jnp.asarray([[0, 3, 100, 65535, 7, 65534, 40000]], jnp.int32)
  slopes = alibi.alibi_slopes_f64(16)
  q_e, k_e = bf16_exact.exact_alibi_dims(
    pos_q, pos_k, slopes=slopes, dot_scale=1 / 8, max_position=65536, num_kv_heads=1
  )
  q_e, k_e = np.asarray(q_e, np.float64)[0], np.asarray(k_e, np.float64)[0, :, 0]
  assert q_e.shape[-1] == bf16_exact.exact_alibi_dim_count(65536) == 18
  for x in (q_e, k_e):
    np.testing.assert_array_equal(x.astype(jnp.bfloat16).astype(np.float64), x)
  prods = q_e[:, None, :, :] * k_e[None, :, None, :]  # [T, S, N, E]
  np.testing.assert_array_equal(prods.astype(np.float32).astype(np.float64), prods)
  # exact sum (float64 here) = -m (i - j) up to the 3-part slope split (~2^-26 relative)
  ref = -slopes[None, None, :] * (np.asarray(pos_q)[0][:, None, None] - np.asarray(pos_k)[0][None, :, None])
  np.testing.assert_allclose(prods.sum(-1) / 8, ref, rtol=2**-24, atol=1e-9)
  assert math.isclose(float(np.max(np.abs(ref))), float(slopes[0]) * 65535)


# ------------------------------------------------------------------ precision under a hardware model

CONTEXTS = (2048, 8192, 65536)
FORMS = (("exact", 1), ("rotated", 1), ("rotated", 2), ("rotated", 3))


def _positions(ctx):
  q = np.array([ctx // 2, ctx - 1])
  k = np.unique(
    np.concatenate(
      [np.arange(0, ctx, ctx // 256), np.arange(ctx - 32, ctx), np.arange(ctx // 2 - 32, ctx // 2)]
    )
  )
  return q, k


def _deviations(form, order, ctx, representation, fmts):
  """``{fmt: [N]}`` max |emulated - float64 ALiBi| (logits) over sampled (i, j <= i), 16 heads, H 64."""
  slopes = alibi.alibi_slopes_f64(16)
  qpos, kpos = _positions(ctx)
  q, k = bf16_exact.alibi_term_dims(
    form, qpos, kpos, slopes=slopes, head_dim=64, max_len=ctx, order=order, representation=representation
  )
  ref = -slopes[None, None, :] * (qpos[:, None, None] - kpos[None, :, None])
  visible = (kpos[None, :] <= qpos[:, None])[:, :, None]
  out = {}
  for fmt in fmts:
    scores = bf16_exact.float32_accumulated_dot(q, k, fmt).astype(np.float64) / 8.0  # 1/sqrt(64) exact
    out[fmt] = np.where(visible, np.abs(scores - ref), 0.0).max(axis=(0, 1))
  return out


def test_rounding_model_reads_bf16_and_tf32_like_the_hardware():
  x = np.random.default_rng(3).normal(size=10000) * 1e5
  np.testing.assert_array_equal(
    bf16_exact.round_mantissa(x, "bfloat16"), x.astype(jnp.bfloat16).astype(np.float64)
  )
  np.testing.assert_array_equal(
    bf16_exact.round_mantissa(x, "float32"), x.astype(np.float32).astype(np.float64)
  )
  tf32 = bf16_exact.round_mantissa(x, "tf32")
  assert np.all(np.abs(tf32 - x) <= np.abs(x) * 2.0**-11) and not np.array_equal(tf32, x.astype(np.float32))


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_bf16_exact_emulation_meets_the_goal_and_float32_dims_do_not(ctx):
  # bf16 (and TF32) inputs, float32 accumulation: the exact augmented form within 1e-2 logits of
  # ALiBi; each rotated form within 2x of its own float32 deviation. Today's float32 dims read the
  # same way miss both goals (so this test can fail).
  for form, order in FORMS:
    plain = _deviations(form, order, ctx, "float32", ("float32", "bfloat16", "tf32"))
    exact = _deviations(form, order, ctx, "bf16_exact", ("bfloat16", "tf32"))
    f32 = plain["float32"]
    for fmt in ("bfloat16", "tf32"):
      split, rounded = exact[fmt], plain[fmt]
      if form == "exact":
        assert split.max() <= 1e-2, (ctx, fmt, split.max())
        assert rounded.max() > 1e-2, (ctx, fmt, rounded.max())
      else:
        assert np.all(split <= 2 * f32), (ctx, order, fmt, split / f32)
        if (
          fmt == "bfloat16" or order >= 2
        ):  # k = 1 is truncation-limited (2.4 logits at 2048): TF32 hides in it
          assert np.any(rounded > 2 * f32), (ctx, order, fmt, rounded / f32)


def test_gradients_through_a_kernel_match_xla():
  # Training runs through the kernels' backward passes; ALiBi via the exact emulation, left padding.
  rng = np.random.default_rng(4)
  q, k, v = (
    jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, 128, 2, H), (1, 128, 1, H), (1, 128, 1, H))
  )
  pos = jnp.arange(128, dtype=jnp.int32)[None]
  mask = masks.AttentionMask(valid=jnp.asarray(np.arange(128)[None] >= 5), causal=True)
  spec = backends.AlibiSpec(alibi.alibi_slopes_f64(2), pos, pos, max_position=128)

  def grads(impl):
    def loss(q, k, v):
      out = kernels.attention(
        q, k, v, scale=H**-0.5, mask=mask, alibi_spec=spec, implementation=impl, interpret=True
      )
      return jnp.sum(out**2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  for got, want in zip(grads("splash"), grads("xla")):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5, rtol=0)


def test_config_keys_refuse_what_cannot_run():
  with pytest.raises(ValueError, match="attn_implementation"):
    ModelConfig(attn_implementation="triton")
  with pytest.raises(ValueError, match="alibi_emulation='rotated' needs ALiBi on every head"):
    ModelConfig(pos_encoding="alibi", alibi_heads=2, alibi_emulation="rotated")
  model = Decoder(
    ModelConfig(vocab_size=16, d_model=32, num_layers=1, attn_implementation="splash"), rngs=nnx.Rngs(0)
  )
  with pytest.raises(ValueError, match="'splash' is not available.*available: \\('xla',\\)"):
    model(jnp.zeros((1, 128), jnp.int32))


def test_cached_decoding_runs_on_xla_and_matches_the_kernel_forward():
  from jaxpe.model.cache import init_cache

  cfg = ModelConfig(
    vocab_size=32,
    d_model=64,
    num_layers=1,
    num_heads=2,
    max_len=16,
    pos_encoding="alibi",
    attn_implementation="pallas_gpu",
    attention_interpret=True,
  )
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 32, (1, 16)), jnp.int32)
  full = model(tokens)  # pallas_gpu, exact ALiBi emulation
  logits, cache = model(
    tokens[:, :14], cache=init_cache(cfg, 1, 16)
  )  # prefill of an empty cache on pallas_gpu; decode steps on xla, native bias
  steps = [logits]
  for t in range(14, 16):
    logits, cache = model(tokens[:, t : t + 1], cache=cache)
    steps.append(logits)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl,t_len,causal", [("splash", 100, False), ("pallas_gpu", 200, True)])
def test_sequence_length_off_the_kernel_block_is_padded(impl, t_len, causal):
  # T < block and T > 128 not a multiple of 128 (T = 1 is the same case): the kernels pad T to
  # their block (padded keys hidden by their own segment id) instead of refusing the length.
  rng = np.random.default_rng(6)
  q, k, v = (
    jnp.asarray(rng.normal(size=s), jnp.float32)
    for s in ((1, t_len, 2, 8), (1, t_len, 1, 8), (1, t_len, 1, 8))
  )
  pos = jnp.arange(t_len, dtype=jnp.int32)[None]
  spec = backends.AlibiSpec(alibi.alibi_slopes_f64(2), pos, pos, max_position=65536)
  mask = masks.AttentionMask(causal=causal)
  kw = dict(scale=8**-0.5, mask=mask, alibi_spec=spec)
  out = kernels.attention(q, k, v, implementation=impl, interpret=True, **kw)
  want = kernels.attention(q, k, v, implementation="xla", **kw)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=0)


def test_cudnn_gets_no_query_row_without_a_visible_key(monkeypatch):
  # cuDNN's flash attention gives NaN (and NaN gradients) for a query row with every key masked.
  # With left padding and causality, the padding queries before the first real token see no real
  # key: like the Pallas kernels' segment ids, padding tokens must see each other. A GPU is modelled:
  # cudnn reported available, jax.nn.dot_product_attention checks its mask, then computes on xla.
  real = jax.nn.dot_product_attention
  rows = []

  def fake_cudnn(q, k, v, *, mask=None, scale=None, is_causal=False, implementation=None):
    assert implementation == "cudnn" and q.dtype == jnp.bfloat16
    t_len = q.shape[1]
    full = jnp.ones((1, 1, t_len, t_len), bool) if mask is None else mask
    if is_causal:
      full = full & jnp.tril(jnp.ones((t_len, t_len), bool))[None, None]
    rows.append(np.asarray(full).any(-1))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return real(f32(q), f32(k), f32(v), mask=mask, scale=scale, is_causal=is_causal).astype(q.dtype)

  monkeypatch.setattr(backends, "platform_backends", lambda platform=None: ("xla", "cudnn", "pallas_gpu"))
  monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 12, 2, 8)), jnp.float32) for _ in range(3))
  valid = jnp.asarray(np.arange(12)[None] >= np.array([[0], [5]]))  # row 1: 5 left-padding tokens
  segments = jnp.asarray(np.repeat([[4, 1, 4]], 4, axis=1), jnp.int32).repeat(2, axis=0)
  for mask in (
    masks.AttentionMask(valid=valid, causal=True),
    masks.AttentionMask(valid=valid, segment_ids=segments, causal=True),
  ):
    out = kernels.attention(q, k, v, scale=8**-0.5, mask=mask, implementation="cudnn")
    assert np.all(rows[-1]), "a query row with no visible key reached cuDNN"
    want = kernels.attention(q, k, v, scale=8**-0.5, mask=mask, implementation="xla")
    ok = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(out)[ok], np.asarray(want)[ok], atol=3e-2, rtol=0)


def _second_derivative(impl, *, interpret=False):
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 16)), jnp.float32) for _ in range(3))
  mask = masks.AttentionMask(causal=True)

  def f(q, k):
    return (
      kernels.attention(q, k, v, scale=0.25, mask=mask, implementation=impl, interpret=interpret) ** 2
    ).sum()

  def g(q, k):
    gq, gk = jax.grad(f, argnums=(0, 1))(q, k)
    return (gq * jnp.cos(gk)).sum()

  return jax.jit(jax.grad(g, argnums=(0, 1)))(q, k), jax.jit(jax.grad(f))(q, k)


def test_auto_differentiates_twice_where_its_backend_does():
  # Issue 48, kind 6b: jax differentiates every platform's branch of implementation="auto" (flash on
  # GPUs, splash and flash on TPUs), and a kernel's backward pass cannot be differentiated: a second
  # derivative on the CPU failed inside jax. The kernels' branches now differentiate once, their second
  # derivative refused only where they are lowered; the CPU's branch (xla) gives xla's second derivative.
  (auto_gq, auto_gk), auto_g = _second_derivative("auto")
  (ref_gq, ref_gk), ref_g = _second_derivative("xla")
  for got, want in ((auto_gq, ref_gq), (auto_gk, ref_gk), (auto_g, ref_g)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(jnp.abs(ref_gq).max()) > 0


def test_a_kernels_second_derivative_is_refused_naming_the_fix_and_its_first_is_the_kernels():
  with pytest.raises(
    ValueError, match=r"attention implementation 'flash' differentiates once: .*implementation='xla'"
  ):
    _second_derivative("flash", interpret=True)
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 16)), jnp.float32) for _ in range(3))

  def first(impl):
    return jax.jit(
      jax.grad(
        lambda q: kernels.attention(q, k, v, scale=0.25, implementation=impl, interpret=impl != "xla").sum()
      )
    )(q)

  np.testing.assert_allclose(np.asarray(first("flash")), np.asarray(first("xla")), rtol=0, atol=2e-5)
