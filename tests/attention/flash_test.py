"""The ``flash`` backend (jaxpe's Pallas kernel, interpret mode) against a dense float32 reference
written here from the formulas (RoFormer's rotation, xPos's decay, ALiBi's bias), forward and
gradients; ``RopeSpec`` on the other backends; bad inputs."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import AlibiSpec, AttentionMask, RopeSpec, attention, flash
from jaxpe.emulation.ops import apply_rope_alibi
from jaxpe.ops.rope_scaling import rope_frequencies

B, T, N, K, H = 2, 13, 4, 2, 8  # T 13: padded to 16 = two blocks of 8 (the tests' block size)
PAD = 3  # left padding of batch row 1
SCALE = 0.35
TOL = 2e-4
HI = jax.lax.Precision.HIGHEST


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
  monkeypatch.setattr(flash, "MAX_BLOCK", 8)  # several q and k blocks at a small T


@pytest.fixture(params=flash.TARGETS)
def target(request, monkeypatch):
  """Each kernel family in interpret mode: ``attention(implementation="flash", interpret=True)`` calls
  ``flash.attend`` with ``target="gpu"`` (the Triton kernels); "tpu" runs the Mosaic kernels
  (flash_tpu: blocked over k/v, VMEM scratch) through the same public path. The target is forced
  over the caller's keyword (a ``functools.partial`` default was overridden by it: the "tpu" cases
  ran the Triton kernels)."""
  if request.param != "gpu":
    attend = flash.attend

    def forced(*args, **kwargs):
      return attend(*args, **{**kwargs, "target": request.param})

    monkeypatch.setattr(flash, "attend", forced)
  return request.param


def _data(seed=0, qk_extra=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H + qk_extra)).astype(np.float32)
  k = rng.normal(size=(B, T, K, H + qk_extra)).astype(np.float32)
  v = rng.normal(size=(B, T, K, H)).astype(np.float32)
  ct = rng.normal(size=(B, T, N, H)).astype(np.float32)
  return q, k, v, ct


def _mask(causal):
  valid = np.arange(T)[None, :] >= np.array([[0], [PAD]])
  segments = np.stack([np.repeat([5, 9], [6, T - 6]), np.zeros(T, int)]).astype(np.int32)
  return AttentionMask(valid=jnp.asarray(valid), segment_ids=jnp.asarray(segments), causal=causal)


def _positions():
  # row 0: two packed documents, each from 0; row 1: positions counted after the left padding
  row0 = np.concatenate([np.arange(6), np.arange(T - 6)])
  row1 = np.maximum(np.arange(T) - PAD, 0)
  return jnp.asarray(np.stack([row0, row1]), jnp.int32)


# ---------------------------------------------------------------- the reference, from the formulas


def _rotate_ref(x, pos, inv_freq, layout, factor, amp=None):
  """RoFormer (arXiv 2104.09864) eq. 34 on the first R dims: pairs (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
  half = inv_freq.shape[0]
  freq = jnp.asarray(inv_freq, jnp.float32).reshape(1, 1, 1, half)
  phase = pos.astype(jnp.float32)[:, :, None, None] * freq  # [B, T, 1, R/2]
  c, s = jnp.cos(phase) * factor, jnp.sin(phase) * factor
  if amp is not None:
    c, s = c * amp, s * amp
  if layout == "half":
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rot = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
  else:
    x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    rot = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(*x.shape[:-1], 2 * half)
  return jnp.concatenate([rot, x[..., 2 * half :]], -1)


def _xpos_amp(pos, half, sign, scale_base, gamma, offset):
  """xPos (arXiv 2212.10554) eq. 5: zeta_i ** (+-(p - offset) / scale_base), zeta_i = (2i/R + gamma)/(1 + gamma)."""
  zeta = (np.arange(half) * 2 / (2 * half) + gamma) / (1 + gamma)
  expo = (pos.astype(jnp.float32) - offset)[:, :, None, None] * (sign / scale_base)
  return jnp.exp(expo * jnp.asarray(np.log(zeta), jnp.float32).reshape(1, 1, 1, half))


def _reference(q, k, v, mask, *, rope=None, alibi=None, xpos=None):
  """Dense softmax attention in float32 at HIGHEST; rows of padding queries are zeros."""
  if rope is not None:
    inv_freq, qpos, kpos, layout, factor = rope
    half = inv_freq.shape[0]
    amp_q = amp_k = None
    if xpos is not None:
      amp_q = _xpos_amp(qpos, half, 1.0, *xpos)
      amp_k = _xpos_amp(kpos, half, -1.0, *xpos)
    q = jnp.concatenate([_rotate_ref(q[..., :H], qpos, inv_freq, layout, factor, amp_q), q[..., H:]], -1)
    k = jnp.concatenate([_rotate_ref(k[..., :H], kpos, inv_freq, layout, factor, amp_k), k[..., H:]], -1)
  k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=HI) * SCALE
  if alibi is not None:
    slopes, qpos, kpos = alibi
    dist = (qpos[:, :, None] - kpos[:, None, :]).astype(jnp.float32)
    s = s - jnp.asarray(slopes, jnp.float32)[None, :, None, None] * dist[:, None]
  ok = jnp.asarray(mask.valid)[:, None, None, :]
  ok = ok & (mask.segment_ids[:, :, None] == mask.segment_ids[:, None, :])[:, None]
  if mask.causal:
    ok = ok & jnp.tril(jnp.ones((T, T), bool))[None, None]
  s = jnp.where(ok, s, -1e30)
  out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v, precision=HI)
  return jnp.where(jnp.asarray(mask.valid)[:, :, None, None], out, 0.0)


def _value_and_grads(fn, q, k, v, ct, *consts):
  """``fn(q, k, v, *consts)`` and the gradients of ``sum(out * ct)`` in q, k, v; the constants are
  jit arguments, so cases that differ only in their values share one compilation."""

  def loss(q, k, v, *consts):
    out = fn(q, k, v, *consts)
    return jnp.sum(out * ct), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, *consts)
  return out, grads


def _assert_close(got, want, what):
  (out_g, grads_g), (out_w, grads_w) = got, want
  dev = [float(jnp.max(jnp.abs(out_g - out_w)))] + [
    float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads_g, grads_w)
  ]
  assert max(dev) < TOL, f"{what}: max |d| of out, dq, dk, dv = {dev}"
  assert float(jnp.max(jnp.abs(out_w))) > 0.1  # a comparison that can fail
  return dev


def _run(impl, mask, rope_spec=None, alibi_spec=None, precise_dims=None):
  def fn(q, k, v):
    return attention(
      q,
      k,
      v,
      scale=SCALE,
      mask=mask,
      rope_spec=rope_spec,
      alibi_spec=alibi_spec,
      precise_dims=precise_dims,
      implementation=impl,
      interpret=True,
    )

  return fn


def test_masks_and_grouped_heads_match_the_reference(target):
  # no position encoding, causal (non-causal: the xPos + ALiBi test): padding (left, row 1), packed
  # segments (row 0), GQA N 4 / K 2, odd T (two q and k blocks of 8, the second padded)
  causal = True
  q, k, v, ct = _data()
  mask = _mask(causal)
  got = _value_and_grads(_run("flash", mask), q, k, v, ct)
  want = _value_and_grads(lambda q, k, v: _reference(q, k, v, mask), q, k, v, ct)
  _assert_close(got, want, f"causal={causal}")


def _rope_run(impl, mask, layout, factor=1.0, xpos=None, alibi=None):
  """``fn(q, k, v, inv_freq, positions)`` on ``impl`` with RoPE from a RopeSpec (arrays as jit args)."""

  def fn(q, k, v, inv_freq, pos):
    extra = {} if xpos is None else dict(xpos_scale_base=xpos[0], xpos_gamma=xpos[1], xpos_offset=xpos[2])
    spec = RopeSpec(inv_freq, pos, pos, layout=layout, attention_factor=factor, **extra)
    alibi_spec = None if alibi is None else AlibiSpec(alibi, pos, pos, max_position=1024)
    return _run(impl, mask, rope_spec=spec, alibi_spec=alibi_spec)(q, k, v)

  return fn


def _rope_reference(mask, layout, factor=1.0, xpos=None):
  def fn(q, k, v, inv_freq, pos):
    return _reference(q, k, v, mask, rope=(inv_freq, pos, pos, layout, factor), xpos=xpos)

  return fn


def test_every_rope_scaling_in_the_kernel_matches_the_reference():
  # every HF rope_scaling is an (inv_freq, attention_factor): inv_freq is a kernel input (one compilation)
  q, k, v, _ = _data(1)
  mask, pos = _mask(True), _positions()
  orig = dict(original_max_position_embeddings=8)
  scalings = [
    None,
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="dynamic", factor=2.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, **orig),
  ]  # yarn and longrope (attention_factor != 1): the gradient cases below
  kernel = jax.jit(_rope_run("flash", mask, "half"))
  reference = jax.jit(_rope_reference(mask, "half"))
  freqs = set()
  for scaling in scalings:
    # dynamic NTK: the frequencies for a 32-token context (its base grows past 16)
    inv_freq, factor = rope_frequencies(scaling, head_dim=H, max_position_embeddings=16, seq_len=32)
    assert factor == 1.0
    freqs.add(tuple(np.asarray(inv_freq).tolist()))
    got, want = kernel(q, k, v, inv_freq, pos), reference(q, k, v, inv_freq, pos)
    dev = float(jnp.max(jnp.abs(got - want)))
    assert dev < TOL, f"{scaling}: max |d out| = {dev}"
  assert len(freqs) == len(scalings)  # four different frequency sets


LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.5], long_factor=[2.0, 5.0])


@pytest.mark.parametrize(
  "layout,rotary_dim,causal,scaling,target",
  [
    ("half", 4, False, LONGROPE, "gpu"),
    ("interleaved", H, True, dict(rope_type="yarn", factor=4.0), "gpu"),
    ("half", 4, False, LONGROPE, "tpu"),  # TPU: the perm matmul for both layouts
  ],
  indirect=["target"],
)
def test_rope_gradients_in_the_kernel_match_the_reference(layout, rotary_dim, causal, scaling, target):
  # partial rotary_dim 4 of H 8 with LongRoPE's long factors (T 13 > 8) and attention_factor;
  # interleaved pairs with YaRN's attention_factor
  inv_freq, factor = rope_frequencies(
    {**scaling, "original_max_position_embeddings": 8},
    head_dim=H,
    rotary_dim=rotary_dim,
    max_position_embeddings=16,
    seq_len=T,
  )
  assert factor > 1.0
  q, k, v, ct = _data(2)
  mask, pos = _mask(causal), _positions()
  got = _value_and_grads(_rope_run("flash", mask, layout, factor), q, k, v, ct, inv_freq, pos)
  want = _value_and_grads(_rope_reference(mask, layout, factor), q, k, v, ct, inv_freq, pos)
  _assert_close(got, want, f"{layout} R={rotary_dim}")


@pytest.mark.parametrize(
  "layout,target", [("interleaved", "gpu"), ("half", "gpu"), ("interleaved", "tpu")], indirect=["target"]
)
def test_xpos_and_native_alibi_in_the_kernel_match_the_reference(layout, target):
  # xPos and ALiBi's bias -m (i - j) in one kernel, non-causal (keys after the query get a positive
  # bias too); one head without ALiBi; interleaved (perm matmul) and rotate-half (elementwise)
  xpos = (16.0, 0.4, 4)  # scale_base, gamma, offset: a strong decay at T 13
  slopes = np.array([0.5, 0.25, 0.0, 1.0])
  inv_freq, _ = rope_frequencies(None, head_dim=H)
  q, k, v, ct = _data(3)
  mask, pos = _mask(False), _positions()

  def reference(q, k, v, inv_freq, pos):
    return _reference(
      q, k, v, mask, rope=(inv_freq, pos, pos, layout, 1.0), xpos=xpos, alibi=(slopes, pos, pos)
    )

  kernel = _rope_run("flash", mask, layout, xpos=xpos, alibi=slopes)
  got = _value_and_grads(kernel, q, k, v, ct, inv_freq, pos)
  want = _value_and_grads(reference, q, k, v, ct, inv_freq, pos)
  _assert_close(got, want, f"xpos + alibi ({layout})")


@pytest.mark.parametrize("order,target", [(1, "gpu"), (3, "gpu"), (3, "tpu")], indirect=["target"])
def test_rope_alibi_emulation_dims_are_contracted_in_float32(order, target):
  # apply_rope_alibi's q/k: H content dims and 2k float32 dims (precise_dims) of large amplitude;
  # order 3: 6 dims, padded to 8 in the kernel
  q, k, v, ct = _data(5)
  mask, pos = _mask(True), _positions()
  slopes = np.array([0.5, 0.25, 0.125, 0.0625])
  qa, ka = apply_rope_alibi(jnp.asarray(q), jnp.asarray(k), pos, pos, slopes=slopes, theta=0.01, order=order)
  extra = qa.shape[-1] - H
  assert extra == 2 * order
  got = _value_and_grads(_run("flash", mask, precise_dims=extra), qa, ka, v, ct)
  want = _value_and_grads(lambda q, k, v: _reference(q, k, v, mask), qa, ka, v, ct)
  _assert_close(got, want, "rope_alibi")


def _pallas_calls(jaxpr) -> list[list[tuple[int, ...]]]:
  """Operand shapes of each pallas_call in ``jaxpr`` (nested jaxprs included)."""
  calls = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      calls.append([tuple(x.aval.shape) for x in eqn.invars])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      calls += _pallas_calls(sub)
  return calls


def test_grouped_query_kv_reaches_the_kernel_with_k_heads(target):
  # forward, dq and dk/dv kernels read k and v with K heads (no repeat to N): token-major
  # [B, T, K, D] on gpu (the caller's layout, no transposed copy), head-major [B, K, T, D] on tpu
  q, k, v, ct = _data()
  mask, pos = _mask(True), _positions()
  inv_freq, _ = rope_frequencies(None, head_dim=H)
  fn = _rope_run("flash", mask, "half")
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, inv_freq, pos) * ct)  # noqa: E731
  calls = _pallas_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
  assert len(calls) == 3
  expected = [(B, 16, N, H), (B, 16, K, H), (B, 16, K, H)]
  if target == "tpu":
    expected = [(B, N, 16, H), (B, K, 16, H), (B, K, 16, H)]
  for shapes in calls:  # operands q, k, v first
    assert shapes[:3] == expected, shapes[:3]


@pytest.mark.parametrize(
  "impl,precision",
  [("xla", "float32"), ("xla", "exact"), ("pallas_gpu", "exact"), ("flash", "float32"), ("flash", "exact")],
)
def test_rope_spec_gives_what_rotating_first_gives(impl, precision):
  # RopeSpec on a backend equals apply_rope on q and k (the user's own rotation) then attention
  from jaxpe.ops import apply_rope

  q, k, v, _ = _data(6)
  mask, pos = _mask(True), _positions()
  inv_freq, factor = rope_frequencies(
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8), head_dim=H
  )
  spec = RopeSpec(inv_freq, pos, pos, layout="half", attention_factor=factor, phase_precision=precision)
  got = jax.jit(_run(impl, mask, rope_spec=spec))(q, k, v)

  def rot(x):
    return apply_rope(
      x, pos, inv_freq=inv_freq, layout="half", attention_factor=factor, phase_precision=precision
    )

  want = _run("xla", mask)(rot(jnp.asarray(q)), rot(jnp.asarray(k)), v)
  assert float(jnp.max(jnp.abs(got - want))) < (1e-6 if impl == "xla" else TOL)


def _spec(**changes):
  pos = _positions()
  fields = dict(inv_freq=np.full(H // 2, 0.1, np.float32), q_positions=pos, k_positions=pos, layout="half")
  return RopeSpec(**{**fields, **changes})


BAD_SPECS = [
  ("not a spec", None, TypeError, "RopeSpec or None"),
  (dict(inv_freq=np.ones(H // 2, np.int32)), None, TypeError, "RopeSpec.inv_freq must be a float"),
  (
    dict(inv_freq=np.ones((2, 2), np.float32)),
    None,
    ValueError,
    r"RopeSpec.inv_freq must have shape \[R/2\]",
  ),
  (dict(inv_freq=np.ones(H, np.float32)), None, ValueError, "R must be <= H"),
  (dict(inv_freq=np.array([0.1, np.nan], np.float32)), None, ValueError, "must be finite"),
  (dict(q_positions=np.zeros((B, T + 1), np.int32)), None, ValueError, "RopeSpec.q_positions"),
  (dict(k_positions=-np.ones((B, T), np.int32)), None, ValueError, "RopeSpec.k_positions"),
  (dict(q_positions=np.zeros((B, T), np.float32)), None, TypeError, "RopeSpec.q_positions"),
  (dict(q_positions=np.zeros((3, B, T), np.int32)), None, ValueError, "mrope"),
  (dict(layout="complex"), None, ValueError, "RopeSpec.layout"),
  (dict(phase_precision="float64"), None, ValueError, "RopeSpec.phase_precision"),
  (dict(attention_factor=0.0), None, ValueError, "RopeSpec.attention_factor"),
  (dict(xpos_scale_base=-1.0), None, ValueError, "RopeSpec.xpos_scale_base"),
  (dict(xpos_offset=-1), None, ValueError, "RopeSpec.xpos_offset"),
  (dict(q_positions=np.full((B, T), 2**24, np.int32)), "flash", ValueError, "below 2\\^24"),
]


@pytest.mark.parametrize("changes,impl,error,match", BAD_SPECS, ids=[m for *_, m in BAD_SPECS])
def test_bad_rope_spec_is_refused_at_trace_time(changes, impl, error, match):
  q, k, v, _ = _data()
  spec = changes if isinstance(changes, str) else _spec(**changes)
  with pytest.raises(error, match=match):
    jax.jit(_run(impl or "xla", _mask(True), rope_spec=spec)).trace(q, k, v)


def test_flash_refuses_what_it_cannot_run():
  q, k, v, _ = _data()
  run = lambda **kw: attention(q, k, v, scale=SCALE, implementation="flash", interpret=True, **kw)  # noqa: E731
  with pytest.raises(ValueError, match="takes no bias tensor"):
    run(bias=jnp.zeros((B, N, T, T)))
  with pytest.raises(ValueError, match="not available"):
    attention(q, k, v, scale=SCALE, implementation="flash")  # no GPU / TPU here: interpret=True


def test_exact_phases_in_the_kernel_hold_at_far_positions():
  # positions near 16M: float64 RoPE attention (numpy, the formula) against the kernel's
  # exact phases (default) and HF's float32 phases (their rounding, half an ulp of p * theta)
  rng = np.random.default_rng(8)
  t_len, heads, dim = 16, 2, 16
  q, k, v = (rng.normal(size=(1, t_len, heads, dim)).astype(np.float32) for _ in range(3))
  inv_freq = 10000.0 ** -(np.arange(0, dim, 2) / dim)  # float64
  mask = AttentionMask(causal=True)

  def reference(pos):
    phase = pos.astype(np.float64)[:, :, None, None] * inv_freq
    c, s = np.cos(phase), np.sin(phase)
    rot = lambda x: np.concatenate([x[..., :8] * c - x[..., 8:] * s, x[..., 8:] * c + x[..., :8] * s], -1)  # noqa: E731
    scores = np.einsum("btnh,bsnh->bnts", rot(q.astype(np.float64)), rot(k.astype(np.float64))) * 0.25
    scores = np.where(np.tril(np.ones((t_len, t_len), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v.astype(np.float64))

  def kernel(pos, precision):
    spec = RopeSpec(inv_freq, pos, pos, layout="half", phase_precision=precision)
    out = attention(q, k, v, scale=0.25, mask=mask, rope_spec=spec, implementation="flash", interpret=True)
    return np.asarray(out)

  pos = (16_000_000 + 37 * np.arange(t_len))[None].astype(np.int32)
  want = reference(pos)
  exact, float32 = (float(np.max(np.abs(kernel(pos, p) - want))) for p in ("exact", "float32"))
  assert exact < 1e-6, exact  # measured 2.6e-7 (3M: 2.7e-7)
  assert float32 > 1e-2, float32  # float32 phases drift (measured 0.095): the comparison can fail


def test_native_alibi_in_the_kernel_holds_at_far_positions():
  # ALiBi depends on i - j only: positions near 2^28 (past float32's exact integers) give the
  # bias of the integer distance, as alibi_bias does; float64 numpy reference from the formula
  rng = np.random.default_rng(9)
  t_len, heads = 16, 2
  q, k, v = (rng.normal(size=(1, t_len, heads, 8)).astype(np.float32) for _ in range(3))
  slopes = np.array([0.5, 0.0625])
  pos = (2**28 + 3 * np.arange(t_len))[None].astype(np.int32)

  dist = (pos[:, :, None] - pos[:, None, :]).astype(np.float64)  # [1, T, T]
  scores = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k.astype(np.float64)) * SCALE
  scores = scores - slopes[None, :, None, None] * dist[:, None]
  scores = np.where(np.tril(np.ones((t_len, t_len), bool)), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v.astype(np.float64))

  spec = AlibiSpec(slopes, jnp.asarray(pos), jnp.asarray(pos), max_position=2**24)
  fn = jax.jit(
    lambda q, k, v: attention(
      q,
      k,
      v,
      scale=SCALE,
      mask=AttentionMask(causal=True),
      alibi_spec=spec,
      implementation="flash",
      interpret=True,
    )
  )
  got = np.asarray(fn(q, k, v))
  assert float(np.max(np.abs(got - want))) < TOL  # float32 positions before the difference: 1.6 off
