"""The attention patterns (jaxpe.attention.patterns): local_window_size, chunk_size, logits_soft_cap on
jaxpe.attention.attention (every xla path: blockwise under an AttentionMask / IndexMask / no mask, the
KV-cache decode path, the dense path) and on the dense reference dot_product_attention, against a
float64 transcription of the formulas (numpy for values, jax float64 autodiff for gradients), with
padding, packing, GQA, native ALiBi and sinks; the mask conventions against transformers'
sliding_window_causal_mask_function / chunked_causal_mask_function; the errors and refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import AlibiSpec, AttentionMask, IndexMask, attention, decode, dot_product_attention

B, N, K, H = 2, 4, 2, 8
SCALE = 0.4
OPTIONS = {
  "window": dict(local_window_size=(6, 0)),
  "window_two_sided": dict(local_window_size=(3, 4)),
  "chunk": dict(chunk_size=8),
  "cap": dict(logits_soft_cap=1.5),
  "all": dict(local_window_size=5, chunk_size=16, logits_soft_cap=2.0),
}
# Each option alone on the dense reference and the xla backend's main path (an AttentionMask: the
# CPU kernel and the XLA loops); the other paths take a one-sided window and all three composed
# (a two-sided window, chunks and the cap), which keeps the file's run short.
COMPOSED = ["window", "all"]


def _doc_positions(valid, seg):
  """[B, T] each token's position in its document (a run of equal ids), from its first real token
  (as transformers counts chunks: create_chunked_causal_mask, position_ids of packed rows), in loops."""
  out = np.zeros(valid.shape, np.int64)
  for b in range(valid.shape[0]):
    first = None
    for t in range(valid.shape[1]):
      if t == 0 or seg[b, t] != seg[b, t - 1]:
        first = None
      if first is None and valid[b, t]:
        first = t
      out[b, t] = 0 if first is None else t - first
  return out


def _allowed(
  q_pos, k_pos, *, causal=False, k_valid=None, q_seg=None, k_seg=None, window=None, chunk=None, chunk_pos=None
):
  """float64-side mask [B, 1, T, S] from positions, written out independently (``chunk_pos``: the
  (q, k) positions the chunks count, default q_pos / k_pos)."""
  qp, kp = np.asarray(q_pos)[:, :, None], np.asarray(k_pos)[:, None, :]
  ok = np.ones(np.broadcast_shapes(qp.shape, kp.shape), bool)
  if causal:
    ok &= kp <= qp
  if k_valid is not None:
    ok &= np.asarray(k_valid, bool)[:, None, :]
  if q_seg is not None:
    ok &= np.asarray(q_seg)[:, :, None] == np.asarray(k_seg)[:, None, :]
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    ok &= (kp >= qp - left) & (kp <= qp + right)
  if chunk is not None:
    qc, kc = (qp, kp) if chunk_pos is None else (chunk_pos[0][:, :, None], chunk_pos[1][:, None, :])
    ok &= qc // chunk == kc // chunk
  return ok[:, None]


def _reference(xp, q, k, v, allowed, *, cap=None, bias=None, sinks=None):
  """softmax(cap * tanh(q.k * SCALE / cap) + bias [+ sink], masked) . v in float64 (xp: numpy or jnp);
  rows with no visible key give zeros."""
  g = q.shape[2] // k.shape[2]
  k, v = xp.repeat(k, g, axis=2), xp.repeat(v, g, axis=2)
  s = xp.einsum("btnh,bsnh->bnts", q, k) * SCALE
  if cap is not None:
    s = cap * xp.tanh(s / cap)
  if bias is not None:
    s = s + bias
  s = xp.where(allowed, s, -1e300)
  top = xp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    top = xp.maximum(top, sinks[None, :, None, None])
  e = xp.where(allowed, xp.exp(s - top), 0.0)
  total = xp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    total = total + xp.exp(sinks[None, :, None, None] - top)
  p = e / xp.where(total > 0, total, 1.0)
  return xp.einsum("bnts,bsnh->btnh", p, v)


def _data(t_len, s_len=None, seed=0):
  s_len = t_len if s_len is None else s_len
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, t_len, N, H)).astype(np.float32)
  k = rng.standard_normal((B, s_len, K, H)).astype(np.float32)
  v = rng.standard_normal((B, s_len, K, H)).astype(np.float32)
  w = rng.standard_normal((B, t_len, N, H)).astype(np.float32)
  return q, k, v, w


def _check(fn, q, k, v, w, allowed, *, cap=None, bias=None, sinks=None, real_rows=None):
  """fn(q, k, v) and its gradients of sum(out * w) against the float64 reference."""
  out = np.asarray(fn(q, k, v), np.float64)
  want = _reference(
    np, *(np.asarray(x, np.float64) for x in (q, k, v)), allowed, cap=cap, bias=bias, sinks=sinks
  )
  if real_rows is not None:  # padding query rows: compared on the real ones only
    out, want = out * real_rows, want * real_rows
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
  wr = w if real_rows is None else w * real_rows
  grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * wr), argnums=(0, 1, 2))(q, k, v)
  with jax.enable_x64(True):
    args = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
    b = None if bias is None else jnp.asarray(bias, jnp.float64)
    sk = None if sinks is None else jnp.asarray(sinks, jnp.float64)
    w64 = jnp.asarray(wr, jnp.float64)
    ref = jax.grad(
      lambda q, k, v: jnp.sum(_reference(jnp, q, k, v, allowed, cap=cap, bias=b, sinks=sk) * w64),
      argnums=(0, 1, 2),
    )(*args)
    ref = [np.asarray(x) for x in ref]
  for name, got, exp in zip("qkv", grads, ref):
    np.testing.assert_allclose(np.asarray(got, np.float64), exp, atol=5e-5, rtol=1e-3, err_msg=f"d{name}")


def _pattern(opts):
  return dict(window=opts.get("local_window_size"), chunk=opts.get("chunk_size"))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_dense_reference(name):
  opts = OPTIONS[name]
  q, k, v, w = _data(21)
  pos = np.broadcast_to(np.arange(21), (B, 21))
  allowed = _allowed(pos, pos, causal=True, **_pattern(opts))
  fn = lambda q, k, v: dot_product_attention(q, k, v, scale=SCALE, is_causal=True, **opts)  # noqa: E731
  _check(fn, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"))


@pytest.mark.parametrize(
  "name, path", [(n, "cpu_kernel") for n in OPTIONS] + [(n, "xla_loops") for n in COMPOSED]
)
def test_blockwise_padding_packing_alibi_sinks(name, path):
  """AttentionMask (left padding, two packed documents), odd T = 37, GQA, native ALiBi and sinks, on
  the xla backend's blockwise path: attention (on the CPU: the C++ kernel) and the XLA loops
  (blockwise_attention with explicit blocks of 8, which never runs the kernel)."""
  from jaxpe.attention import blockwise

  opts = OPTIONS[name]
  t = 37
  q, k, v, w = _data(t)
  valid = np.ones((B, t), bool)
  valid[1, :5] = False
  seg = np.zeros((B, t), np.int32)
  seg[0, 20:] = 1
  pos = np.broadcast_to(np.arange(t), (B, t))
  slopes = np.array([0.5, 0.25, 0.125, 0.0])
  sinks = np.array([0.3, -1.0, 2.0, 0.0], np.float32)
  spec = AlibiSpec(slopes, pos, pos, max_position=1024)
  bias = -slopes[None, :, None, None] * (pos[:, None, :, None] - pos[:, None, None, :])
  doc = _doc_positions(valid, seg)  # chunks from each document's first real token
  allowed = _allowed(
    pos, pos, causal=True, k_valid=valid, q_seg=seg, k_seg=seg, chunk_pos=(doc, doc), **_pattern(opts)
  )
  mask = AttentionMask(valid=valid, segment_ids=seg, causal=True)

  def fn(q, k, v):
    if path == "xla_loops":
      return blockwise.blockwise_attention(
        q, k, v, scale=SCALE, mask=mask, alibi=spec, sinks=sinks, block_q=8, block_k=8, **opts
      )
    return attention(q, k, v, scale=SCALE, mask=mask, alibi_spec=spec, sinks=sinks, **opts)

  real = valid[:, :, None, None].astype(np.float32)
  _check(fn, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"), bias=bias, sinks=sinks, real_rows=real)


@pytest.mark.parametrize("name", COMPOSED)
def test_dense_path_under_a_bias(name):
  """A dense bias sends the xla backend to the dense reference (the window as part of its mask)."""
  opts = OPTIONS[name]
  q, k, v, w = _data(19)
  pos = np.broadcast_to(np.arange(19), (B, 19))
  bias = np.random.default_rng(3).standard_normal((B, N, 19, 19)).astype(np.float32)
  allowed = _allowed(pos, pos, causal=True, **_pattern(opts))
  fn = lambda q, k, v: attention(q, k, v, scale=SCALE, mask=AttentionMask(), bias=bias, **opts)  # noqa: E731
  _check(fn, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"), bias=bias.astype(np.float64))


@pytest.mark.parametrize("t_len", [3, 23])
@pytest.mark.parametrize("name", COMPOSED)
def test_index_mask_ring_buffer(name, t_len):
  """An IndexMask whose key slots hold the tokens' positions out of order (a ring buffer that has
  wrapped, some slots empty): T = 3 runs the decode path, T = 23 the blockwise loops."""
  opts = OPTIONS[name]
  s = 32
  q, k, v, w = _data(t_len, s)
  k_pos = (np.arange(s) + 13) % s + 40  # slot j holds position 40 + (j + 13) % 32: wrapped
  k_pos = np.broadcast_to(k_pos, (B, s))
  q_pos = np.broadcast_to(np.arange(t_len) + 71 - t_len + 1, (B, t_len))  # the last queries
  k_valid = np.ones((B, s), bool)
  k_valid[0, 3] = False
  mask = IndexMask(q_pos, k_pos, causal=True, k_valid=k_valid)
  allowed = _allowed(q_pos, k_pos, causal=True, k_valid=k_valid, **_pattern(opts))
  fn = lambda q, k, v: attention(q, k, v, scale=SCALE, mask=mask, **opts)  # noqa: E731
  _check(fn, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"))


@pytest.mark.parametrize("name", COMPOSED)
def test_decode_heads_first(name):
  """decode_attention(heads_first=True), the KV cache's layout [B, K, S, H]."""
  opts = OPTIONS[name]
  s = 24
  q, k, v, w = _data(2, s)
  q_pos = np.broadcast_to(np.array([22, 23]), (B, 2))
  k_pos = np.broadcast_to(np.arange(s), (B, s))
  mask = IndexMask(q_pos, k_pos, causal=True)
  allowed = _allowed(q_pos, k_pos, causal=True, **_pattern(opts))

  def fn(q, k, v):
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    return decode.decode_attention(q, kh, vh, scale=SCALE, mask=mask, heads_first=True, **opts)

  _check(fn, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"))


@pytest.mark.parametrize("name", ["window_two_sided", "all"])
def test_no_mask_cross_lengths(name):
  """No mask, T != S: indices aligned at the top left (jax.nn.dot_product_attention's window)."""
  opts = OPTIONS[name]
  q, k, v, w = _data(13, 29)
  q_pos, k_pos = np.broadcast_to(np.arange(13), (B, 13)), np.broadcast_to(np.arange(29), (B, 29))
  allowed = _allowed(q_pos, k_pos, **_pattern(opts))
  fn = lambda q, k, v: attention(q, k, v, scale=SCALE, **opts)  # noqa: E731
  _check(fn, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"))
  dense = lambda q, k, v: dot_product_attention(q, k, v, scale=SCALE, **opts)  # noqa: E731
  _check(dense, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"))


def test_gemma2_soft_cap_order():
  """transformers' gemma2 eager_attention_forward (torch float64): cap on the scaled scores, then the
  additive mask (here a causal mask plus a bias standing for ALiBi) and the softmax."""
  import torch
  from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

  t = 9
  q, k, v, _ = _data(t)
  bias = np.random.default_rng(1).standard_normal((B, N, t, t)).astype(np.float32)
  causal = np.tril(np.ones((t, t), bool))
  additive = np.where(causal, 0.0, -np.inf)[None, None] + bias.astype(np.float64)
  module = torch.nn.Module()
  module.num_key_value_groups, module.training, module.head_dim = N // K, False, H
  tq, tk, tv = (torch.tensor(np.swapaxes(np.asarray(x, np.float64), 1, 2)) for x in (q, k, v))
  want, _ = eager_attention_forward(module, tq, tk, tv, torch.tensor(additive), scaling=SCALE, softcap=3.0)
  out = attention(q, k, v, scale=SCALE, mask=AttentionMask(), bias=bias, logits_soft_cap=3.0)
  np.testing.assert_allclose(np.asarray(out, np.float64), want.numpy(), atol=2e-5)


def _visible_by_probe(fn, t_len, s_len):
  """[B, T, S] bool: which keys each query's softmax weighs (q = k = 0, v = one-hot key index)."""
  q = np.zeros((B, t_len, 1, s_len), np.float32)
  k = np.zeros((B, s_len, 1, s_len), np.float32)
  v = np.broadcast_to(np.eye(s_len, dtype=np.float32)[None, :, None, :], (B, s_len, 1, s_len))
  return np.asarray(fn(q, k, v))[:, :, 0, :] > 0


def _hf_mask(mask_function, t_len, s_len, q_offset=0):
  import torch

  b, h = torch.arange(B)[:, None, None], torch.zeros(1, dtype=torch.long)
  qi = torch.arange(t_len)[None, :, None] + q_offset
  ki = torch.arange(s_len)[None, None, :]
  return np.broadcast_to(mask_function(b, h, qi, ki).numpy(), (B, t_len, s_len))


@pytest.mark.parametrize("w", [1, 4, 7])
def test_sliding_window_matches_transformers(w):
  """transformers' sliding_window = w (counting the query) is local_window_size = (w - 1, 0)."""
  from transformers.masking_utils import sliding_window_causal_mask_function

  t = 19
  want = _hf_mask(sliding_window_causal_mask_function(w), t, t)
  window = dict(local_window_size=(w - 1, 0))
  got = _visible_by_probe(lambda q, k, v: attention(q, k, v, scale=1.0, mask=AttentionMask(), **window), t, t)
  np.testing.assert_array_equal(got, want)
  dense = _visible_by_probe(
    lambda q, k, v: dot_product_attention(q, k, v, scale=1.0, is_causal=True, **window), t, t
  )
  np.testing.assert_array_equal(dense, want)
  # decoding: 2 queries at positions 17, 18 over a cache of 19 slots
  qi, ki = np.broadcast_to([17, 18], (B, 2)), np.broadcast_to(np.arange(t), (B, t))
  got = _visible_by_probe(
    lambda q, k, v: attention(q, k, v, scale=1.0, mask=IndexMask(qi, ki, causal=True), **window), 2, t
  )
  np.testing.assert_array_equal(got, want[:, 17:])


@pytest.mark.parametrize("c", [1, 4, 5])
def test_chunked_matches_transformers(c):
  """transformers' chunked_causal_mask_function(chunk_size) (no left padding) is chunk_size = c with
  a causal mask; under left padding transformers counts chunks from the first real token, which an
  IndexMask of the tokens' positions reproduces."""
  import torch
  from transformers.masking_utils import chunked_causal_mask_function

  t = 17
  want = _hf_mask(chunked_causal_mask_function(c, torch.zeros(B, dtype=torch.long)), t, t)
  got = _visible_by_probe(
    lambda q, k, v: attention(q, k, v, scale=1.0, mask=AttentionMask(), chunk_size=c), t, t
  )
  np.testing.assert_array_equal(got, want)
  pad = torch.tensor([0, 3])
  want = _hf_mask(chunked_causal_mask_function(c, pad), t, t)
  # the tokens' positions (from the first real token), shifted by whole chunks to keep padding's >= 0
  positions = np.arange(t)[None] - pad.numpy()[:, None] + 8 * c
  index = IndexMask(positions, positions, causal=True)
  got = _visible_by_probe(lambda q, k, v: attention(q, k, v, scale=1.0, mask=index, chunk_size=c), t, t)
  real = np.arange(t)[None, :] >= pad.numpy()[:, None]
  both = real[:, :, None] & real[:, None, :]
  np.testing.assert_array_equal(got[both], want[both])


@pytest.mark.parametrize(
  "kwargs, error, words",
  [
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
    (dict(local_window_size=(1, -2)), ValueError, "local_window_size"),
    (dict(local_window_size=1.5), TypeError, "local_window_size"),
    (dict(local_window_size=True), TypeError, "local_window_size"),
    (dict(local_window_size=(1, None)), TypeError, "local_window_size"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size=2.0), TypeError, "chunk_size"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="50"), TypeError, "logits_soft_cap"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap"),
  ],
)
def test_bad_values_are_named(kwargs, error, words):
  q, k, v, _ = _data(4)
  for fn in (attention, dot_product_attention):
    with pytest.raises(error, match=words):
      fn(q, k, v, scale=SCALE, **kwargs)


def test_cap_refused_with_precise_dims():
  q, k, v, _ = _data(4)
  q2, k2 = (np.concatenate([x, x[..., :2]], axis=-1) for x in (q, k))
  for fn in (attention, dot_product_attention):
    with pytest.raises(ValueError, match="logits_soft_cap with precise_dims"):
      fn(q2, k2, v, scale=SCALE, logits_soft_cap=5.0)


def test_flash_runs_every_option_as_xla():
  # flash runs the patterns in its kernel (tests/attention/flash_patterns_test.py: against float64,
  # gradients, every combination); here the same call on flash and xla agree
  q, k, v, _ = _data(16)
  for opts in ({"local_window_size": 3}, {"chunk_size": 4}, {"logits_soft_cap": 5.0}):
    run = lambda impl, opts=opts: attention(  # noqa: E731
      q, k, v, scale=SCALE, mask=AttentionMask(), implementation=impl, interpret=True, **opts
    )
    np.testing.assert_allclose(np.asarray(run("flash")), np.asarray(run("xla")), atol=2e-5, err_msg=str(opts))


@pytest.mark.parametrize("mask_kind", ["attention_mask", "index_mask", "triangular"])
def test_blocks_outside_the_window_are_skipped(mask_kind):
  """A NaN value in key 0 reaches a query only through a computed block pair (a masked score has
  weight 0, and 0 x NaN is NaN): queries whose window never reaches key block 0 stay finite, in the
  output and in the gradients, only when the loops skip those pairs (both passes)."""
  from jaxpe.attention import blockwise

  t = 64
  q, k, v, w = _data(t)
  v = v.copy()
  v[:, 0] = np.nan
  pos = np.broadcast_to(np.arange(t), (B, t))
  mask = AttentionMask(causal=True) if mask_kind != "index_mask" else IndexMask(pos, pos, causal=True)
  blocks = dict(block_q=8, block_k=8 if mask_kind == "triangular" else 16)

  def fn(q, k, v):
    return blockwise.blockwise_attention(q, k, v, scale=SCALE, mask=mask, local_window_size=(4, 0), **blocks)

  out = np.asarray(fn(q, k, v))
  assert np.isnan(out[:, :5]).any()  # key 0 is seen by queries 0..4
  assert np.isfinite(out[:, 24:]).all()
  dq = jax.grad(lambda q: jnp.sum(fn(q, k, v) * w))(q)
  assert np.isfinite(np.asarray(dq)[:, 24:]).all()


def test_cpu_kernel_skips_keys_outside_the_window():
  """The C++ kernel computes a query block's scores only over the keys its window reaches: a NaN
  value in key 0 stays out of query blocks (64 rows) that start past the window, in the output and dq."""
  from jaxpe.attention import cpu_flash

  t = 160
  q, k, v, w = _data(t)
  v = v.copy()
  v[:, 0] = np.nan

  def fn(q):
    return cpu_flash.cpu_flash_attention(q, k, v, scale=SCALE, causal=True, local_window_size=(4, 0))

  out = np.asarray(fn(q))
  assert np.isnan(out[:, :5]).any()
  assert np.isfinite(out[:, 64:]).all()
  dq = jax.grad(lambda q: jnp.sum(fn(q) * w))(q)
  assert np.isfinite(np.asarray(dq)[:, 64:]).all()


@pytest.mark.parametrize("strategy", ["ring"])
def test_context_parallel_zigzag(strategy):
  """context_attention over 4 fake CPU devices in zig-zag order: the window, chunks and cap compare
  the original slots; values and gradients against the float64 reference in slot order (the ring:
  each step's key shard skipped by blockwise's dynamic need when the window cannot reach it; the
  all-gather strategy shares its per-shard blockwise call)."""
  from jaxpe.attention import context

  t, shards = 32, 4
  q, k, v, w = _data(t)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:shards]), ("context",))
  opts = OPTIONS["all"]
  valid = np.ones((B, t), bool)
  valid[1, :3] = False
  pos = np.broadcast_to(np.arange(t), (B, t))
  allowed = _allowed(pos, pos, causal=True, k_valid=valid, **_pattern(opts))

  def fn(q, k, v):
    z = lambda x: context.to_zigzag(x, shards)  # noqa: E731
    slots = z(jnp.asarray(pos, jnp.int32))
    mask = IndexMask(slots, slots, causal=True, k_valid=z(valid))
    out = context.context_attention(
      z(q), z(k), z(v), scale=SCALE, mesh=mesh, strategy=strategy, mask=mask, **opts
    )  # fmt: skip
    return context.from_zigzag(out, shards)

  real = valid[:, :, None, None].astype(np.float32)
  _check(fn, q, k, v, w, allowed, cap=opts["logits_soft_cap"], real_rows=real)
