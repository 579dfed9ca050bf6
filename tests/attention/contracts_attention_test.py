"""The attention surface's contract (docs/contracts.md, attention section), walked with hostile values.

1. A table of (entry point, argument, bad value, exception, message regex) over
   ``dot_product_attention``, ``kernels.attention`` on every backend (xla, splash and pallas_gpu in
   interpret mode) and ``emulated_alibi_attention``.
2. The documented results for values jit cannot check (traced scales), ALiBi slopes of 0, empty
   sizes.

The masks' contract (fully masked rows too) is in contracts_masks_test.py, the old names in
contracts_deprecated_test.py, the emulation's in tests/emulation/contracts_emulation_test.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import backends, emulated, kernels
from jaxpe.attention import reference as attention
from jaxpe.attention.masks import AttentionMask
from jaxpe.attention.rope_spec import RopeSpec

B, T, N, K, H = 2, 16, 2, 1, 8
FUSED = ("splash", "pallas_gpu", "flash")
EMULATING = ("splash", "pallas_gpu")


def _qkv(seed=0, t_len=T):
  rng = np.random.default_rng(seed)
  shapes = ((B, t_len, N, H), (B, t_len, K, H), (B, t_len, K, H))
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)


nan, inf = float("nan"), float("inf")
Q, KK, V = _qkv(3, t_len=8)
POS = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (B, 8))
SLOPES = np.array([0.5, 0.25])


def _dpa(**kw):
  args = dict(q=Q, k=KK, v=V, scale=0.5) | kw
  return attention.dot_product_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _spec(**kw):
  return backends.AlibiSpec(**(dict(slopes=SLOPES, q_positions=POS, k_positions=POS, max_position=8) | kw))


def _rope(**kw):
  fields = dict(inv_freq=np.full(H // 2, 0.1), q_positions=POS, k_positions=POS, layout="half")
  return RopeSpec(**(fields | kw))


def _att(impl):
  def call(**kw):
    args = dict(q=Q, k=KK, v=V, scale=0.5, implementation=impl, interpret=True) | kw
    return kernels.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)

  return call


def _rand(*shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(9).normal(size=shape), dtype)


EMUL_Q, EMUL_K = _rand(1, 8, 2, 4), _rand(1, 8, 1, 4)
EPOS = jnp.arange(8, dtype=jnp.int32)[None]


def _emul_attn(**kw):
  args = (
    dict(q=EMUL_Q, k=EMUL_K, v=EMUL_K, q_positions=EPOS, k_positions=EPOS, slopes=SLOPES, theta=0.01) | kw
  )
  return emulated.emulated_alibi_attention(
    args.pop("q"), args.pop("k"), args.pop("v"), args.pop("q_positions"), args.pop("k_positions"), **args
  )


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
  ("dpa", "is_causal", dict(is_causal=1), TypeError, r"is_causal must be a bool"),
  ("dpa", "is_causal", dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
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
    (
      _impl,
      "mask",
      dict(mask="causal"),
      TypeError,
      r"mask must be an AttentionMask, an IndexMask, a bool array",
    ),
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
      dict(implementation="triton"),
      ValueError,
      r"attention implementation must be one of",
    ),
    (_impl, "interpret", dict(interpret="yes"), TypeError, r"interpret must be a bool"),
    (_impl, "alibi_spec", dict(alibi_spec="alibi"), TypeError, r"alibi_spec must be an AlibiSpec"),
    (_impl, "rope_spec", dict(rope_spec="rope"), TypeError, r"rope_spec must be a RopeSpec"),
    (
      _impl,
      "rope_spec",
      dict(rope_spec=_rope(inv_freq=[1, 2])),
      TypeError,
      r"RopeSpec.inv_freq must be a float",
    ),
    (_impl, "rope_spec", dict(rope_spec=_rope(inv_freq=np.ones(5))), ValueError, r"R must be <= H"),
    (
      _impl,
      "rope_spec",
      dict(rope_spec=_rope(inv_freq=[nan])),
      ValueError,
      r"RopeSpec.inv_freq must be finite",
    ),
    (
      _impl,
      "rope_spec",
      dict(rope_spec=_rope(q_positions=POS[:1])),
      ValueError,
      r"RopeSpec.q_positions must",
    ),
    (
      _impl,
      "rope_spec",
      dict(rope_spec=_rope(k_positions=-POS)),
      ValueError,
      r"RopeSpec.k_positions must be",
    ),
    (
      _impl,
      "rope_spec",
      dict(rope_spec=_rope(k_positions=POS.astype(jnp.float32))),
      TypeError,
      r"RopeSpec.k_positions",
    ),
    (_impl, "rope_spec", dict(rope_spec=_rope(q_positions=POS[None])), ValueError, r"multi-axis \(mrope\)"),
    (_impl, "rope_spec", dict(rope_spec=_rope(layout=None)), ValueError, r"RopeSpec.layout must be one of"),
    (
      _impl,
      "rope_spec",
      dict(rope_spec=_rope(attention_factor=inf)),
      ValueError,
      r"RopeSpec.attention_factor",
    ),
    (_impl, "rope_spec", dict(rope_spec=_rope(xpos_gamma="0.4")), TypeError, r"RopeSpec.xpos_gamma"),
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
      r"AlibiSpec.form must be 'lean', 'exact' or",
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
  ]
for _impl in EMULATING:  # the ALiBi emulation's limits (flash runs ALiBi natively)
  ATTENTION_ROWS += [
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
    "implementation",
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
ATTENTION_ROWS += [
  (
    "emulated_alibi_attention",
    "theta",
    dict(theta=-1.0),  # theta=None is valid: planned for the positions' context (solver.default_theta)
    ValueError,
    r"theta must be a finite number > 0",
  ),
  ("emulated_alibi_attention", "is_causal", dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
  ("emulated_alibi_attention", "interpret", dict(interpret=1), TypeError, r"interpret must be a bool"),
  (
    "emulated_alibi_attention",
    "implementation",
    dict(implementation="triton"),
    ValueError,
    r"implementation must be one of",
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
]

ENTRY = {"dpa": _dpa, "emulated_alibi_attention": _emul_attn, **{i: _att(i) for i in ("xla", *FUSED)}}


@pytest.mark.parametrize(
  "entry,arg,kwargs,exc,match",
  ATTENTION_ROWS,
  ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(ATTENTION_ROWS)],
)
def test_attention_entry_points_refuse_bad_arguments(entry, arg, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    ENTRY[entry](**kwargs)


def test_traced_alibi_spec_slopes_are_refused_with_a_message():
  spec = lambda s: _spec(slopes=s)  # noqa: E731
  with pytest.raises(ValueError, match="AlibiSpec.slopes must be concrete"):
    jax.jit(lambda s: _att("xla")(alibi_spec=spec(s)))(jnp.asarray(SLOPES))


# ------------------------------------------------------------------------------------ traced values


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


def test_pytorch_layout_inputs_are_named():
  """Issue 48 (a newcomer's walk): q, k, v in PyTorch's [B, N, T, H] layout
  (scaled_dot_product_attention's) fed to dot_product_attention / kernels.attention. Where a mask, a
  bias, GQA or the AttentionMask's fields fix T and N, the size error says the layout and the
  transpose; the swapped shapes are checked to fit (no hint for a plain size error)."""
  b, t, n, kv, h = 2, 5, 4, 2, 8
  q, k = jnp.ones((b, n, t, h)), jnp.ones((b, kv, t, h))
  layout = r"q, k, v look like PyTorch's \[B, N, T, H\] layout .*: jaxpe takes \[B, T, N, H\] \(jax\.nn's\); pass q\.transpose\(0, 2, 1, 3\)"
  for kw in (dict(mask=jnp.ones((b, 1, t, t), bool)), dict(bias=jnp.zeros((b, n, t, t)))):
    with pytest.raises(ValueError, match="must broadcast to .*; " + layout):
      attention.dot_product_attention(q, k, k, **kw)
  mask = AttentionMask(valid=jnp.ones((b, t), bool))
  with pytest.raises(ValueError, match="an AttentionMask is for self-attention .*; " + layout):
    kernels.attention(q, k, k, scale=0.3, mask=mask, implementation="xla")
  # The same call in jaxpe's layout runs; a size error that no layout explains gets no hint.
  out = attention.dot_product_attention(
    q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
  )
  assert out.shape == (b, t, n, h)
  with pytest.raises(ValueError, match=r"must broadcast") as refused:
    attention.dot_product_attention(
      q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), mask=jnp.ones((3, 3), bool)
    )
  assert "PyTorch" not in str(refused.value)
