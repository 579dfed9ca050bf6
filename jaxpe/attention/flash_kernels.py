"""The GPU (Triton) Pallas kernels of the ``flash`` backend: forward, dq, and dk/dv, with RoPE and
ALiBi inside; the block arithmetic both targets share (``flash_tpu`` schedules it for Mosaic).

FlashAttention-2 (Dao, arXiv 2307.08691): the grid runs over (batch, head, block of rows), a loop
over the other side's blocks keeps the online softmax (running max and sum, float32 accumulation);
the backward recomputes the probabilities from the saved log-sum-exp. RoPE is applied to each q and
k block as it is loaded (``rotate``: ``x cos + (x @ perm) sin``, cos and sin from float32 positions x
the per-dim frequency; rotate-half with power-of-two widths elementwise on the lane ranges of the two
halves, ``Config.split``), and its transpose to the q/k gradients; ALiBi's bias ``-m_h (i - j)`` is built
from the position blocks. Nothing rotated or biased is written to memory. Grouped-query heads read
their kv head through the index map (``h // (N // K)``); dk/dv of a kv head sum its N / K query heads.
Windows, chunks, the soft cap and sinks: ``flash_patterns`` (the loops run over the blocks it
gives; blocks wholly outside are not loaded).

Layouts (``jaxpe.attention.flash`` builds them), token-major here: q ``[B, T, N, D]``, k ``[B, T, K, D]``,
v ``[B, T, K, Dv]`` (the caller's own layout, read in place through the block specs as jax's Triton
attention does: no transposed copies around the kernels; ``flash_tpu`` takes them head-major,
``[B, N, T, D]``), emulation dims ``qe [B, T, N, E]`` / ``ke [B, T, K, E]`` float32 (contracted at
float32 HIGHEST), row statistics ``lse`` / ``delta`` ``[B, N, T, 1]`` float32, per-token columns
``[B, T, 1]`` float32 (RoPE positions ``rq`` / ``rk``, xPos's ``p - offset`` ``xq`` / ``xk``; int32:
ALiBi query positions ``aq``, segment ids ``sq``; ``flash_tpu`` takes these and the row statistics
as lane-dense rows ``[B, 1, T]`` / ``[B, N, 1, T]``, read through ``token``) and rows
``[B, 1, T]`` int32 (ALiBi key positions ``ak``, segment ids ``sk``), slopes ``[N, 1, 1]``, the RoPE
tables ``freq`` / ``amp`` / ``logz``, ``turns [8, D]`` ``[1, D]`` and ``perm [D, D]`` (``rope_spec.kernel_tables``).
Every operand is optional except q, k, v. T is a whole number of blocks. Block shapes are powers of
two and full minor dims, as in jax's own Triton attention kernel; q, k, v, o and their gradients may
be H wide with H not a power of two (``Config.lanes``): their blocks are then D lanes wide and the
lanes past H are masked (``read`` / ``write``: loads give 0, stores skip them), as jax's kernel does.

Triton (``target="gpu"``): ``triton_params`` gives explicit ``pallas.triton.CompilerParams`` (without
them Pallas picks Mosaic GPU, which has no ``dot_general``); every load is one indexer (a head of a
``[G, T, D]`` block and a row range in one index, not ``ref.at[g][rows]``) and tables are read by
rows from their refs (no value ``slice``, which the Triton lowering lacks). Each program reads the
other side's blocks from the whole sequence in HBM (GPU memory, so T is not bounded by the chip's
SRAM). Lowered for ``"cuda"`` on CPU (tests/attention/flash_lowering_test.py) every option emits
``__gpu$xla.gpu.triton``; with jax's CUDA plugin Triton and ptxas also compile them for a
deviceless H100 and A100 (tests/attention/gpu_compile_test.py: shared memory within the card's
232448 / 166912 bytes, the block rows from ``flash.gpu_block`` for the card, ``gpu_cards``); speed and the numerics of the tensor cores are proven only on a GPU.

Shape alphabet: B batch, T tokens, N heads, K kv heads, G = N / K, D q/k dims, Dv v dims,
E emulation dims.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpe.attention import flash_patterns as patterns
from jaxpe.attention.flash_blocks import block_width, read, store, write
from jaxpe.attention.flash_blocks import parts as _parts

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked block gives no NaN
_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Config:
  """Static kernel settings (hashable: a ``custom_vjp`` nondiff argument)."""

  scale: float
  causal: bool
  block: int
  groups: int
  rope: bool = False
  xpos: bool = False
  exact: bool = False
  scale_base: float = 512.0
  interpret: bool = False
  split: int = 0  # rotate-half width h (elementwise rotation of lane ranges); 0: the perm matmul
  target: str = "gpu"  # "gpu": these Triton kernels; "tpu": jaxpe.attention.flash_tpu (Mosaic)
  window: tuple[int, int] | None = None  # local_window_size (left, right), each at most the padded T
  chunk: int | None = None  # chunk_size (only when smaller than the padded T)
  soft_cap: float | None = None  # logits_soft_cap
  sinks: bool = False  # a "sinks" operand [N, 1, 1] joins the forward's online softmax
  length: int = 0  # the padded T (a whole number of blocks): flash_tpu's grids and block ranges
  lanes: int = 0  # gpu: q, k, v (and o, do, dq, dk, dv) are the caller's H wide, read in place in
  # blocks of D = next_power_of_two(H) lanes; lanes >= H load as 0 and are not stored (masked, as
  # jax's Triton attention). 0: the arrays are D wide


def _operands(a, b):
  """``(a, b, precision)`` of a kernel matmul: float32 operands (either one, the other cast up) at
  HIGHEST (Mosaic: ``contract_precision<fp32>``; Triton: IEEE float32), bf16 / float16 pairs at
  DEFAULT (the products of two 16-bit floats are exact in the float32 accumulator; Mosaic refuses
  ``contract_precision<fp32>`` on 16-bit operands: "Bad lhs type")."""
  if a.dtype != b.dtype or a.dtype == jnp.float32:
    return a.astype(jnp.float32), b.astype(jnp.float32), _HI
  return a, b, None


def _dot(a, b, dims):
  a, b, precision = _operands(a, b)
  return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def dot(a, b):  # [m, k] @ [k, n]
  return _dot(a, b, ((1,), (0,)))


def dot_nt(a, b):  # [m, k] @ [n, k]^T
  return _dot(a, b, ((1,), (1,)))


def dot_tn(a, b):  # [k, m]^T @ [k, n]
  return _dot(a, b, ((0,), (0,)))


def _centred(x):
  return x - jnp.floor(x + 0.5)  # x minus the nearest integer: exact for float32 x


def _exact_phase(pos, chunk):
  """``2 pi frac(p U / 2^64)`` for integer-valued float32 ``p < 2^24`` ``[rows, 1]`` and the 12-bit
  chunks ``c0..c4`` of U (``chunk(j)``: row j of ``turns [8, D]``, read from the ref: no value slice,
  which Triton does not lower): ``p = a 2^12 + b``; every product ``a c_j``, ``b c_j`` is
  an exact float32 integer, its scaled fraction exact; three roundings of at most 2^-25 turn remain
  (``jaxpe.ops.exact_phases`` reduces the same U in uint32)."""
  c = [chunk(j) for j in range(5)]
  a = jnp.floor(pos * jnp.float32(2.0**-12))
  b = pos - a * jnp.float32(2.0**12)
  s12, s24, s36, s48 = (jnp.float32(2.0**-e) for e in (12, 24, 36, 48))
  t = _centred(_centred(b * c[0] * s12) + _centred(a * c[1] * s12))  # exact
  t = _centred(t + _centred(_centred(b * c[1] * s24) + _centred(a * c[2] * s24)))
  t = t + ((b * c[2] + a * c[3]) * s36 + (b * c[3] + a * c[4]) * s48)
  return t * jnp.float32(2 * np.pi)


def _table(r, cfg: Config, name, row=None):
  """A per-dim table ``[1, D]`` (row ``row`` of a ``[., D]`` table), or its first h lanes (the
  frequencies of the h pairs) when split."""
  rows = slice(None) if row is None else pl.ds(row, 1)
  return r[name][rows, :] if not cfg.split else r[name][rows, pl.ds(0, cfg.split)]


def _cos_sin(r, cfg: Config, pos, delta, sign: float):
  """Per-dim ``(cos * amp, sin * amp)`` ``[rows, D]`` (``[rows, h]`` when split) for ``pos`` ``[rows, 1]``."""
  if cfg.exact:
    phase = _exact_phase(pos, lambda j: _table(r, cfg, "turns", j))
  else:
    phase = pos * _table(r, cfg, "freq")  # float32(p) * float32(inv_freq): rope_phases
  cos, sin = jnp.cos(phase), jnp.sin(phase)
  amp = _table(r, cfg, "amp")  # attention_factor on the rotated dims, 1 past R
  if cfg.xpos:  # xpos_scale: exp(float32(p - offset) * (sign / scale_base) * log zeta), 1 past R
    amp = jnp.exp((delta * jnp.float32(sign / cfg.scale_base)) * _table(r, cfg, "logz")) * amp
  cos, sin = cos * amp, sin * amp
  return cos, sin


def _rotate(r, cfg: Config, parts, cs):
  """RoPE of a block in float32. Matmul path: ``x cos + (x @ perm) sin`` (``perm``: the signed pair
  swap; interleaved pairs are adjacent lanes, which a lane-range split cannot separate, and
  rotate-half widths that are not powers of two). Split (rotate-half): ``r1 = x1 cos - x2 sin``,
  ``r2 = x2 cos + x1 sin`` elementwise, the rest of the dims unchanged (no matmul)."""
  if not cfg.split:
    x = parts[0].astype(jnp.float32)
    return (x * cs[0] + dot(x, r["perm"][...]) * cs[1],)
  (cos, sin), (x1, x2) = cs, (x.astype(jnp.float32) for x in parts[:2])
  return (x1 * cos - x2 * sin, x2 * cos + x1 * sin, *parts[2:])


def rotate_t(r, cfg: Config, g, cs):
  """The transpose of ``_rotate`` applied to a gradient: ``g cos - ((g sin) @ perm)`` (perm^T = -perm);
  split: ``g1 cos + g2 sin``, ``g2 cos - g1 sin``, the rest unchanged."""
  if not cfg.split:
    return (g[0] * cs[0] - dot(g[0] * cs[1], r["perm"][...]),)
  (cos, sin), (g1, g2) = cs, g[:2]
  return (g1 * cos + g2 * sin, g2 * cos - g1 * sin, *g[2:])


def token(ref, rows):
  """A per-token operand's ``rows`` as a column ``(rows, 1)``: from a column ref ``[T, 1]`` (Triton)
  or a lane-dense row block ``(1, b)`` (Mosaic, where a ``[B, T, 1]`` column would take 128 lanes per
  token in HBM; turned into a column in the kernel, as splash reads its row statistics)."""
  if ref.shape[-1] == 1:
    return ref[rows, :]
  return jnp.expand_dims(ref[0, rows], -1)


def q_cs(r, cfg, rows):
  return _cos_sin(r, cfg, token(r["rq"], rows), token(r["xq"], rows) if cfg.xpos else None, 1.0)


def k_cs(r, cfg, rows):
  return _cos_sin(r, cfg, token(r["rk"], rows), token(r["xk"], rows) if cfg.xpos else None, -1.0)


def scores(r, cfg, qr, qe, kr, ke, q_rows, k_cols, slope, q_start, k_start):
  """Float32 scores ``[bq, bk]`` of a q block and a k block (parts, rotated), soft-capped, with ALiBi
  added after the cap (``cap tanh(s / cap) - m (i - j)``), the mask (None: every pair visible) and the
  cap's derivative ``1 - tanh^2`` (None without a cap; the backward's chain rule)."""
  s = sum(dot_nt(a, b) for a, b in zip(qr, kr, strict=True))
  if qe is not None:
    s = s + dot_nt(qe, ke)
  s = s * jnp.float32(cfg.scale)
  s, dcap = patterns.soft_cap(cfg, s)  # before the bias and the mask
  if slope is not None:  # ALiBi: -m_h (i - j) from the int32 position blocks (alibi_bias: one rounding)
    s = s - slope * (token(r["aq"], q_rows) - r["ak"][:, k_cols]).astype(jnp.float32)
  mask = None
  if "sq" in r:
    mask = token(r["sq"], q_rows) == r["sk"][:, k_cols]
  return s, patterns.pattern_mask(cfg, q_start, k_start, s.shape, mask), dcap


def load_q_side(r, cfg, rows, head=()):
  """A q block rotated (parts of ``[bq, D]`` in q's dtype) and its float32 emulation dims (or None);
  ``head``: the head index of a ``[T, G, .]`` q block (dk/dv, GPU)."""
  q = _parts(cfg, r["q"], rows, head)
  cs = q_cs(r, cfg, rows) if cfg.rope else None
  qr = tuple(x.astype(q[0].dtype) for x in _rotate(r, cfg, q, cs)) if cfg.rope else q
  qe = r["qe"][(rows, *head, slice(None))] if "qe" in r else None
  return qr, qe, cs


def load_k_side(r, cfg, rows):
  k = _parts(cfg, r["k"], rows)
  cs = k_cs(r, cfg, rows) if cfg.rope else None
  kr = tuple(x.astype(k[0].dtype) for x in _rotate(r, cfg, k, cs)) if cfg.rope else k
  ke = r["ke"][rows, :] if "ke" in r else None
  return kr, ke, cs


def _forward_kernel(*refs, names, cfg: Config):
  r = dict(zip(names, refs, strict=True))
  i = pl.program_id(2)
  bq = bk = cfg.block
  local = pl.ds(0, bq)  # the q-side refs are blocks of bq rows, the k side whole sequences
  qr, qe, _ = load_q_side(r, cfg, local)
  slope = r["slopes"][...] if "slopes" in r else None
  dv = r["v"].shape[-1]

  def body(j, carry):
    o, m, denom = carry
    k_rows = pl.ds(j * bk, bk)
    kr, ke, _ = load_k_side(r, cfg, k_rows)
    s, mask, _ = scores(r, cfg, qr, qe, kr, ke, local, k_rows, slope, i * bq, j * bk)
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    corr = jnp.exp(m - m_next)
    p = jnp.exp(s - m_next)
    v = read(cfg, r["v"], (k_rows, slice(None)))
    o = o * corr + dot(p.astype(v.dtype), v)
    return o, m_next, denom * corr + jnp.sum(p, axis=-1, keepdims=True)

  lower, upper = patterns.key_blocks(cfg, i, r["k"].shape[0] // bk)
  m0, l0 = patterns.softmax_start(cfg, r.get("sinks"), bq)
  o, m, denom = lax.fori_loop(lower, upper, body, (jnp.zeros((bq, dv), jnp.float32), m0, l0))
  write(cfg, r["o"], o / denom)
  if "lse" in r:  # the backward's residual only
    r["lse"][...] = m + jnp.log(denom)


def _dq_kernel(*refs, names, cfg: Config):
  r = dict(zip(names, refs, strict=True))
  i = pl.program_id(2)
  bq = bk = cfg.block
  local = pl.ds(0, bq)
  qr, qe, q_cs = load_q_side(r, cfg, local)
  slope = r["slopes"][...] if "slopes" in r else None
  do, lse, delta = read(cfg, r["do"], ...), r["lse"][...], r["delta"][...]

  def body(j, carry):
    dq, dqe = carry
    k_rows = pl.ds(j * bk, bk)
    kr, ke, _ = load_k_side(r, cfg, k_rows)
    s, mask, dcap = scores(r, cfg, qr, qe, kr, ke, local, k_rows, slope, i * bq, j * bk)
    p = jnp.exp(s - lse)
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    v = read(cfg, r["v"], (k_rows, slice(None)))
    ds = p * (dot_nt(do, v) - delta) * jnp.float32(cfg.scale)
    if dcap is not None:
      ds = ds * dcap
    dq = tuple(a + dot(ds.astype(b.dtype), b) for a, b in zip(dq, kr, strict=True))
    if dqe is not None:
      dqe = dqe + dot(ds, ke)
    return dq, dqe

  lower, upper = patterns.key_blocks(cfg, i, r["k"].shape[0] // bk)
  zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in qr)
  init = (zeros, None if qe is None else jnp.zeros(qe.shape, jnp.float32))
  dq, dqe = lax.fori_loop(lower, upper, body, init)
  if cfg.rope:
    dq = rotate_t(r, cfg, dq, q_cs)
  store(r["dq"], dq, cfg)
  if dqe is not None:
    r["dqe"][...] = dqe


def _dkv_kernel(*refs, names, cfg: Config):
  r = dict(zip(names, refs, strict=True))
  j = pl.program_id(2)
  bq = bk = cfg.block
  local = pl.ds(0, bk)
  kr, ke, k_cs = load_k_side(r, cfg, local)
  v = read(cfg, r["v"], ...)
  lower, upper = patterns.query_blocks(cfg, j, r["q"].shape[0] // bq)

  def head(g, carry):
    slope = r["slopes"][g] if "slopes" in r else None

    def body(i, carry):
      dk, dke, dv = carry
      q_rows = pl.ds(i * bq, bq)
      qr, qe, _ = load_q_side(r, cfg, q_rows, (g,))
      s, mask, dcap = scores(r, cfg, qr, qe, kr, ke, q_rows, local, slope, i * bq, j * bk)
      p = jnp.exp(s - r["lse"][g, q_rows, :])
      if mask is not None:
        p = jnp.where(mask, p, 0.0)
      do = read(cfg, r["do"], (q_rows, g, slice(None)))
      dv = dv + dot_tn(p.astype(do.dtype), do)
      ds = p * (dot_nt(do, v) - r["delta"][g, q_rows, :]) * jnp.float32(cfg.scale)
      if dcap is not None:
        ds = ds * dcap
      dk = tuple(a + dot_tn(ds.astype(b.dtype), b) for a, b in zip(dk, qr, strict=True))
      if dke is not None:
        dke = dke + dot_tn(ds, qe)
      return dk, dke, dv

    return lax.fori_loop(lower, upper, body, carry)

  init = (
    tuple(jnp.zeros(x.shape, jnp.float32) for x in kr),
    None if ke is None else jnp.zeros(ke.shape, jnp.float32),
    jnp.zeros(v.shape, jnp.float32),
  )
  dk, dke, dv = lax.fori_loop(0, cfg.groups, head, init)
  if cfg.rope:
    dk = rotate_t(r, cfg, dk, k_cs)
  store(r["dk"], dk, cfg)
  write(cfg, r["dv"], dv)
  if dke is not None:
    r["dke"][...] = dke


# ---------------------------------------------------------------- pallas_call builders

_SIDE = {"rq": "q", "xq": "q", "aq": "q", "sq": "q", "rk": "k", "xk": "k", "ak": "k_row", "sk": "k_row"}


def _spec(name, x, cfg: Config, rows_of: str):
  """BlockSpec of operand ``name`` in a grid (b, head, block); ``rows_of`` names the blocked side."""
  bl, g = cfg.block, cfg.groups
  if name in ("freq", "amp", "logz", "perm", "turns"):
    return pl.BlockSpec(x.shape, lambda b, h, i: (0, 0))
  if name in ("slopes", "sinks"):
    if rows_of == "k":  # dk/dv: the G query heads of kv head h
      return pl.BlockSpec((g, 1, 1), lambda b, h, i: (h, 0, 0))
    return pl.BlockSpec((None, 1, 1), lambda b, h, i: (h, 0, 0))
  side = _SIDE.get(name)
  if side is not None:  # per-token columns [B, T, 1] / rows [B, 1, T]
    blocked = side.startswith(rows_of)
    if side == "k_row":
      shape = (None, 1, bl if blocked else x.shape[2])
      return pl.BlockSpec(shape, (lambda b, h, i: (b, 0, i)) if blocked else (lambda b, h, i: (b, 0, 0)))
    shape = (None, bl if blocked else x.shape[1], 1)
    return pl.BlockSpec(shape, (lambda b, h, i: (b, i, 0)) if blocked else (lambda b, h, i: (b, 0, 0)))
  head_side = "q" if name in ("q", "qe", "do", "lse", "delta", "o", "dq", "dqe") else "k"
  width = block_width(name, x, cfg)
  if name in ("lse", "delta"):  # row statistics [B, N, T, 1], head-major
    if head_side == rows_of:
      return pl.BlockSpec((None, None, bl, 1), lambda b, h, i: (b, h, i, 0))
    return pl.BlockSpec((None, g, x.shape[2], 1), lambda b, h, i: (b, h, 0, 0))  # the G q heads
  # token-major [B, T, heads, W]: the caller's own layout, read in place (as jax's Triton attention)
  if head_side == rows_of:  # the blocked operand of this grid
    return pl.BlockSpec((None, bl, None, width), lambda b, h, i: (b, i, h, 0))
  if head_side == "k":  # whole kv sequence of this query head's kv head (grouped-query heads)
    return pl.BlockSpec((None, x.shape[1], None, width), lambda b, h, i: (b, 0, h // g, 0))
  return pl.BlockSpec((None, x.shape[1], g, width), lambda b, h, i: (b, 0, h, 0))  # the G q heads


def triton_params(block: int, width: int) -> plgpu.CompilerParams:
  """Triton's launch settings for a block of ``block`` rows and ``width`` lanes (jax's Triton
  attention: 4 warps up to 64 rows, else 8; two pipeline stages)."""
  return plgpu.CompilerParams(num_warps=4 if block * width <= 64 * 64 else 8, num_stages=2)


def _call(kernel, ins: dict, outs: dict, cfg: Config, rows_of: str, grid):
  names = tuple(ins) + tuple(outs)
  in_specs = [_spec(n, x, cfg, rows_of) for n, x in ins.items()]
  out_specs = [_spec(n, x, cfg, rows_of) for n, x in outs.items()]
  out = pl.pallas_call(
    functools.partial(kernel, names=names, cfg=cfg),
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs.values()],
    interpret=cfg.interpret,
    compiler_params=triton_params(cfg.block, max(block_width(n, x, cfg) for n, x in ins.items())),
    name=f"jaxpe_flash_{kernel.__name__.strip('_')}",
  )(*ins.values())
  return dict(zip(outs, out, strict=True))


def forward(q, k, v, aux: dict, cfg: Config, residuals: bool = True):
  """``(o [B, T, N, Dv], lse [B, N, T, 1] float32)`` of q ``[B, T, N, D]``, k ``[B, T, K, D]``, v
  ``[B, T, K, Dv]``; ``aux``: the optional operands by name; ``residuals`` False: lse is None, not
  written (a forward that is not differentiated)."""
  batch, length, heads, _ = q.shape
  ins = {"q": q, "k": k, "v": v, **aux}
  outs = {"o": jax.ShapeDtypeStruct((batch, length, heads, v.shape[-1]), v.dtype)}
  if residuals:
    outs["lse"] = jax.ShapeDtypeStruct((batch, heads, length, 1), jnp.float32)
  got = _call(_forward_kernel, ins, outs, cfg, "q", (batch, heads, length // cfg.block))
  return got["o"], got.get("lse")


def backward(q, k, v, aux: dict, o, lse, do, cfg: Config):
  """``(dq, dk, dv, dqe, dke)`` (dqe / dke None without emulation dims) by recomputation, in the
  layouts and dtypes of q, k, v (float32 sums, one rounding at the store), qe, ke."""
  batch, length, heads, _ = q.shape
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = jnp.transpose(delta, (0, 2, 1))[..., None]  # [B, N, T, 1], as lse
  ins = {"q": q, "k": k, "v": v, **aux, "do": do, "lse": lse, "delta": delta}
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  outs = {"dq": like(q)}
  if "qe" in aux:
    outs["dqe"] = like(aux["qe"])
  dq = _call(_dq_kernel, ins, outs, cfg, "q", (batch, heads, length // cfg.block))
  outs = {"dk": like(k), "dv": like(v)}
  if "ke" in aux:
    outs["dke"] = like(aux["ke"])
  dkv = _call(_dkv_kernel, ins, outs, cfg, "k", (batch, k.shape[2], length // cfg.block))
  return dq["dq"], dkv["dk"], dkv["dv"], dq.get("dqe"), dkv.get("dke")
