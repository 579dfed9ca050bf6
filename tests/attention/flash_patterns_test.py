"""The ``flash`` kernel's attention patterns (``local_window_size``, ``chunk_size``,
``logits_soft_cap``) and attention sinks, in Pallas interpret mode on both kernel families, against a
float64 numpy reference written here from the formulas (forward and the hand-derived backward:
gradients of q, k, v and the sink logits), combined with causal masking, padding, packed segments,
GQA, native ALiBi, RoPE in the kernel, bf16 and float32, T not a multiple of the block. Key blocks
outside the window / chunk are skipped, not only masked (a NaN block that no row sees stays out)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import AlibiSpec, AttentionMask, RopeSpec, attention, flash

B, T, N, K, H = 2, 21, 4, 2, 8  # T 21: three blocks of 8, the last padded
PAD = 3  # left padding of batch row 1
SCALE = 0.35


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
  monkeypatch.setattr(flash, "MAX_BLOCK", 8)  # several q and k blocks at a small T


def _force_target(monkeypatch, target):
  if target != "gpu":
    attend = flash.attend
    monkeypatch.setattr(flash, "attend", lambda *a, **kw: attend(*a, **{**kw, "target": target}))


def _data(seed, dtype):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H)) * 1.5
  k = rng.normal(size=(B, T, K, H)) * 1.5
  v = rng.normal(size=(B, T, K, H))
  ct = rng.normal(size=(B, T, N, H))
  sinks = rng.normal(size=(N,)) + np.array([0.0, 2.0, -1.0, 1.0])
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  return cast(q), cast(k), cast(v), cast(ct), jnp.asarray(sinks, jnp.float32)


def _mask(causal, packed=True):
  valid = np.arange(T)[None, :] >= np.array([[0], [PAD]])
  segments = np.stack([np.repeat([5, 9], [11, T - 11]), np.zeros(T, int)]).astype(np.int32)
  return dict(valid=valid, segments=segments if packed else np.zeros((B, T), np.int32), causal=causal)


def _positions():
  # row 0: two packed documents, each from 0; row 1: positions counted after the left padding
  row0 = np.concatenate([np.arange(11), np.arange(T - 11)])
  row1 = np.maximum(np.arange(T) - PAD, 0)
  return np.stack([row0, row1]).astype(np.int32)


# ---------------------------------------------------------------- the float64 reference


def _rope64(x, pos, inv_freq, sign=1.0):
  """RoFormer (arXiv 2104.09864) rotate-half on the first 2h dims of ``[B, T, ., H]`` (h = the
  frequencies; the rest unrotated); sign -1: the transpose."""
  h = inv_freq.shape[0]
  phase = pos[:, :, None, None].astype(np.float64) * inv_freq[None, None, None, :]
  c, s = np.cos(phase), sign * np.sin(phase)
  x1, x2 = x[..., :h], x[..., h : 2 * h]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * h :]], -1)


def _reference(q, k, v, ct, m, *, window=None, chunk=None, cap=None, sinks=None, alibi=None, rope=None):
  """``(out, dq, dk, dv, dsinks)`` of ``sum(out * ct)``, float64 numpy: scores ``scale q.k``, soft cap
  ``cap tanh(s / cap)``, then ALiBi ``-m (p_i - p_j)``, the mask (padding keys, segments, causal,
  window on token indices ``i - left <= j <= i + right``, chunks ``i // c == j // c``), softmax with
  ``exp(sink)`` in the denominator; rows of padding queries are zeros."""
  q, k, v, ct = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, ct))
  if rope is not None:
    inv_freq, pos = rope
    q, k = _rope64(q, pos, inv_freq), _rope64(k, pos, inv_freq)
  (b_size, t_len, n_heads, _), g = q.shape, q.shape[2] // k.shape[2]
  idx = np.arange(t_len)
  i, j = idx[:, None], idx[None, :]
  out, dq, dk, dv = np.zeros(q.shape[:3] + v.shape[3:]), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  dsinks = np.zeros(n_heads)
  for b in range(b_size):
    ok = m["valid"][b][None, :] & (m["segments"][b][:, None] == m["segments"][b][None, :])
    if m["causal"]:
      ok = ok & (j <= i)
    if window is not None:
      left, right = (window, window) if isinstance(window, int) else window
      ok = ok & (j >= i - left) & (j <= i + right)
    if chunk is not None:
      ok = ok & (i // chunk == j // chunk)
    rows = m["valid"][b].astype(np.float64)[:, None]
    for n in range(n_heads):
      kv = n // g
      s0 = SCALE * q[b, :, n] @ k[b, :, kv].T
      t = np.tanh(s0 / cap) if cap is not None else None
      s = cap * t if cap is not None else s0
      if alibi is not None:
        slopes, pos = alibi
        s = s - slopes[n] * (pos[b][:, None] - pos[b][None, :])
      s = np.where(ok, s, -np.inf)
      top = s.max(-1, keepdims=True)
      top = np.where(np.isfinite(top), top, 0.0)  # a row with no visible key (a padding query)
      if sinks is not None:
        top = np.maximum(top, sinks[n])
      e = np.where(ok, np.exp(s - top), 0.0)
      den = e.sum(-1, keepdims=True) + (np.exp(sinks[n] - top) if sinks is not None else 0.0)
      den = np.where(den > 0, den, 1.0)
      p = e / den
      o = p @ v[b, :, kv]
      out[b, :, n] = o * rows
      do = ct[b, :, n] * rows
      delta = (do * o).sum(-1, keepdims=True)
      dv[b, :, kv] += p.T @ do
      ds = p * (do @ v[b, :, kv].T - delta)
      if sinks is not None:  # the sink: a score with no value, dP = 0
        dsinks[n] -= np.sum(np.exp(sinks[n] - top) / den * delta)
      if cap is not None:
        ds = ds * (1.0 - t * t)
      dq[b, :, n] += SCALE * ds @ k[b, :, kv]
      dk[b, :, kv] += SCALE * ds.T @ q[b, :, n]
  if rope is not None:
    inv_freq, pos = rope
    dq, dk = _rope64(dq, pos, inv_freq, -1.0), _rope64(dk, pos, inv_freq, -1.0)
  return out, dq, dk, dv, dsinks


def _kernel(
  q, k, v, ct, sinks, m, *, window=None, chunk=None, cap=None, use_sinks=False, alibi=None, rope=None
):
  mask = AttentionMask(
    valid=jnp.asarray(m["valid"]), segment_ids=jnp.asarray(m["segments"]), causal=m["causal"]
  )
  if chunk is not None:  # flash counts chunks from slot 0: chunks with padding / packing are refused
    assert np.all(m["valid"]) and np.all(m["segments"] == m["segments"][:, :1])
    mask = AttentionMask(causal=m["causal"])

  def loss(q, k, v, sinks):
    extra = {}
    if alibi is not None:
      slopes, pos = alibi
      extra["alibi_spec"] = AlibiSpec(slopes, jnp.asarray(pos), jnp.asarray(pos), max_position=1024)
    if rope is not None:
      inv_freq, pos = rope
      extra["rope_spec"] = RopeSpec(
        jnp.asarray(inv_freq, jnp.float32), jnp.asarray(pos), jnp.asarray(pos), "half"
      )
    out = attention(
      q,
      k,
      v,
      scale=SCALE,
      mask=mask,
      implementation="flash",
      interpret=True,
      sinks=sinks if use_sinks else None,
      local_window_size=window,
      chunk_size=chunk,
      logits_soft_cap=cap,
      **extra,
    )
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
  return (out, *grads)


INV_FREQ = 1.0 / 10000.0 ** (np.arange(0, H, 2) / H)
SLOPES = np.array([0.5, 0.25, 0.0, 1.0])

CASES = {  # name: (target, dtype, causal, options); every case: padding, packed segments (none with chunks), GQA, T 21
  # each option alone (with the masks above), then together with causal, ALiBi, RoPE, bf16
  "window": ("gpu", jnp.float32, False, dict(window=(5, 2))),
  "chunk": ("tpu", jnp.float32, False, dict(chunk=6)),
  "cap": ("tpu", jnp.float32, False, dict(cap=1.5)),
  "sinks": ("gpu", jnp.float32, False, dict(use_sinks=True)),
  "window-chunk-causal": ("gpu", jnp.float32, True, dict(window=(7, 3), chunk=6)),  # causal: right 0
  "cap-alibi-rope-sinks": ("tpu", jnp.float32, True, dict(cap=1.5, alibi=True, rope=True, use_sinks=True)),
  "all-bf16": (
    "tpu",
    jnp.bfloat16,
    True,
    dict(window=(6, 0), chunk=10, cap=2.0, alibi=True, rope=True, use_sinks=True),
  ),
  "all-gpu-bf16": (
    "gpu",
    jnp.bfloat16,
    False,
    dict(window=3, chunk=12, cap=2.0, alibi=True, rope=True, use_sinks=True),
  ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_patterns_and_sinks_match_the_float64_reference(name, monkeypatch):
  target, dtype, causal, options = CASES[name]
  _force_target(monkeypatch, target)
  q, k, v, ct, sinks = _data(len(name), dtype)
  m, pos = _mask(causal), _positions()
  if "chunk" in options:  # no padding nor packing (refused with chunks: patterns_kernels_test)
    m = dict(valid=np.ones((B, T), bool), segments=np.zeros((B, T), np.int32), causal=causal)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  options = dict(options)
  if options.pop("alibi", False):
    options["alibi"] = (SLOPES, pos)
  if options.pop("rope", False):
    options["rope"] = (INV_FREQ, pos)
  use_sinks = options.pop("use_sinks", False)
  got = _kernel(q, k, v, ct, sinks, m, use_sinks=use_sinks, **options)
  want = _reference(q, k, v, ct, m, sinks=np.asarray(sinks, np.float64) if use_sinks else None, **options)
  tol = 1e-5 if dtype == jnp.float32 else 1.5e-2  # measured: <= 7.8e-7 and <= 5.0e-3
  names = ("out", "dq", "dk", "dv", "dsinks")
  for what, a, b in zip(names, got, want, strict=True):
    if what == "dsinks" and not use_sinks:
      assert float(jnp.max(jnp.abs(a))) == 0.0  # sinks not given: no gradient
      continue
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    scale = max(1.0, float(np.max(np.abs(b))))
    dev = float(np.max(np.abs(a - b))) / scale
    assert dev < tol, f"{name}: {what} max |d| / max(1, |want|) = {dev}"
    assert float(np.max(np.abs(b))) > 0.05, f"{name}: {what} is ~0, a comparison that cannot fail"


def _grids(jaxpr):
  grids = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      grids.append(tuple(eqn.params["grid_mapping"].grid))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      grids += _grids(sub)
  return grids


@pytest.mark.parametrize("target", flash.TARGETS)
def test_key_blocks_outside_the_window_are_never_loaded(target, monkeypatch):
  # NaN values in key block 0 (tokens 0..7): q block 2 (rows 16..23) with window (5, 2) sees keys
  # 11..25 only, so its rows stay finite, as the reference without that block, only if block 0 is
  # never loaded (a masked NaN value still gives 0 * NaN = NaN in P.V)
  _force_target(monkeypatch, target)
  q, k, v, ct, sinks = _data(7, jnp.float32)
  m = _mask(False, packed=False)
  m["valid"] = np.ones((B, T), bool)
  v_nan = v.at[:, :8].set(jnp.nan)
  got = _kernel(q, k, v_nan, ct, sinks, m, window=(5, 2), use_sinks=True)
  want = _reference(q, k, v, ct, m, window=(5, 2), sinks=np.asarray(sinks, np.float64))
  out = np.asarray(got[0])
  assert np.all(np.isnan(out[:, :8])), "rows of block 0 see the NaN values"
  assert np.max(np.abs(out[:, 16:] - want[0][:, 16:])) < 2e-4
  dq = np.asarray(got[1])
  assert np.all(np.isfinite(dq[:, 16:])) and np.max(np.abs(dq[:, 16:] - want[1][:, 16:])) < 2e-4
  if target == "tpu":  # the Mosaic grids' sequential axis holds only the needed blocks: 2 of 3
    # (causal, window (5, 0): q block 1, rows 8..15, sees keys 3..15: blocks 0 and 1)
    mask = AttentionMask(causal=True)
    fn = lambda q, k, v: attention(  # noqa: E731
      q, k, v, scale=SCALE, mask=mask, implementation="flash", interpret=True, local_window_size=(5, 0)
    )
    grids = _grids(jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v))))(q, k, v).jaxpr)
    assert sorted(g[-1] for g in grids) == [2, 2, 2], grids  # forward, dq, dk/dv (3 without skipping)


def test_chunks_skip_the_other_chunks_blocks(monkeypatch):
  # chunk 8 = the block: each q block sees only its own k block (a grid of one step on TPU)
  _force_target(monkeypatch, "tpu")
  q, k, v, _, _ = _data(8, jnp.float32)
  fn = lambda q, k, v: attention(  # noqa: E731
    q,
    k,
    v,
    scale=SCALE,
    mask=AttentionMask(causal=True),
    implementation="flash",
    interpret=True,
    chunk_size=8,
  )
  grids = _grids(jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v))))(q, k, v).jaxpr)
  assert sorted(g[-1] for g in grids) == [1, 1, 1], grids


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(local_window_size=-1), ValueError, "local_window_size must be"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size must be"),
    (dict(local_window_size=2.0), TypeError, "local_window_size must be"),
    (dict(local_window_size=(1, True)), TypeError, "local_window_size must be"),
    (dict(chunk_size=0), ValueError, "chunk_size must be"),
    (dict(chunk_size=True), TypeError, "chunk_size must be"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap must be"),
    (dict(logits_soft_cap="1"), TypeError, "logits_soft_cap must be"),
  ],
)
def test_bad_patterns_are_refused_at_trace_time(kwargs, error, match):
  q, k, v, _, _ = _data(0, jnp.float32)
  with pytest.raises(error, match=match):
    attention(q, k, v, scale=SCALE, implementation="flash", interpret=True, **kwargs)


def test_soft_cap_with_emulated_alibi_dims_is_refused():
  # precise_dims: rope_alibi's emulation dims carry ALiBi inside q.k, which a cap would bend
  q, k, v, _, _ = _data(0, jnp.float32)
  qe, ke = jnp.concatenate([q, q[..., :2]], -1), jnp.concatenate([k, k[..., :2]], -1)
  with pytest.raises(ValueError, match="logits_soft_cap with precise_dims=2 > 0"):
    attention(qe, ke, v, scale=SCALE, implementation="flash", interpret=True, logits_soft_cap=5.0)
  with pytest.raises(ValueError, match="'flash' cannot take logits_soft_cap with precise_dims=2"):
    flash.attend(qe, ke, v, scale=SCALE, mask=None, precise_dims=2, interpret=True, logits_soft_cap=5.0)
  attention(
    qe, ke, v, scale=SCALE, implementation="flash", interpret=True, local_window_size=3
  )  # no cap: runs


@pytest.mark.parametrize(
  "causal,window,chunk",
  [
    (True, None, None),
    (False, None, None),
    (True, (5, 0), None),
    (False, (3, 9), None),
    (False, (0, 17), None),
    (True, None, 12),
    (False, None, 5),
    (True, (20, 0), 24),
    (False, (6, 2), 10),
  ],
)
def test_block_ranges_are_exactly_the_needed_blocks(causal, window, chunk):
  # key_blocks / query_blocks against the blocks holding an allowed (query, key) pair, from the
  # dense pattern of the token indices (numpy): no needed block left out, none visited past it
  # (an off-by-one bound would load and compute a whole block of masked pairs)
  from jaxpe.attention import flash_kernels, flash_patterns

  b, n = 8, 5
  cfg = flash_kernels.Config(
    scale=1.0, causal=causal, block=b, groups=1, window=window, chunk=chunk, length=b * n
  )
  i, j = np.arange(b * n)[:, None], np.arange(b * n)[None, :]
  allowed = np.ones((b * n, b * n), bool)
  if causal:
    allowed &= j <= i
  if window is not None:
    allowed &= (j >= i - window[0]) & (j <= i + window[1])
  if chunk is not None:
    allowed &= i // chunk == j // chunk
  needed = allowed.reshape(n, b, n, b).any(axis=(1, 3))  # [q block, key block]
  for x in range(n):
    for blocks, row in ((flash_patterns.key_blocks, needed[x]), (flash_patterns.query_blocks, needed[:, x])):
      lo, hi = blocks(cfg, x, n)
      assert (lo, hi) == (np.argmax(row), n - np.argmax(row[::-1])), (blocks.__name__, x, lo, hi, row)
      assert row[lo:hi].all()  # contiguous: every visited block is needed
  assert flash_patterns.span(flash_patterns.key_blocks, cfg, n) == needed.sum(axis=1).max()


def _kernel_operands(jaxpr):
  """``[(shapes of the operands), (shapes of the outputs)]`` of each ``pallas_call`` in ``jaxpr``."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(
        ([tuple(x.aval.shape) for x in eqn.invars], [tuple(a.shape) for a in eqn.params["out_avals"]])
      )
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _kernel_operands(sub)
  return found


@pytest.mark.parametrize(
  "head_dim, half, options",
  # D 32: rotate-half split (lane ranges 0-8, 8-16, 16-32, the last masked from 24); v, do, o, dv
  # through the whole-block masked loads and stores
  [(24, 8, dict(alibi=True, use_sinks=True, chunk=6, causal=True))],
)
def test_head_dims_off_a_power_of_two_are_read_in_place_on_gpu(head_dim, half, options):
  # T 16, two whole blocks of 8: q, k, v (and o, dq, dk, dv) stay H wide in HBM, the Triton blocks
  # are D lanes wide with lanes >= H masked (loads read 0, stores skip them): no padded copies
  # around the kernels (before: q, k, v padded to D, 0.75 MiB of the 1.25 MiB of temporaries of
  # bf16 H 80 / 96 on an H100); garbage in the interpreter's padding would show in every output
  t_len, options = 16, dict(options)
  rng = np.random.default_rng(head_dim)
  cast = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  q, ct = (cast(rng.normal(size=(1, t_len, N, head_dim)) * 1.5) for _ in range(2))
  k, v = (cast(rng.normal(size=(1, t_len, K, head_dim)) * 1.5) for _ in range(2))
  sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  m = dict(
    valid=np.ones((1, t_len), bool), segments=np.zeros((1, t_len), np.int32), causal=options.pop("causal")
  )
  pos = np.broadcast_to(np.arange(t_len, dtype=np.int32), (1, t_len))
  inv_freq = 1.0 / 10000.0 ** (np.arange(half) / half)
  options["rope"] = (inv_freq, pos)
  if options.pop("alibi", False):
    options["alibi"] = (SLOPES, pos)
  use_sinks = options.pop("use_sinks", False)
  got = _kernel(q, k, v, ct, sinks, m, use_sinks=use_sinks, **options)
  want = _reference(q, k, v, ct, m, sinks=np.asarray(sinks, np.float64) if use_sinks else None, **options)
  for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    a = np.asarray(a, np.float64)
    assert a.shape == b.shape and np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))) < 1e-5, what
    assert np.max(np.abs(b)) > 0.05
  mask = AttentionMask(causal=m["causal"])
  spec = RopeSpec(jnp.asarray(inv_freq, jnp.float32), jnp.asarray(pos), jnp.asarray(pos), "half")
  fn = lambda q, k, v: attention(  # noqa: E731
    q, k, v, scale=SCALE, mask=mask, implementation="flash", interpret=True, rope_spec=spec
  )
  calls = _kernel_operands(
    jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2)))(q, k, v).jaxpr
  )
  assert len(calls) == 3  # forward, dq, dk/dv
  for ins, outs in calls:  # q, k, v first; o / dq / dk, dv: all H wide (lse: [B, N, T, 1])
    assert [s[-1] for s in ins[:3]] == [head_dim] * 3 and {s[-1] for s in outs if s[-1] != 1} == {head_dim}
