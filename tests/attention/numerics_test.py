"""The numeric rules every attention backend shares (``jaxpe.attention.numerics``), each backend
against one numpy float64 reference:

- hidden keys do not matter: NaN planted in the keys and values of padding keys (``k_valid``
  False) or of causal slots after every query changes nothing, forward and gradients;
- a NaN score is not an empty row: a NaN query row gives NaN (the dense reference's rule), not the
  zeros of a row with no visible key, and the other rows stay exact;
- wide document ids are compared exactly: int64 ids 0 and 2^32 are two documents;
- the CPU kernel's long sums (over 2^20 keys, over 2^20 queries in the gradients) stay float32-exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxpe.attention import (
  AttentionMask,
  IndexMask,
  PositionBias,
  attention,
  blockwise_attention,
  context,
  cpu_flash,
  cpu_flash_attention,
  dot_product_attention,
)

B, T, N, H = 2, 8, 2, 4
SCALE = 0.5
kernel = pytest.mark.skipif(not cpu_flash.available(), reason="no C++ compiler: the kernel is not built")


def np_attention(q, k, v, visible, scale=SCALE):
  """float64 reference: ``[B, T, N, H]``; ``visible [B, T, S]``; hidden keys never touch the sums (a
  key's value enters only where visible), a row with no visible key gives zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  vis = np.asarray(visible, bool)[:, None]  # [B, 1, T, S]
  with np.errstate(invalid="ignore", over="ignore"):
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    s = np.where(vis, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = p.sum(-1, keepdims=True)
    p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
    p = np.where(np.isnan(top), np.nan, p)
    out = np.where(vis[..., None], p[..., None] * np.moveaxis(v, 2, 1)[:, :, None], 0.0).sum(-2)
  return np.moveaxis(out, 1, 2)  # [B, T, N, H]


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, T, N, H)).astype(np.float32)
  v = rng.standard_normal((B, T, N, H)).astype(np.float32)
  return q, k, v


def _slots():
  return np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))


def _mesh():
  return Mesh(np.asarray(jax.devices()[:4]), ("context",))


def run(backend, q, k, v, *, causal=False, valid=None, seg=None):
  """``backend``'s attention of q, k, v (self-attention, T == S) under padding ``valid [B, T]`` and
  document ids ``seg [B, T]`` (any integer dtype, passed as given)."""
  am = AttentionMask(valid=valid, segment_ids=seg, causal=causal)
  im = IndexMask(_slots(), _slots(), causal, valid, seg, seg)
  if backend == "reference":
    return dot_product_attention(q, k, v, scale=SCALE, mask=am.dense(B, T))
  if backend == "xla":  # on the CPU: the kernel (float32, an AttentionMask)
    return attention(q, k, v, scale=SCALE, mask=am, implementation="xla")
  if backend == "loops":
    return blockwise_attention(q, k, v, scale=SCALE, mask=im, block_q=4, block_k=4)
  if backend == "decode":  # T <= DECODE_MAX_QUERIES under an IndexMask: one pass
    return attention(q, k, v, scale=SCALE, mask=im, implementation="xla")
  if backend == "cpu_flash":
    return cpu_flash_attention(
      q, k, v, scale=SCALE, causal=causal, k_valid=valid, q_segment_ids=seg, k_segment_ids=seg
    )
  if backend == "flash":
    return attention(q, k, v, scale=SCALE, mask=am, implementation="flash", interpret=True)
  if backend in ("ring", "all_gather"):
    return context.context_attention(q, k, v, scale=SCALE, mesh=_mesh(), strategy=backend, mask=im)
  raise AssertionError(backend)


BACKENDS = [
  "reference",
  pytest.param("xla", marks=kernel),
  "loops",
  "decode",
  pytest.param("cpu_flash", marks=kernel),
  "flash",
  "ring",
  "all_gather",
]


def _visible(valid=None, seg=None, causal=False):
  vis = np.ones((B, T, T), bool)
  if causal:
    vis &= np.tril(np.ones((T, T), bool))[None]
  if valid is not None:
    vis &= np.asarray(valid, bool)[:, None, :]
  if seg is not None:
    vis &= np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :]
  return vis


def _with_causal(backends):
  # the context strategies compile a shard_map each (~20 s with gradients): causal only
  out = []
  for b in backends:
    name = b if isinstance(b, str) else b.values[0]
    marks = () if isinstance(b, str) else b.marks
    for causal in (False, True) if name not in ("ring", "all_gather") else (True,):
      out.append(pytest.param(name, causal, marks=marks, id=f"{name}-{causal}"))
  return out


@pytest.mark.parametrize("backend, causal", _with_causal(BACKENDS))
def test_nan_at_padding_keys_changes_nothing(backend, causal):
  q, k, v = _inputs()
  valid = np.ones((B, T), bool)
  valid[0, 5:] = False  # right padding in row 0, a padding key inside row 1
  valid[1, 2] = False
  kn, vn = k.copy(), v.copy()
  kn[~valid], vn[~valid] = np.nan, np.inf
  vn[0, 6] = np.nan
  want = np_attention(q, k, v, _visible(valid, causal=causal))
  got = np.asarray(run(backend, q, kn, vn, causal=causal, valid=valid), np.float64)
  rows = valid  # padding query rows are not specified (fused kernels give zeros)
  np.testing.assert_allclose(got[rows], want[rows], rtol=2e-5, atol=2e-6)

  if backend in ("ring", "all_gather"):
    return  # their gradients run the same blockwise calls (and compile for ~20 s more each)
  weights = np.random.default_rng(1).standard_normal((B, T, N, H)).astype(np.float32) * rows[:, :, None, None]

  def loss(q, k, v):
    return jnp.sum(run(backend, q, k, v, causal=causal, valid=valid).astype(jnp.float32) * weights)

  grads = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn))
  clean = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  for name, g, c in zip("qkv", grads, clean, strict=True):
    g, c = np.asarray(g), np.asarray(c)
    keep = rows if name == "q" else valid  # hidden keys' gradients: 0 (where) or unspecified
    assert np.all(np.isfinite(g[keep])), name
    np.testing.assert_allclose(g[keep], c[keep], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", ["loops", "decode", "ring"])
def test_nan_in_cache_slots_after_every_query_changes_nothing(backend):
  # a KV cache: queries at slots 4..5 of 8; slots 6, 7 unfilled (after every query), holding NaN
  q, k, v = _inputs()
  q = q[:, :2] if backend != "ring" else q[:, :4]
  t_len = q.shape[1]
  q_index = np.broadcast_to(np.arange(4, 4 + t_len, dtype=np.int32), (B, t_len))
  if backend == "ring":  # T = 4 queries over 4 shards need their own slots: 2..5
    q_index = np.broadcast_to(np.arange(2, 2 + t_len, dtype=np.int32), (B, t_len))
  kn, vn = k.copy(), v.copy()
  kn[:, 6:], vn[:, 6:] = np.nan, np.nan
  im = IndexMask(q_index, _slots(), True)
  vis = q_index[:, :, None] >= _slots()[:, None, :]
  want = np_attention(q, k, v, vis)
  if backend == "loops":
    got = blockwise_attention(q, kn, vn, scale=SCALE, mask=im, block_q=2, block_k=4)
  elif backend == "decode":
    got = attention(q, kn, vn, scale=SCALE, mask=im, implementation="xla")
  else:
    got = context.context_attention(q, kn, vn, scale=SCALE, mesh=_mesh(), strategy="ring", mask=im)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_row_gives_nan_not_zeros(backend):
  q, k, v = _inputs()
  qn = q.copy()
  qn[0, 3] = np.nan  # both heads of query 3 in row 0
  want = np_attention(qn, k, v, _visible())
  got = np.asarray(run(backend, qn, k, v), np.float64)
  assert np.all(np.isnan(got[0, 3])), got[0, 3]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)  # NaN where want is NaN, exact elsewhere


@pytest.mark.parametrize("blocks", [None, 4])
def test_nan_position_bias_gives_nan_not_zeros(blocks):
  # a learned bias gone non-finite (FIRE with c = inf: log(inf) / log(inf)) must not switch attention off
  q, k, v = _inputs()
  pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))

  def fn(params, q_pos, k_pos):
    bad = jnp.where(q_pos[:, :, None] == 3, params, jnp.float32(0.0))  # NaN on query 3's row, 0 elsewhere
    bad = jnp.broadcast_to(bad, (q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]))
    return jnp.broadcast_to(bad[:, None], (q_pos.shape[0], N, q_pos.shape[1], k_pos.shape[1]))

  bias = PositionBias(fn, jnp.float32(np.nan), pos, pos)
  got = np.asarray(
    blockwise_attention(q, k, v, scale=SCALE, position_bias=bias, block_q=blocks, block_k=blocks)
  )
  assert np.all(np.isnan(got[:, 3])), got[:, 3]
  others = np.delete(np.arange(T), 3)
  want = np_attention(q, k, v, _visible())
  np.testing.assert_allclose(got[:, others], want[:, others], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_segment_ids_zero_and_two_to_the_32_are_two_documents(backend):
  q, k, v = _inputs()
  seg = np.zeros((B, T), np.int64)
  seg[:, 4:] = 2**32  # int32 would wrap it to 0: one document
  want = np_attention(q, k, v, _visible(seg=seg, causal=True))
  got = np.asarray(run(backend, q, k, v, causal=True, seg=seg), np.float64)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "fire"])  # the CPU kernel, with ALiBi, the loops
def test_decoder_int64_segment_ids_and_nan_at_padding_under_jit(encoding):
  from flax import nnx

  from jaxpe.model.config import ModelConfig
  from jaxpe.model.decoder import Decoder

  cfg = ModelConfig(vocab_size=16, d_model=16, num_layers=2, num_heads=2, init_std=0.5, pos_encoding=encoding)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  tokens = np.asarray([[1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
  wide = np.asarray([[0] * 4 + [2**32] * 4], np.int64)
  two = np.asarray([[0] * 4 + [1] * 4], np.int32)
  one = np.zeros((1, 8), np.int32)
  got = np.asarray(model(tokens, segment_ids=wide))
  np.testing.assert_allclose(got, np.asarray(model(tokens, segment_ids=two)), rtol=1e-6, atol=1e-6)
  assert np.max(np.abs(got - np.asarray(model(tokens, segment_ids=one)))) > 1e-3  # the ids matter

  # under jit an out-of-range token id embeds as NaN: at a padding slot it must change nothing
  step = nnx.jit(lambda m, t, mask: m(t, attention_mask=mask))
  mask = np.ones((1, 8), bool)
  mask[0, 5] = False
  clean = np.asarray(step(model, tokens, mask))
  planted = tokens.copy()
  planted[0, 5] = cfg.vocab_size  # NaN embedding
  dirty = np.asarray(step(model, planted, mask))
  assert np.isnan(dirty[0, 5]).all()  # the planted row itself
  np.testing.assert_allclose(dirty[0, mask[0]], clean[0, mask[0]], rtol=1e-6, atol=1e-6)


def test_decoder_nan_in_unfilled_cache_slots_changes_nothing():
  from flax import nnx

  from jaxpe.model.cache import init_cache
  from jaxpe.model.config import ModelConfig
  from jaxpe.model.decoder import Decoder

  cfg = ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2, init_std=0.5)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  _, cache = model(jnp.asarray([[1, 2, 3]]), cache=init_cache(cfg, 1, 8))
  step = nnx.jit(lambda m, t, c: m(t, cache=c)[0])
  clean = np.asarray(step(model, jnp.asarray([[4]]), cache))
  poisoned = cache._replace(
    k=tuple(x.at[:, :, 3:].set(jnp.nan) for x in cache.k),
    v=tuple(x.at[:, :, 3:].set(jnp.nan) for x in cache.v),
  )
  np.testing.assert_array_equal(np.asarray(step(model, jnp.asarray([[4]]), poisoned)), clean)


def test_decoder_cache_position_past_int32_raises():
  from flax import nnx

  from jaxpe.model.cache import init_cache
  from jaxpe.model.config import ModelConfig
  from jaxpe.model.decoder import Decoder

  cfg = ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  _, cache = model(jnp.asarray([[1]]), positions=jnp.asarray([[2**31 - 2]]), cache=init_cache(cfg, 1, 4))
  _, cache = model(jnp.asarray([[2]]), cache=cache)  # position 2^31 - 1: the last one
  np.testing.assert_array_equal(np.asarray(cache.positions[0, :2]), [2**31 - 2, 2**31 - 1])
  with pytest.raises(ValueError, match="would pass 2\\^31 - 1"):
    model(jnp.asarray([[3]]), cache=cache)
  step = nnx.jit(lambda m, t, c: m(t, cache=c))
  with pytest.raises(Exception, match="would pass 2\\^31 - 1"):  # jitted: when the call runs
    jax.block_until_ready(step(model, jnp.asarray([[3]]), cache))


def test_fire_distances_exact_past_two_to_the_24():
  from jaxpe.ops.fire import fire_interpolation

  q_pos = np.asarray([[2**24 + 1, 2**30 + 3]], np.int64)
  k_pos = np.asarray([[2**24, 2**30]], np.int64)
  c, threshold = 0.1, 512.0
  got = np.asarray(fire_interpolation(q_pos, k_pos, c=jnp.float32(c), threshold=jnp.float32(threshold)))
  rel = q_pos[:, :, None].astype(np.float64) - k_pos[:, None, :]
  norm = np.maximum(q_pos.astype(np.float64), threshold)[:, :, None]
  want = np.log(np.abs(c * rel) + 1) / (np.log(c * norm + 1) + 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@kernel
def test_cpu_kernel_long_sums_stay_float32_exact():
  # 2^20 keys of value 0.1 and equal scores: the output is their mean, 0.1 (one float32 accumulator
  # over every key was 1% off); the XLA loops sum per key block and stay within 4e-5
  s_len = 2**20
  q = jnp.zeros((1, 1, 1, 16), jnp.float32)
  k = jnp.zeros((1, s_len, 1, 16), jnp.float32)
  v = jnp.full((1, s_len, 1, 16), 0.1, jnp.float32)
  want = float(np.float32(0.1))
  out = float(cpu_flash_attention(q, k, v, scale=1.0)[0, 0, 0, 0])
  loops = float(blockwise_attention(q, k, v, scale=1.0, block_q=1, block_k=4096)[0, 0, 0, 0])
  assert abs(out - want) / want < 1e-5, out
  assert abs(out - want) <= abs(loops - want), (out, loops)

  # gradients: dv and dk sum over 2^20 queries, dq over 2^20 keys (closed forms below)
  t_len = 2**20
  dq_ones = jnp.ones((1, t_len, 1, 16), jnp.float32)
  q2 = jnp.full((1, t_len, 1, 16), 0.01, jnp.float32)  # k = 0: every score 0, P = 1/2 over 2 keys
  k2 = jnp.zeros((1, 2, 1, 16), jnp.float32)
  v2 = jnp.stack([jnp.full((16,), 0.1), jnp.full((16,), 0.3)])[None, :, None].astype(jnp.float32)
  _, vjp = jax.vjp(lambda q, k, v: cpu_flash_attention(q, k, v, scale=1.0), q2, k2, v2)
  _, dk, dv = vjp(dq_ones)
  # dv_s = sum_t P_ts dO_t = T / 2; dk_s = sum_t P_ts (dO.v_s - dO.out) q_t = T/2 * 16 (v_s - 0.2) * 0.01
  np.testing.assert_allclose(np.asarray(dv)[0, :, 0, 0], [t_len / 2] * 2, rtol=1e-5)
  want_dk = [t_len / 2 * 16 * (0.1 - 0.2) * 0.01, t_len / 2 * 16 * (0.3 - 0.2) * 0.01]
  np.testing.assert_allclose(np.asarray(dk)[0, :, 0, 0], want_dk, rtol=1e-4)

  # dq = sum_s P_s (dO.v_s - dO.out) k_s over 2^20 keys, k_s = 1 on odd s (v 0.3), 0 on even (v 0.1)
  odd = (np.arange(s_len) % 2).astype(np.float32)
  k3 = jnp.asarray(np.broadcast_to(odd[None, :, None, None], (1, s_len, 1, 16)))
  v3 = jnp.asarray(np.broadcast_to((0.1 + 0.2 * odd)[None, :, None, None], (1, s_len, 1, 16)))
  _, vjp = jax.vjp(lambda q: cpu_flash_attention(q, k3, v3, scale=1.0), q)
  (dq,) = vjp(jnp.ones((1, 1, 1, 16), jnp.float32))
  np.testing.assert_allclose(np.asarray(dq)[0, 0, 0], np.full(16, 0.5 * 16 * 0.1), rtol=1e-4)


def test_zigzag_inputs_keep_int64_documents_apart():
  from jaxpe.model.partitioning import zigzag_inputs

  tokens = np.zeros((1, 8), np.int32)
  wide = np.asarray([[0] * 4 + [2**32] * 4], np.int64)
  got = zigzag_inputs(tokens, 2, segment_ids=wide)
  order = context.zigzag_order(8, 2)
  ids = np.asarray(got["segment_ids"])[0]
  np.testing.assert_array_equal(
    ids[:, None] == ids[None, :], wide[0, order][:, None] == wide[0, order][None, :]
  )
  np.testing.assert_array_equal(np.asarray(got["positions"])[0], np.asarray([0, 1, 2, 3, 0, 1, 2, 3])[order])


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_nan_at_padding_keys_fused_kernels_interpret(impl):
  # the fused kernels (interpret mode) at their block size: padding keys hold NaN
  rng = np.random.default_rng(2)
  q, k, v = (rng.standard_normal((1, 128, 2, 64)).astype(np.float32) for _ in range(3))
  valid = np.ones((1, 128), bool)
  valid[0, 100:] = False
  kn, vn = k.copy(), v.copy()
  kn[~valid], vn[~valid] = np.nan, np.nan
  mask = AttentionMask(valid=valid, causal=True)
  got = np.asarray(attention(q, kn, vn, scale=0.125, mask=mask, implementation=impl, interpret=True))
  vis = np.tril(np.ones((128, 128), bool))[None] & valid[:, None, :]
  want = np_attention(q, k, v, vis, scale=0.125)
  np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-6)
