"""``PositionBias`` (T5, Kerple, FIRE) in the blockwise attention against float64 numpy and the
dense reference: forward and gradients in q, k, v and the bias parameters, GQA, padding, packing,
the KV cache; ``attention`` on xla (blockwise and dense) and its refusal on fused kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import PositionBias, blockwise, kernels, masks, reference
from jaxpe.ops import fire, relative_bias

RNG = np.random.default_rng(11)


def _rand(shape, scale=1.0):
  return jnp.asarray(RNG.normal(size=shape) * scale, jnp.float32)


def _t5(params, q_pos, k_pos):
  return relative_bias.t5_bias(params["table"], q_pos, k_pos, bidirectional=False, max_distance=20)


def _kerple(params, q_pos, k_pos):
  return relative_bias.kerple_log_bias(params["r1"], params["r2"], q_pos, k_pos)


def _fire(params, q_pos, k_pos):
  return fire.fire_bias(q_pos, k_pos, **params)


def _params(kind, n):
  if kind == "t5":
    return {"table": _rand((8, n))}
  if kind == "kerple":
    return {
      "r1": jnp.asarray(RNG.uniform(0.1, 2, n), jnp.float32),
      "r2": jnp.asarray(RNG.uniform(0.1, 1, n), jnp.float32),
    }
  return {
    "w1": _rand((5,)),
    "b1": _rand((5,)),
    "w2": _rand((5, n)),
    "b2": _rand((n,)),
    "c": jnp.float32(0.3),
    "threshold": jnp.float32(12.0),
  }


def _bias64(kind, params, q_pos, k_pos):
  """The bias from the papers' formulas in float64 (T5: the bucket table lookup)."""
  p = {name: np.asarray(x, np.float64) for name, x in params.items()}
  q, k = np.asarray(q_pos, np.float64)[:, :, None], np.asarray(k_pos, np.float64)[:, None, :]
  if kind == "t5":
    buckets = np.asarray(
      relative_bias.t5_relative_position_bucket(
        np.asarray(k_pos)[:, None, :] - np.asarray(q_pos)[:, :, None],
        bidirectional=False,
        num_buckets=8,
        max_distance=20,
      )
    )
    return np.moveaxis(p["table"][buckets], 3, 1)
  if kind == "kerple":
    return -p["r1"][None, :, None, None] * np.log1p(p["r2"][None, :, None, None] * np.abs(q - k)[:, None])
  x = np.log(np.abs(p["c"] * (q - k)) + 1) / (
    np.log(np.abs(p["c"] * np.maximum(q, abs(p["threshold"]))) + 1) + 1e-6
  )
  hidden = np.maximum(x[..., None] * p["w1"] + p["b1"], 0)
  return np.moveaxis(hidden @ p["w2"] + p["b2"], 3, 1)


def _numpy_attention(q, k, v, scale, bias, visible):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale + bias
  vis = np.broadcast_to(visible, s.shape)
  s = np.where(vis, s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  seen = np.isfinite(top)
  e = np.where(vis, np.exp(s - np.where(seen, top, 0.0)), 0.0)
  p = np.where(seen, e / np.where(seen, e.sum(-1, keepdims=True), 1.0), 0.0)
  return np.einsum("bnts,bsnh->btnh", p, v)


def _mask(kind, b, t, s):
  """(mask, dense visibility [B, 1, T, S], q_positions, k_positions)."""
  if kind in ("causal", "packed"):  # packed: padding tokens too
    valid = jnp.asarray(RNG.random((b, t)) > 0.3) if kind == "packed" else None
    ids = jnp.asarray(np.sort(RNG.integers(0, 3, (b, t)), axis=1), jnp.int32) if kind == "packed" else None
    mask = masks.AttentionMask(valid=valid, segment_ids=ids, causal=True)
    pos = jnp.asarray(np.cumsum(RNG.integers(0, 3, (b, t)), axis=1), jnp.int32)  # repeats and gaps
    return mask, np.asarray(mask.dense(b, t)), pos, pos
  end = s - t - 3  # the KV cache: T queries at slots end.., some slots empty
  q_index = jnp.broadcast_to(end + jnp.arange(t, dtype=jnp.int32), (b, t))
  k_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  k_valid = jnp.asarray((RNG.random((b, s)) > 0.2) & (np.arange(s) < end + t))
  mask = masks.IndexMask(q_index, k_index, causal=True, k_valid=k_valid)
  return mask, np.asarray(mask.dense()), q_index + 2, k_index + 2


CASES = [
  # bias, mask kind, B, T, S, N, K, block_q, block_k
  ("kerple", "causal", 1, 40, 40, 4, 2, 8, 8),  # triangular loops, GQA
  ("fire", "packed", 2, 21, 21, 3, 1, 8, 8),  # MQA, padding and segments, T not a multiple of 8
  ("t5", "cache", 2, 5, 40, 4, 2, 4, 16),  # the KV cache (dynamic skip of empty blocks)
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_blockwise_position_bias_matches_float64_and_the_dense_reference(case):
  kind, mask_kind, b, t, s, n, kv, bq, bk = case
  h, scale = 8, 1.0 / np.sqrt(8)
  q, k, v = _rand((b, t, n, h)), _rand((b, s, kv, h)), _rand((b, s, kv, h))
  mask, visible, q_pos, k_pos = _mask(mask_kind, b, t, s)
  fn = {"t5": _t5, "kerple": _kerple, "fire": _fire}[kind]
  params = _params(kind, n)
  dense_mask = jnp.asarray(visible)
  cot = _rand((b, t, n, h))

  def fast(q, k, v, params):
    bias = PositionBias(fn, params, q_pos, k_pos)
    return blockwise.blockwise_attention(
      q, k, v, scale=scale, mask=mask, position_bias=bias, block_q=bq, block_k=bk
    )

  def slow(q, k, v, params):
    return reference.dot_product_attention(
      q, k, v, scale=scale, mask=dense_mask, bias=fn(params, q_pos, k_pos)
    )

  def fast_and_grads(*args):  # one compile: output and gradients
    out, vjp = jax.vjp(fast, *args)
    return out, vjp(cot)

  out, got = jax.jit(fast_and_grads)(q, k, v, params)
  want = _numpy_attention(q, k, v, scale, _bias64(kind, params, q_pos, k_pos), visible)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(out, jax.jit(slow)(q, k, v, params), atol=1e-5, rtol=1e-5)

  ref = jax.jit(jax.grad(lambda *a: jnp.sum(slow(*a) * cot), argnums=(0, 1, 2, 3)))(q, k, v, params)
  for name, g, w in zip("qkv", got[:3], ref[:3]):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)
  assert max(np.abs(np.asarray(w)).max() for w in ref[3].values()) > 1e-2  # the bias matters here
  for name in params:
    g, w = np.asarray(got[3][name]), np.asarray(ref[3][name])
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, np.abs(w).max()), rtol=1e-5, err_msg=name)


def test_attention_entry_point_blockwise_dense_and_fused_refusal():
  b, t, n, h = 2, 12, 2, 4
  q, k, v = _rand((b, t, n, h)), _rand((b, t, n, h)), _rand((b, t, n, h))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  params = _params("kerple", n)
  spec = PositionBias(_kerple, params, pos, pos)
  causal = masks.AttentionMask(causal=True)
  dense = causal.dense(b, t)
  want = reference.dot_product_attention(q, k, v, scale=0.5, mask=dense, bias=_kerple(params, pos, pos))
  got_blockwise = jax.jit(lambda q: kernels.attention(q, k, v, scale=0.5, mask=causal, position_bias=spec))(q)
  got_dense = kernels.attention(
    q, k, v, scale=0.5, mask=dense, position_bias=spec
  )  # a dense mask: dense path
  np.testing.assert_allclose(got_blockwise, want, atol=1e-5)
  np.testing.assert_allclose(got_dense, want, atol=1e-6)
  with pytest.raises(ValueError, match="'splash' takes no bias tensor: a PositionBias \\(T5, Kerple, FIRE"):
    kernels.attention(
      q, k, v, scale=0.5, mask=causal, position_bias=spec, implementation="splash", interpret=True
    )
  with pytest.raises(ValueError, match="must return \\[B, N, T, S\\]"):
    kernels.attention(q, k, v, scale=0.5, position_bias=PositionBias(_kerple, _params("kerple", 3), pos, pos))
  with pytest.raises(ValueError, match="PositionBias.k_positions must have shape"):
    kernels.attention(q, k, v, scale=0.5, position_bias=PositionBias(_kerple, params, pos, pos[:, :5]))
  with pytest.raises(TypeError, match="position_bias must be a PositionBias"):
    kernels.attention(q, k, v, scale=0.5, position_bias=_kerple)
