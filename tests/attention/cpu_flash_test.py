"""The fused CPU attention kernel (``jaxpe.attention.cpu_flash``) against a float64 numpy reference:
the output, the log-sum-exp and the closed-form gradients (dq, dk, dv from dO and d lse) for every
option the kernel takes, alone and combined; second derivatives, jax.vmap and shardings against the
dense jax reference; the errors; and that ``blockwise_attention`` takes the kernel where it applies
and its XLA loops where not, and works without the kernel."""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpe.attention import blockwise, context, cpu_flash, masks, reference
from jaxpe.attention.backends import AlibiSpec

pytestmark = pytest.mark.skipif(not cpu_flash.available(), reason="no C++ compiler: the kernel is not built")
# (A machine without a compiler runs the XLA loops; test_unavailable_kernel_falls_back covers it.)

LOWEST = np.finfo(np.float32).min


def numpy_attention(
  q, k, v, *, scale, causal, precise, valid=None, q_seg=None, k_seg=None, slopes=None, q_pos=None, k_pos=None
):
  """float64 ``(out, lse, grads)`` where ``grads(d_out, d_lse) -> (dq, dk, dv)`` in closed form."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, hq = q.shape
  s_len, kv = k.shape[1], k.shape[2]
  g = n // kv
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # [B, S, N, .]
  split = hq - precise
  sc = np.einsum("btnh,bsnh->bnts", q[..., :split], kr[..., :split])
  sc = (sc + np.einsum("btnh,bsnh->bnts", q[..., split:], kr[..., split:])) * scale
  if slopes is not None:
    dist = np.asarray(q_pos, np.float64)[:, :, None] - np.asarray(k_pos, np.float64)[:, None, :]
    sc = sc - np.asarray(slopes, np.float64)[None, :, None, None] * dist[:, None]
  vis = np.ones((b, 1, t, s_len), bool)
  if causal:
    vis &= np.tril(np.ones((t, s_len), bool))[None, None]
  if valid is not None:
    vis &= np.asarray(valid)[:, None, None, :]
  if q_seg is not None:
    vis &= (np.asarray(q_seg)[:, :, None] == np.asarray(k_seg)[:, None, :])[:, None]
  sc = np.where(vis, sc, -np.inf)
  m = sc.max(-1, keepdims=True)
  seen = np.isfinite(m)
  e = np.where(vis, np.exp(sc - np.where(seen, m, 0)), 0.0)
  total = e.sum(-1, keepdims=True)
  p = np.where(seen, e / np.where(seen, total, 1), 0.0)  # [B, N, T, S]
  out = np.einsum("bnts,bsnh->btnh", p, vr)
  lse = np.where(seen[..., 0], (m + np.log(np.where(seen, total, 1)))[..., 0], -np.inf).transpose(0, 2, 1)

  def grads(d_out, d_lse):
    d_out, d_lse = np.asarray(d_out, np.float64), np.asarray(d_lse, np.float64)
    dv = np.einsum("bnts,btnh->bsnh", p, d_out).reshape(b, s_len, kv, g, -1).sum(3)
    dp = np.einsum("btnh,bsnh->bnts", d_out, vr)
    delta = (d_out * out).sum(-1).transpose(0, 2, 1)[..., None] - d_lse.transpose(0, 2, 1)[..., None]
    ds = p * (dp - delta) * scale
    dq = np.einsum("bnts,bsnh->btnh", ds, kr)
    dk = np.einsum("bnts,btnh->bsnh", ds, q).reshape(b, s_len, kv, g, -1).sum(3)
    return dq, dk, dv

  return out, lse, grads


def _case(
  seed, *, b=2, t=70, s=None, n=4, kv=2, h=20, precise=0, causal=True, valid=False, seg=False, alibi=False
):
  rng = np.random.default_rng(seed)
  s = t if s is None else s
  hq = h + precise
  q = rng.normal(size=(b, t, n, hq)).astype(np.float32)
  k = rng.normal(size=(b, s, kv, hq)).astype(np.float32)
  v = rng.normal(size=(b, s, kv, h)).astype(np.float32)
  if precise:  # the emulation's position-sized dims: large, cancelling between q and k
    q[..., h:] = np.float32(300.0) * rng.normal(size=(b, t, n, precise)).astype(np.float32)
    k[..., h:] = np.float32(1e-2)
  kw = {}
  if valid:
    kw["k_valid"] = rng.random((b, s)) > 0.3
  if seg:
    kw["q_segment_ids"] = np.cumsum(rng.random((b, t)) < 0.1, axis=1).astype(np.int32)
    kw["k_segment_ids"] = (
      kw["q_segment_ids"] if s == t else np.cumsum(rng.random((b, s)) < 0.1, axis=1).astype(np.int32)
    )
  if alibi:
    kw["slopes"] = np.asarray([2.0 ** -(i + 1) for i in range(n)], np.float32)
    kw["q_positions"] = np.broadcast_to(np.arange(t, dtype=np.int32) + 5, (b, t))
    kw["k_positions"] = np.broadcast_to(np.arange(s, dtype=np.int32) + 5, (b, s))
  return q, k, v, dict(scale=float(h) ** -0.5, causal=causal, precise_dims=precise, **kw)


def _compare(q, k, v, kw, *, tol=1e-5):
  rng = np.random.default_rng(1)
  ref_kw = dict(
    scale=kw["scale"], causal=kw["causal"], precise=kw["precise_dims"], valid=kw.get("k_valid"),
    q_seg=kw.get("q_segment_ids"), k_seg=kw.get("k_segment_ids"), slopes=kw.get("slopes"),
    q_pos=kw.get("q_positions"), k_pos=kw.get("k_positions"),
  )  # fmt: skip
  out_ref, lse_ref, grads = numpy_attention(q, k, v, **ref_kw)
  fn = jax.jit(lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, return_lse=True, **kw))
  (out, lse), vjp = jax.vjp(fn, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  d_out = rng.normal(size=out.shape).astype(np.float32)
  d_lse = np.where(np.isfinite(lse_ref), rng.normal(size=lse.shape), 0).astype(np.float32)
  got = vjp((jnp.asarray(d_out), jnp.asarray(d_lse)))
  want = grads(d_out, d_lse)
  np.testing.assert_allclose(np.asarray(out), out_ref, atol=tol, rtol=tol)
  finite = np.isfinite(lse_ref)
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)  # -inf exactly on empty rows
  np.testing.assert_allclose(np.asarray(lse)[finite], lse_ref[finite], atol=tol, rtol=tol)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    scale = max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(np.asarray(g) / scale, w / scale, atol=tol, err_msg=name)


OPTIONS = ("causal", "valid", "seg", "alibi")


@pytest.mark.parametrize(
  "flags",
  list(itertools.product((False, True), repeat=4)),
  ids=lambda f: "-".join(o for o, x in zip(OPTIONS, f) if x) or "none",
)
def test_every_option_combination_matches_float64(flags):
  causal, valid, seg, alibi = flags
  q, k, v, kw = _case(0, causal=causal, valid=valid, seg=seg, alibi=alibi)
  _compare(q, k, v, kw)


@pytest.mark.parametrize(
  "shape",
  [
    dict(b=1, t=1, n=1, kv=1, h=8),  # one query, one key
    dict(b=2, t=64, n=8, kv=8, h=16),  # one whole block, no GQA
    dict(b=1, t=129, n=6, kv=2, h=7),  # a ragged last block, odd head dim, G = 3
    dict(b=3, t=200, n=4, kv=1, h=64),  # multi-query: every head shares one kv head
    dict(b=1, t=17, s=90, n=2, kv=1, h=16, causal=False),  # T != S (cross attention)
    dict(b=1, t=90, s=17, n=2, kv=2, h=33, causal=False, valid=True),
    dict(b=2, t=70, n=4, kv=2, h=20, precise=2, alibi=True),  # the rope_alibi emulation's dims
    dict(b=2, t=70, n=4, kv=4, h=20, precise=5, seg=True, valid=True),
  ],
  ids=lambda d: ",".join(f"{k}{v}" for k, v in d.items()),
)
def test_shapes_match_float64(shape):
  q, k, v, kw = _case(2, **shape)
  _compare(q, k, v, kw)


def test_rows_with_no_visible_key_give_zeros_and_zero_gradients():
  q, k, v, kw = _case(3, b=2, t=40, valid=True, seg=True)
  kw["k_valid"] = np.ones((2, 40), bool)
  kw["k_valid"][0, :] = False  # batch row 0: no key at all
  kw["k_valid"][1, 10:20] = False  # a document of row 1 whose keys are all padding
  kw["q_segment_ids"] = kw["k_segment_ids"] = np.repeat(np.arange(4, dtype=np.int32), 10)[None].repeat(2, 0)
  _compare(q, k, v, kw)
  out, lse = cpu_flash.cpu_flash_attention(q, k, v, return_lse=True, **kw)
  assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(out)[1, 10:20] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[0]))
  grads = jax.grad(lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, **kw).sum(), argnums=(0, 1, 2))(
    q, k, v
  )
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  assert np.all(np.asarray(grads[0])[0] == 0)


def test_long_positions_keep_the_emulation_dims_apart():
  # the RoPE-emulated ALiBi's last 2 dims are position-sized (m sqrt(H) i / theta ~ 1e5): summed
  # with the content they would round it to their ulp; the kernel sums them apart
  q, k, v, kw = _case(4, b=1, t=96, n=2, kv=2, h=16, precise=2)
  q[..., 16:] = np.float32(2.0e5)
  k[..., 16] = np.float32(1.0)
  k[..., 17] = np.float32(-1.0) + np.float32(1e-3) * np.arange(96, dtype=np.float32)[None, :, None]
  _compare(q, k, v, kw, tol=2e-5)


def test_second_derivatives_vmap_and_jit_match_the_dense_reference():
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(3, 2, 24, 4, 8)), jnp.float32)
  seg = jnp.asarray([[0] * 12 + [1] * 12, [0] * 24], jnp.int32)
  mask = masks.AttentionMask(causal=True, segment_ids=seg).dense(2, 24)

  def kernel(q):
    return cpu_flash.cpu_flash_attention(
      q, 0.5 * q, q, scale=0.3, causal=True, q_segment_ids=seg, k_segment_ids=seg
    )

  dense = lambda q: reference.dot_product_attention(q, 0.5 * q, q, scale=0.3, mask=mask)  # noqa: E731
  np.testing.assert_allclose(jax.vmap(kernel)(q), jax.vmap(dense)(q), atol=1e-5)
  first = lambda f: jax.jit(jax.vmap(jax.grad(lambda q: (f(q) ** 2).sum())))  # noqa: E731
  np.testing.assert_allclose(first(kernel)(q), first(dense)(q), atol=1e-4, rtol=1e-5)
  second = lambda f: jax.grad(lambda q: (jax.grad(lambda q: (f(q) ** 2).sum())(q) ** 2).sum())  # noqa: E731
  want = second(dense)(q[0])
  np.testing.assert_allclose(
    second(kernel)(q[0]) / jnp.abs(want).max(), want / jnp.abs(want).max(), atol=2e-6
  )


@pytest.mark.parametrize(
  "mesh_shape,spec",
  [((2, 4), P("data", None, "tensor", None)), ((8, 1), P("data")), ((1, 8), P(None, None, "tensor"))],
)
def test_sharded_over_batch_and_heads_matches_one_device_without_gathers(mesh_shape, spec):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set by conftest)")
  mesh = jax.make_mesh(mesh_shape, ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  q, k, v, kw = _case(6, b=8, t=48, n=8, kv=8, h=16, seg=True, alibi=True)
  loss = lambda q, k, v: (cpu_flash.cpu_flash_attention(q, k, v, **kw) ** 2).sum()  # noqa: E731
  want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  assert "all-gather" not in step.lower(*sharded).compile().as_text()
  got = step(*sharded)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


def _mesh(shape, names):
  if len(jax.devices()) < int(np.prod(shape)):
    pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set by conftest)")
  return jax.make_mesh(
    shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[: int(np.prod(shape))]
  )


@pytest.mark.parametrize(
  "case",
  [
    ("sequence", (4,), P(None, "x"), P(None, "x"), 4, 4),  # T split: gathered before the kernel
    ("q sequence only", (4,), P(None, "x"), P(), 4, 4),
    ("head dim", (4,), P(None, None, None, "x"), P(None, None, None, "x"), 4, 4),
    ("gqa, 8 heads over 8, K 1", (8,), P(None, None, "x"), P(), 8, 1),  # dk, dv: no partial sums
    ("gqa, 4 heads over 2, K 1", (2,), P(None, None, "x"), P(), 4, 1),
    ("gqa, 8 heads over 4, K 2", (4,), P(None, None, "x"), P(), 8, 2),  # 4 does not divide K
    ("gqa, 8 heads over 2, K 2", (2,), P(None, None, "x"), P(None, None, "x"), 8, 2),  # whole groups
  ],
  ids=lambda c: c[0],
)
def test_any_sharding_gives_the_unsharded_values_and_gradients(case):
  _, mesh_shape, q_spec, kv_spec, n, kv = case
  mesh = _mesh(mesh_shape, ("x",))
  q, k, v, kw = _case(9, b=2, t=16, n=n, kv=kv, h=8, seg=True)
  kw.pop("precise_dims")

  def loss(q, k, v):
    return jnp.sum(jnp.sin(cpu_flash.cpu_flash_attention(q, k, v, **kw)))

  want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  args = [
    jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in ((q, q_spec), (k, kv_spec), (v, kv_spec))
  ]
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for name, g, w in zip("qkv", got[1], want[1]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize(
  "mesh_shape,names,spec,kv,n,batch",
  [
    ((1, 8), ("data", "tensor"), P(None, "tensor"), 8, 8, 2),  # a size-1 axis, neither dim split
    ((4, 2), ("data", "tensor"), P("data", None, "tensor"), 2, 8, 4),  # 4 does not divide K, unused for heads
    ((2, 4), ("data", "tensor"), P(("tensor", "data")), 8, 8, 8),  # batch over axes out of mesh order
    ((2, 4), ("data", "tensor"), P(("data", "tensor")), 8, 8, 8),
  ],
  ids=[
    "size-1 axis",
    "kv heads over tensor, data 4",
    "batch over (tensor, data)",
    "batch over (data, tensor)",
  ],
)
def test_splits_over_whole_axes_stay_local(mesh_shape, names, spec, kv, n, batch):
  # values as unsharded; where batch and heads are split over whole mesh axes, no gather
  mesh = _mesh(mesh_shape, names)
  q, k, v, kw = _case(12, b=batch, t=32, n=n, kv=kv, h=8)
  kw.pop("precise_dims")
  fn = jax.jit(lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, **kw))
  want = fn(q, k, v)
  kv_spec = P(*(spec[:2] + (spec[2] if len(spec) > 2 and kv % mesh.shape["tensor"] == 0 else None,)))
  args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in ((q, spec), (k, kv_spec), (v, kv_spec))]
  np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(want), atol=1e-6)
  if mesh_shape[0] > 1:
    assert "all-gather" not in fn.lower(*args).compile().as_text()


def test_inside_a_partly_manual_shard_map_and_context_attention_without_mask():
  mesh = _mesh((2, 2, 2), ("data", "tensor", "context"))
  q, k, v, _ = _case(13, b=2, t=32, n=4, kv=4, h=8)
  want = reference.dot_product_attention(q, k, v, scale=0.35)
  spec = NamedSharding(mesh, P("data", "context", "tensor"))
  args = [jax.device_put(x, spec) for x in (q, k, v)]
  for strategy in ("all_gather", "ring"):
    got = jax.jit(
      lambda q, k, v, strategy=strategy: context.context_attention(
        q, k, v, scale=0.35, mesh=mesh, strategy=strategy
      )
    )(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=strategy)

  def local(q, k, v):
    return cpu_flash.cpu_flash_attention(q, k, v, scale=0.35, causal=True)

  mapped = jax.shard_map(
    local, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"), axis_names={"data"}, check_vma=False
  )
  np.testing.assert_allclose(np.asarray(jax.jit(mapped)(*args)), np.asarray(local(q, k, v)), atol=1e-6)


def test_nan_reaches_the_rows_it_touches_as_in_the_reference():
  q, k, v, _ = _case(10, b=1, t=6, n=2, kv=2, h=4)
  q[0, 2, 0, 0] = np.nan  # one query row
  k[0, 4, 1, 1] = np.nan  # one key of head 1: rows 4 and 5 of that head
  mask = masks.AttentionMask(causal=True)
  want = np.asarray(reference.dot_product_attention(q, k, v, scale=0.5, mask=mask.dense(1, 6)))
  out, lse = cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, causal=True, return_lse=True)
  np.testing.assert_array_equal(np.isnan(np.asarray(out)), np.isnan(want))
  assert np.isnan(np.asarray(out)).any()
  np.testing.assert_array_equal(np.isnan(np.asarray(lse)), np.isnan(want).any(-1))
  np.testing.assert_allclose(np.asarray(out)[~np.isnan(want)], want[~np.isnan(want)], atol=1e-6)


def test_side_arrays_are_checked_and_never_cast_into_each_other():
  q, k, v, _ = _case(11, b=1, t=4, n=1, kv=1, h=4)
  two_docs = np.array([[0, 1, 0, 1]], np.int32)
  want = cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, q_segment_ids=two_docs, k_segment_ids=two_docs)
  for ids in (np.array([[0, 2**32, 0, 2**32]], np.int64), np.array([[7, 2**40, 7, 2**40]], np.uint64)):
    got = cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, q_segment_ids=ids, k_segment_ids=ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # ranked, not wrapped into one
  with pytest.raises(TypeError, match="q_segment_ids must be an integer array"):
    cpu_flash.cpu_flash_attention(
      q, k, v, scale=0.5, q_segment_ids=two_docs * 0.5, k_segment_ids=two_docs * 0.5
    )
  with pytest.raises(TypeError, match="k_valid must be a bool or integer array"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, k_valid=np.ones((1, 4), np.float32))
  pos = np.arange(4, dtype=np.int32)[None]
  with pytest.raises(TypeError, match="q_positions must be an integer array"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, slopes=[0.5], q_positions=pos * 1.0, k_positions=pos)
  with pytest.raises(ValueError, match=r"k_positions must be token indices in \[0, 2\^31\)"):
    cpu_flash.cpu_flash_attention(
      q, k, v, scale=0.5, slopes=[0.5], q_positions=pos, k_positions=pos.astype(np.int64) + 2**31
    )
  with pytest.raises(ValueError, match="slopes must be finite"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, slopes=[np.nan], q_positions=pos, k_positions=pos)


def test_bad_arguments_name_the_argument():
  q, k, v, kw = _case(7, t=10)
  with pytest.raises(TypeError, match="q must be float32"):
    cpu_flash.cpu_flash_attention(q.astype(jnp.bfloat16), k, v, scale=0.5)
  with pytest.raises(ValueError, match="causal needs T == S"):
    cpu_flash.cpu_flash_attention(q[:, :5], k, v, scale=0.5, causal=True)
  with pytest.raises(ValueError, match="q_segment_ids and k_segment_ids together"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, q_segment_ids=np.zeros((2, 10), np.int32))
  with pytest.raises(ValueError, match="slopes, q_positions and k_positions together"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, slopes=np.ones(4))
  with pytest.raises(ValueError, match=r"slopes must be \[N\]"):
    pos = np.zeros((2, 10), np.int32)
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, slopes=np.ones(3), q_positions=pos, k_positions=pos)
  with pytest.raises(ValueError, match=r"k_valid must have shape \[B, S\]"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, k_valid=np.ones((2, 9), bool))
  with pytest.raises(ValueError, match="scale"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.0)
  with pytest.raises(ValueError, match="precise_dims"):
    cpu_flash.cpu_flash_attention(q, k, v, scale=0.5, precise_dims=21)
  with pytest.raises(ValueError, match="N % K == 0"):
    cpu_flash.cpu_flash_attention(q[:, :, :3], k, v, scale=0.5)


def test_blockwise_takes_the_kernel_where_it_applies(monkeypatch):
  calls = []
  real = cpu_flash.cpu_flash_attention
  monkeypatch.setattr(cpu_flash, "cpu_flash_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  q, k, v, _ = _case(8, t=40)
  mask = masks.AttentionMask(causal=True)
  want = reference.dot_product_attention(q, k, v, scale=0.3, mask=mask.dense(2, 40))
  runs = {
    "kernel": dict(mask=mask),
    "no mask": dict(mask=None),
    "explicit blocks": dict(mask=mask, block_q=16, block_k=16),
    "index mask": dict(mask=blockwise.self_attention_mask(None, None, causal=True, batch=2, length=40)),
  }
  for name, extra in runs.items():
    calls.clear()
    out = blockwise.blockwise_attention(q, k, v, scale=0.3, **extra)
    assert len(calls) == (1 if name in ("kernel", "no mask") else 0), name
    if extra["mask"] is not None:
      np.testing.assert_allclose(out, want, atol=1e-5)
  calls.clear()
  out = blockwise.blockwise_attention(
    q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), scale=0.3, mask=mask
  )
  assert not calls and out.dtype == jnp.bfloat16
  calls.clear()
  slopes = np.full(4, 0.25)
  pos = np.broadcast_to(np.arange(40), (2, 40))
  alibi = AlibiSpec(slopes, pos, pos, max_position=40)
  out = blockwise.blockwise_attention(q, k, v, scale=0.3, mask=mask, alibi=alibi)
  bias = -0.25 * (pos[:, None, :, None] - pos[:, None, None, :]).astype(np.float32)
  want = reference.dot_product_attention(
    q, k, v, scale=0.3, mask=mask.dense(2, 40), bias=np.broadcast_to(bias, (2, 4, 40, 40))
  )
  assert len(calls) == 1
  np.testing.assert_allclose(out, want, atol=1e-5)


def test_unavailable_kernel_falls_back(tmp_path):
  # JAXPE_CPU_FLASH=0, and a compiler that fails (CXX=false, an empty cache): the reason is given,
  # blockwise_attention runs its XLA loops with the same result
  script = textwrap.dedent(
    """
    import numpy as np, jax, jax.numpy as jnp
    from jaxpe.attention import blockwise, context, cpu_flash, masks, reference
    print(cpu_flash.available(), "|", cpu_flash.unavailable_reason().splitlines()[0])
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 20, 2, 8)), jnp.float32)
    mask = masks.AttentionMask(causal=True)
    out = blockwise.blockwise_attention(q, q, q, scale=0.3, mask=mask)
    want = reference.dot_product_attention(q, q, q, scale=0.3, mask=mask.dense(1, 20))
    print(float(jnp.abs(out - want).max()) < 1e-5)
    try:
      cpu_flash.cpu_flash_attention(q, q, q, scale=0.3)
    except RuntimeError as err:
      print("RuntimeError:", str(err).splitlines()[0])
    """
  )
  for env, reason in (
    ({"JAXPE_CPU_FLASH": "0"}, "JAXPE_CPU_FLASH=0"),
    ({"PATH": "/nonexistent"}, "no C++ compiler"),
  ):
    full = {**os.environ, "JAXPE_CACHE_DIR": str(tmp_path / "cache"), "XLA_FLAGS": "", **env}
    if "CXX" not in env:
      full.pop("CXX", None)
    done = subprocess.run(
      [sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("False |") and reason in lines[0], lines
    assert lines[1] == "True" and lines[2].startswith(
      "RuntimeError: the CPU attention kernel is not available"
    ), lines


def test_failed_build_reports_the_compiler_message(tmp_path):
  fake = tmp_path / "cxx"
  fake.write_text("#!/bin/sh\necho 'fake compiler: cannot build' >&2\nexit 1\n")
  fake.chmod(0o755)
  script = "from jaxpe.attention import cpu_flash; print(cpu_flash.available()); print(cpu_flash.unavailable_reason())"
  env = {**os.environ, "JAXPE_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(fake), "XLA_FLAGS": ""}
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith("False") and "fake compiler: cannot build" in done.stdout
  assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-written is left to load


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_other_vector_widths_compute_the_same(march, tmp_path):
  # JAXPE_CPU_FLASH_MARCH=x86-64-v3 (AVX2: 8-float vectors, the code path of CPUs without AVX-512)
  # and x86-64 (SSE2 only) build and run here too, against the dense reference
  script = textwrap.dedent(
    """
    import numpy as np, jax, jax.numpy as jnp
    from jaxpe.attention import cpu_flash, masks, reference
    assert cpu_flash.available(), cpu_flash.unavailable_reason()
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 75, 4, 20)), jnp.float32) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2, :17]
    seg = jnp.asarray(np.cumsum(rng.random((2, 75)) < 0.1, axis=1), jnp.int32)
    mask = masks.AttentionMask(causal=True, segment_ids=seg).dense(2, 75)
    kernel = lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, scale=0.2, causal=True, q_segment_ids=seg, k_segment_ids=seg)
    dense = lambda q, k, v: reference.dot_product_attention(q, k, v, scale=0.2, mask=mask)
    loss = lambda f: jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))
    got, want = loss(kernel)(q, k, v), loss(dense)(q, k, v)
    print(max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
    """
  )
  env = {**os.environ, "JAXPE_CACHE_DIR": str(tmp_path), "JAXPE_CPU_FLASH_MARCH": march, "XLA_FLAGS": ""}
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert float(done.stdout.split()[-1]) < 2e-5, done.stdout
  assert len(list(tmp_path.glob("cpu_flash_*.so"))) == 1


def test_a_damaged_cached_library_is_rebuilt_and_the_switch_takes_words(tmp_path):
  script = (
    "from jaxpe.attention import cpu_flash; print(cpu_flash.available(), cpu_flash.unavailable_reason())"
  )
  env = {**os.environ, "JAXPE_CACHE_DIR": str(tmp_path), "XLA_FLAGS": ""}
  first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert first.stdout.startswith("True"), first.stderr[-2000:]
  (lib,) = tmp_path.glob("cpu_flash_*.so")
  lib.write_bytes(lib.read_bytes()[:4096])  # truncated: loading it would crash the process (SIGBUS)
  again = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and again.stdout.startswith("True"), (again.returncode, again.stderr[-2000:])
  assert lib.stat().st_size > 4096
  for word in ("false", "Off", "no"):
    off = subprocess.run(
      [sys.executable, "-c", script],
      env={**env, "JAXPE_CPU_FLASH": word},
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert off.stdout.startswith(f"False turned off by JAXPE_CPU_FLASH={word}"), off.stdout
  missing = subprocess.run(
    [sys.executable, "-c", script],
    env={**env, "CXX": "no-such-compiler", "JAXPE_CACHE_DIR": str(tmp_path / "empty")},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert missing.stdout.startswith("False CXX=no-such-compiler is not found"), missing.stdout
