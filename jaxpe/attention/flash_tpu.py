"""The Mosaic (TPU) kernels of the ``flash`` backend: forward, dq and dk/dv, blocked over both sides.

The block arithmetic is ``flash_kernels``' (RoPE of each block as it is loaded, ALiBi from the
position blocks, the emulation dims in float32, the same masks); what differs is the layout,
head-major ``[B, N | K, T, .]`` (Mosaic's (8, 128) rule applies to a block's last two dims, which
are then its rows and lanes; the Triton kernels read the token-major input in place), and the
schedule, as in jax's own TPU flash attention (``jax/experimental/pallas/ops/tpu/flash_attention.py``):
each program sees one q block and one k/v block, the grid's last axis walks the other side's
blocks (``"arbitrary"``: sequential), and the online-softmax state (running max, sum, output) or the
gradient sums live in VMEM scratch between the steps of that axis. VMEM then holds a few blocks
whatever T is (no whole k/v sequence per program). The sequential axis walks only the blocks
``flash_patterns.key_blocks`` (forward, dq) or ``query_blocks`` (dk/dv) give the program's block (causal,
``local_window_size``, ``chunk_size``): its length is the widest such range (``flash_patterns.span``: about
``(left + right) / block + 2`` steps for a window, not T / block), step s is block ``lo + s``, and a
step past ``hi`` (a narrower range) is skipped (``pl.when``) with its index map clamped to the last
needed block, so no DMA fetches it. Sinks start the forward's online softmax in scratch (max
``sink_h``, sum 1); the soft cap is ``fk.scores``'.

Grids: forward and dq ``(B, N, T / bq, span_k)``; dk/dv ``(B, K, T / bk, G, span_q)`` (span: T / b
without a window or chunks; dk/dv: the G query heads of a kv head and their q blocks summed in
scratch). Block shapes: ``(bq or bk, D)`` with D the
whole (padded) head dim, per-token operands (positions, segment ids) and the row statistics
(log-sum-exp, delta) as lane-dense rows ``(1, b)`` of ``[B, 1, T]`` / ``[B, N, 1, T]`` arrays (a
``[., T, 1]`` column would take 128 lanes per token in HBM; ``flash_kernels.token`` turns a row block
into the column the arithmetic needs), slopes ``(1, 1)``, whole tables: with b = 128 or the whole padded T (``flash.attend``'s blocks), every block meets Mosaic's
(8, 128) rule (last two dims divisible by 8 / 128 or equal to the array's) for bf16 and float32.
The rotation is the ``[D, D]`` permutation matmul for both layouts (``Config.split`` is 0 on TPU:
no sub-128 lane slices). The kernels use no op whose Mosaic lowering asks for the chip (jax's
``sign`` lowering does, and ``//`` of int32 uses it: ``lax.div`` here), and their block sizes do
not depend on the chip (at b = 128, D = 128 the dk/dv kernel's double-buffered blocks, the
``[D, D]`` table and the scratch are about 2 MiB, by count, not measured; v5e's default scoped VMEM
is 16 MiB), so they lower on any host; ``tpu_chip`` lowers as on a named generation (the way jax's Mosaic lowering reads it).

Lowering (``jax.export`` for ``"tpu"`` on a CPU) proves the Pallas rules accept every block shape and
op and emits ``tpu_custom_call``; Mosaic's own compilation (layouts, matmul operand types, VMEM
limits) runs on a CPU too where libtpu is installed, for a deviceless topology
(tests/attention/tpu_compile_test.py: v5e and v6e; v4 and v5p compile as well). Mosaic takes
``precision=HIGHEST`` (``contract_precision<fp32>``) on float32 operands only: bf16 x bf16 matmuls
run at DEFAULT (``flash_kernels.dot``; HIGHEST there failed with "Bad lhs type", issue 45). Speed
and the matmul units' numerics are proven only on a TPU. ``interpret=True`` runs these kernels on
CPU (tests).

Shape alphabet: B batch, T tokens, N heads, K kv heads, G = N / K, D q/k dims, Dv v dims, E emulation
dims; bq = bk = ``Config.block``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpe.attention import flash_kernels as fk
from jaxpe.attention import flash_patterns as patterns

CHIPS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5p", "v6e": "TPU v6 lite"}
"""Generations ``tpu_chip`` names, with the device kind jax's ``tpu_info`` knows them by."""


@contextlib.contextmanager
def tpu_chip(name: str):
  """Trace and lower inside as for one TPU of generation ``name`` (a key of ``CHIPS``) on any host:
  an abstract one-device mesh whose ``AbstractDevice`` is that chip, which is where jax's Mosaic
  lowering reads the chip (``pallas.mosaic.tpu_info.get_device_kind``). The kernels here do not need it.

  Raises:
    ValueError: ``name`` not a key of ``CHIPS``.
  """
  if name not in CHIPS:
    raise ValueError(f"tpu_chip name must be one of {sorted(CHIPS)}, got {name!r}")
  device = jax.sharding.AbstractDevice(device_kind=CHIPS[name], num_cores=1, platform="tpu")
  mesh = jax.sharding.AbstractMesh((1,), ("chip",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def _when(condition):
  """``pl.when(condition)``, or the body run unconditionally when ``condition`` is None."""
  return (lambda body: body()) if condition is None else pl.when(condition)


def _online_softmax_step(r, cfg, s, mask, v):
  if mask is not None:
    s = jnp.where(mask, s, fk.MASK_VALUE)
  m = r["m_scr"][...]
  m_next = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
  corr = jnp.exp(m - m_next)
  p = jnp.exp(s - m_next)
  r["acc_scr"][...] = r["acc_scr"][...] * corr + fk.dot(p.astype(v.dtype), v)
  r["l_scr"][...] = r["l_scr"][...] * corr + jnp.sum(p, axis=-1, keepdims=True)
  r["m_scr"][...] = m_next


def _visited(cfg: fk.Config, blocks, x, step, n: int):
  """``(y, needed)``: the other side's block at step ``step`` of the sequential axis for block ``x``
  (``blocks(cfg, x, n)`` = ``[lo, hi)``, ``lo + step``) and whether it is in range (None: always)."""
  lo, hi = blocks(cfg, x, n)
  if isinstance(lo, int) and isinstance(hi, int) and lo == 0 and hi == n:
    return step, None
  y = lo + step
  return y, y < hi


def _clamped(cfg: fk.Config, blocks, x, step, n: int):
  """The block an index map fetches at step ``step``: ``lo + step`` clamped to the last needed one
  (``hi - 1``), so a skipped step fetches what the pipeline holds already (no DMA)."""
  lo, hi = blocks(cfg, x, n)
  if isinstance(lo, int) and isinstance(hi, int) and lo == 0 and hi == n:
    return step
  return jnp.minimum(lo + step, hi - 1)


def _forward_kernel(*refs, names, cfg: fk.Config):
  r = dict(zip(names, refs, strict=True))
  i, step, n_k = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
  j, needed = _visited(cfg, patterns.key_blocks, i, step, cfg.length // cfg.block)
  rows = pl.ds(0, cfg.block)  # every ref is one block

  @pl.when(step == 0)
  def _():
    r["m_scr"][...], r["l_scr"][...] = patterns.softmax_start(
      cfg, r.get("sinks"), cfg.block
    )  # sinks: (sink_h, 1)
    r["acc_scr"][...] = jnp.zeros(r["acc_scr"].shape, jnp.float32)
    r["qr_scr"][...] = fk.load_q_side(r, cfg, rows)[0][0]  # the rotated q block, once per row block

  @_when(needed)
  def _():
    kr, ke, _ = fk.load_k_side(r, cfg, rows)
    qe = r["qe"][...] if "qe" in r else None
    slope = r["slopes"][...] if "slopes" in r else None
    s, mask, _ = fk.scores(
      r, cfg, (r["qr_scr"][...],), qe, kr, ke, rows, rows, slope, i * cfg.block, j * cfg.block
    )
    _online_softmax_step(r, cfg, s, mask, r["v"][...])

  @pl.when(step == n_k - 1)
  def _():
    denom = r["l_scr"][...]
    r["o"][...] = (r["acc_scr"][...] / denom).astype(r["o"].dtype)
    if "lse" in r:  # the backward's residual only, a lane-dense row (1, bq)
      r["lse"][...] = (r["m_scr"][...] + jnp.log(denom)).T


def _column(ref):
  """A row statistic's block ``(1, bq)`` (lane-dense in HBM) as the column ``(bq, 1)`` of its q rows
  (as splash's backward reads its log-sum-exp)."""
  return jnp.expand_dims(ref[0], -1)


def _probs(r, cfg, qr, qe, kr, ke, rows, slope, i, j):
  """Probabilities ``[bq, bk]`` from the saved log-sum-exp and ``ds`` (the scores' gradient)."""
  s, mask, dcap = fk.scores(r, cfg, qr, qe, kr, ke, rows, rows, slope, i * cfg.block, j * cfg.block)
  p = jnp.exp(s - _column(r["lse"]))
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  ds = p * (fk.dot_nt(r["do"][...], r["v"][...]) - _column(r["delta"])) * jnp.float32(cfg.scale)
  if dcap is not None:  # through the soft cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2
    ds = ds * dcap
  return p, ds


def _dq_kernel(*refs, names, cfg: fk.Config):
  r = dict(zip(names, refs, strict=True))
  i, step, n_k = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
  j, needed = _visited(cfg, patterns.key_blocks, i, step, cfg.length // cfg.block)
  rows = pl.ds(0, cfg.block)

  @pl.when(step == 0)
  def _():
    r["dq_scr"][...] = jnp.zeros(r["dq_scr"].shape, jnp.float32)
    if "dqe_scr" in r:
      r["dqe_scr"][...] = jnp.zeros(r["dqe_scr"].shape, jnp.float32)
    r["qr_scr"][...] = fk.load_q_side(r, cfg, rows)[0][0]

  @_when(needed)
  def _():
    kr, ke, _ = fk.load_k_side(r, cfg, rows)
    qe = r["qe"][...] if "qe" in r else None
    slope = r["slopes"][...] if "slopes" in r else None
    _, ds = _probs(r, cfg, (r["qr_scr"][...],), qe, kr, ke, rows, slope, i, j)
    r["dq_scr"][...] += fk.dot(ds.astype(kr[0].dtype), kr[0])
    if ke is not None:
      r["dqe_scr"][...] += fk.dot(ds, ke)

  @pl.when(step == n_k - 1)
  def _():
    dq = (r["dq_scr"][...],)
    if cfg.rope:
      dq = fk.rotate_t(r, cfg, dq, fk.q_cs(r, cfg, rows))
    fk.store(r["dq"], dq)
    if "dqe_scr" in r:
      r["dqe"][...] = r["dqe_scr"][...]


def _dkv_kernel(*refs, names, cfg: fk.Config):
  r = dict(zip(names, refs, strict=True))
  j, g, step = pl.program_id(2), pl.program_id(3), pl.program_id(4)
  i, needed = _visited(cfg, patterns.query_blocks, j, step, cfg.length // cfg.block)
  first = jnp.logical_and(g == 0, step == 0)
  last = jnp.logical_and(g == pl.num_programs(3) - 1, step == pl.num_programs(4) - 1)
  rows = pl.ds(0, cfg.block)

  @pl.when(first)
  def _():
    for name in ("dk_scr", "dv_scr", "dke_scr"):
      if name in r:
        r[name][...] = jnp.zeros(r[name].shape, jnp.float32)
    r["kr_scr"][...] = fk.load_k_side(r, cfg, rows)[0][0]  # the rotated k block, once per k block

  @_when(needed)
  def _():
    kr = (r["kr_scr"][...],)
    ke = r["ke"][...] if "ke" in r else None
    qr, qe, _ = fk.load_q_side(r, cfg, rows)
    slope = r["slopes"][...] if "slopes" in r else None
    p, ds = _probs(r, cfg, qr, qe, kr, ke, rows, slope, i, j)
    do = r["do"][...]
    # p^T @ do as jax's TPU kernel writes it (an explicit transpose, not dot_general's lhs dim 0)
    r["dv_scr"][...] += fk.dot(p.T.astype(do.dtype), do)
    r["dk_scr"][...] += fk.dot(ds.T.astype(qr[0].dtype), qr[0])
    if ke is not None:
      r["dke_scr"][...] += fk.dot(ds.T, qe)

  @pl.when(last)
  def _():
    dk = (r["dk_scr"][...],)
    if cfg.rope:
      dk = fk.rotate_t(r, cfg, dk, fk.k_cs(r, cfg, rows))
    fk.store(r["dk"], dk)
    r["dv"][...] = r["dv_scr"][...].astype(r["dv"].dtype)
    if "dke_scr" in r:
      r["dke"][...] = r["dke_scr"][...]


# ---------------------------------------------------------------- pallas_call builders

_Q_HEAD = ("q", "qe", "do", "o", "dq", "dqe")
_Q_STATS = ("lse", "delta")  # [B, N, 1, T] float32: one lane per q row
_Q_TOKEN, _K_TOKEN, _K_ROW = ("rq", "xq", "aq", "sq"), ("rk", "xk"), ("ak", "sk")


def _spec(name, x, cfg: fk.Config, coords):
  """BlockSpec of operand ``name``; ``coords(*grid) -> (b, q head, q block, kv head, k block)``."""
  bl = cfg.block
  if name in ("freq", "amp", "logz", "perm", "turns"):
    return pl.BlockSpec(x.shape, lambda *idx: (0, 0))
  if name in ("slopes", "sinks"):
    return pl.BlockSpec((None, 1, 1), lambda *idx: (coords(*idx)[1], 0, 0))
  if name in _Q_TOKEN:  # per-token rows [B, 1, T] (flash.attend lays them out so for "tpu")
    return pl.BlockSpec((None, 1, bl), lambda *idx: (coords(*idx)[0], 0, coords(*idx)[2]))
  if name in _K_TOKEN:
    return pl.BlockSpec((None, 1, bl), lambda *idx: (coords(*idx)[0], 0, coords(*idx)[4]))
  if name in _K_ROW:
    return pl.BlockSpec((None, 1, bl), lambda *idx: (coords(*idx)[0], 0, coords(*idx)[4]))
  if name in _Q_STATS:
    return pl.BlockSpec((None, None, 1, bl), lambda *idx: (*_pick(coords(*idx), 0, 1), 0, coords(*idx)[2]))
  if name in _Q_HEAD:
    return pl.BlockSpec((None, None, bl, x.shape[-1]), lambda *idx: (*_pick(coords(*idx), 0, 1, 2), 0))
  return pl.BlockSpec((None, None, bl, x.shape[-1]), lambda *idx: (*_pick(coords(*idx), 0, 3, 4), 0))


def _pick(c, *which):
  return tuple(c[w] for w in which)


def _call(kernel, ins: dict, outs: dict, scratch: dict, cfg: fk.Config, grid, coords, semantics):
  names = tuple(ins) + tuple(outs) + tuple(scratch)
  out = pl.pallas_call(
    functools.partial(kernel, names=names, cfg=cfg),
    grid=grid,
    in_specs=[_spec(n, x, cfg, coords) for n, x in ins.items()],
    out_specs=[_spec(n, x, cfg, coords) for n, x in outs.items()],
    out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs.values()],
    scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch.values()],
    compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
    interpret=cfg.interpret,
    name=f"jaxpe_flash_tpu_{kernel.__name__.strip('_')}",
  )(*ins.values())
  return dict(zip(outs, out, strict=True))


def _q_major(cfg: fk.Config, n: int):
  """Coordinates of the (b, h, i, step) grid: step walks the k blocks ``patterns.key_blocks`` gives q block
  i (causal, window, chunks: the others are not on the grid); a step past them maps to the last one
  needed (fetched already: no DMA for skipped steps)."""

  def coords(b, h, i, step):
    return b, h, i, lax.div(h, cfg.groups), _clamped(cfg, patterns.key_blocks, i, step, n)  # no //: sign

  return coords


def forward(q, k, v, aux: dict, cfg: fk.Config, residuals: bool = True):
  """``(o [B, N, T, Dv], lse [B, N, 1, T] float32)`` of head-major q ``[B, N, T, D]``, k ``[B, K, T,
  D]``, v ``[B, K, T, Dv]`` (Mosaic tiles the last two dims of a block), as ``flash_kernels.forward``; ``residuals``
  False: lse is None, not written. lse is a row per head (T on the lanes): a ``[B, N, T, 1]`` column,
  as ``flash_kernels`` keeps it, would take 128 lanes in HBM (512 bytes per q row)."""
  batch, heads, length, dim = q.shape
  n, bl = length // cfg.block, cfg.block
  cfg = dataclasses.replace(cfg, length=length)
  ins = {"q": q, "k": k, "v": v, **aux}
  outs = {"o": jax.ShapeDtypeStruct((batch, heads, length, v.shape[-1]), v.dtype)}
  if residuals:
    outs["lse"] = jax.ShapeDtypeStruct((batch, heads, 1, length), jnp.float32)
  f32 = jnp.float32
  scratch = {
    "m_scr": ((bl, 1), f32),
    "l_scr": ((bl, 1), f32),
    "acc_scr": ((bl, v.shape[-1]), f32),
    "qr_scr": ((bl, dim), q.dtype),
  }
  semantics = ("parallel", "parallel", "parallel", "arbitrary")
  grid = (batch, heads, n, patterns.span(patterns.key_blocks, cfg, n))  # only the k blocks some q block needs
  got = _call(_forward_kernel, ins, outs, scratch, cfg, grid, _q_major(cfg, n), semantics)
  return got["o"], got.get("lse")


def backward(q, k, v, aux: dict, o, lse, do, cfg: fk.Config):
  """``(dq, dk, dv, dqe, dke)`` (dqe / dke None without emulation dims) in the dtypes of q, k, v, qe,
  ke, as ``flash_kernels.backward`` (here in the head-major layouts ``[B, N | K, T, .]``)."""
  batch, heads, length, dim = q.shape
  n, bl, f32 = length // cfg.block, cfg.block, jnp.float32
  cfg = dataclasses.replace(cfg, length=length)
  delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)[:, :, None, :]  # [B, N, 1, T], as lse
  ins = {"q": q, "k": k, "v": v, **aux, "do": do, "lse": lse, "delta": delta}
  outs = {"dq": jax.ShapeDtypeStruct(q.shape, q.dtype)}  # float32 sums in scratch, rounded once
  scratch = {"dq_scr": ((bl, dim), f32), "qr_scr": ((bl, dim), q.dtype)}
  if "qe" in aux:
    outs["dqe"] = jax.ShapeDtypeStruct(aux["qe"].shape, f32)
    scratch["dqe_scr"] = ((bl, aux["qe"].shape[-1]), f32)
  semantics = ("parallel", "parallel", "parallel", "arbitrary")
  grid = (batch, heads, n, patterns.span(patterns.key_blocks, cfg, n))
  dq = _call(_dq_kernel, ins, outs, scratch, cfg, grid, _q_major(cfg, n), semantics)

  def coords(b, h, j, g, step):  # step walks patterns.query_blocks(j); past them: the last one needed
    return b, h * cfg.groups + g, _clamped(cfg, patterns.query_blocks, j, step, n), h, j

  outs = {"dk": jax.ShapeDtypeStruct(k.shape, k.dtype), "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}
  scratch = {"dk_scr": ((bl, dim), f32), "dv_scr": ((bl, v.shape[-1]), f32), "kr_scr": ((bl, dim), k.dtype)}
  if "ke" in aux:
    outs["dke"] = jax.ShapeDtypeStruct(aux["ke"].shape, f32)
    scratch["dke_scr"] = ((bl, aux["ke"].shape[-1]), f32)
  semantics = ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
  grid = (batch, k.shape[1], n, cfg.groups, patterns.span(patterns.query_blocks, cfg, n))
  dkv = _call(_dkv_kernel, ins, outs, scratch, cfg, grid, coords, semantics)
  return dq["dq"], dkv["dk"], dkv["dv"], dq.get("dqe"), dkv.get("dke")
