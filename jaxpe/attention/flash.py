"""The ``flash`` backend: jaxpe's own Pallas flash attention, with RoPE and ALiBi inside the kernel.

``pl.pallas_call`` kernels in two families, chosen by ``attend``'s ``target``:

- ``"gpu"`` (default), ``jaxpe.attention.flash_kernels``: Triton kernels (explicit
  ``pallas.triton.CompilerParams``, warps per block size), a grid over (batch, head, row block) and
  a loop over the other side's blocks, which each program reads from the whole sequence in HBM.
- ``"tpu"``, ``jaxpe.attention.flash_tpu``: Mosaic kernels blocked over both sides, the other
  side's blocks on a sequential grid axis and the online softmax (or the gradient sums) in VMEM
  scratch, as jax's own TPU flash attention: VMEM holds a few blocks whatever T is.

``interpret=True`` runs the chosen family in Pallas interpret mode on any host (the tests run both
against the same float32 references). What the other fused backends get as prepared arrays, these
kernels compute per block from positions:

- RoPE (``RopeSpec``): q and k blocks are rotated as they are loaded, cos/sin from the positions
  and frequencies: ``float32(p) * float32(inv_freq)`` (``phase_precision="float32"``, HF / Meta's
  phases) or ``apply_rope``'s exact phases (``"exact"``: its fixed-point turns in 12-bit chunks,
  reduced with exact float32 products, within ~6e-7 rad for positions below 2^24), times
  ``attention_factor`` and xPos's scale; the q/k gradients are rotated back (the transpose) in the backward kernels. No rotated
  q/k is written to memory. GPU, ``"half"`` layout (h = R / 2 and the unrotated rest D - R powers of
  two or 0): the two halves are read as lane ranges and rotated elementwise (``x1 cos - x2 sin``,
  ``x2 cos + x1 sin``), ``q.k`` summed over the ranges (no matmul beyond attention's own).
  ``"interleaved"`` (its pairs are adjacent lanes), other widths and every layout on TPU (no
  sub-128 lane slices): the partner is a matmul with a constant signed permutation ``[D, D]``,
  ``2 block D^2`` FLOPs per block rotated (TPU: once per q or k block, cached in VMEM).
- ALiBi (``AlibiSpec``): the native bias ``-m_h (i - j)`` from the position blocks (no emulation
  dims, no ``[B, N, T, S]`` array); ``form`` / ``order`` / ``theta`` / ``max_position`` are not
  used (they describe the emulation of the other fused backends).
- ``precise_dims`` (``rope_alibi``'s float32 emulation dims of q and k): contracted in float32 at
  HIGHEST inside the kernel, beside the content dims.
- Masks: causal (key blocks past the diagonal are skipped), padding and packed documents as
  segment ids (``masks.kernel_segment_ids``); rows of padding queries return zeros, as on the
  other fused backends. Grouped-query heads read their kv head through the index map (no repeat).
- Attention patterns (``attend``'s ``local_window_size``, ``chunk_size``, ``logits_soft_cap``; the
  contract of ``jaxpe.attention.attention``): a sliding window ``(left, right)`` and Llama 4's chunks
  on token indices, masked per element inside the blocks they cut, and the key blocks wholly outside
  every row's window / chunk of a q block never loaded nor computed (``flash_patterns.key_blocks`` /
  ``query_blocks``: the Triton loops run over the needed blocks only; the Mosaic grids' sequential
  axis has as many steps as the widest row of blocks needs, not T / block: ``flash_patterns.span``);
  Gemma 2's soft cap ``cap tanh(s / cap)`` on the scaled scores before the native ALiBi bias and the
  mask (the backward multiplies ``ds`` by ``1 - tanh^2``).
- Attention sinks (``sinks [N]``, gpt-oss; arXiv 2309.17453): the online softmax of each row
  starts from the sink (running max ``sink_h``, sum 1), so ``exp(sink_h)`` is in the denominator
  and the saved log-sum-exp; the backward kernels need nothing more (the probabilities from that
  lse already include it) and the sink logits' gradient ``-sum_rows exp(sink_h - lse) delta`` is
  one elementwise pass over the row statistics (``_sink_grad``).
- T is padded to whole blocks (``backends.kernel_length``), q/k, v and emulation dims to powers of two
  (a copy; on GPU with T already whole blocks q, k, v are read in place instead, the Triton kernels
  masking the lanes past H: ``flash_kernels.Config.lanes``).

Backward: ``jax.custom_vjp`` with two Pallas kernels (dq; dk and dv), recomputing the
probabilities from the saved log-sum-exp (FlashAttention-2, Dao, arXiv 2307.08691). Gradients
flow to q, k and v (emulation dims included); positions, ``inv_freq``, ALiBi slopes and xPos
settings are constants (not differentiated). First-order gradients only: ``jax.grad`` of ``jax.grad``
(or ``jax.hessian``) fails at trace time ("Linearization failed"), as for jax's own Pallas kernels;
the ``xla`` backend (blockwise) has second derivatives.

What a CPU proves and what only a device does: ``jax.export`` for ``"cuda"`` (``target="gpu"``)
or ``"tpu"`` (``target="tpu"``) runs every Pallas lowering rule, so each option above, forward and
backward, bf16 and float32, is checked on CPU to use only ops, block shapes (Mosaic's (8, 128)
rule) and compiler params the lowering accepts, and to emit ``__gpu$xla.gpu.triton`` /
``tpu_custom_call`` (tests/attention/flash_lowering_test.py). With libtpu installed, XLA:TPU and
Mosaic also compile the TPU kernels on CPU for a deviceless topology: every option, forward and
backward, bf16 and float32, compiles for v4, v5e, v5p and v6e (tests/attention/tpu_compile_test.py
for v5e and v6e; docs/accelerator.md). Interpret mode proves the numerics of the kernels'
arithmetic on CPU. With jax's CUDA plugin, XLA:GPU, Triton and ptxas compile the GPU kernels for a
deviceless H100 and A100 (shared-memory limit included; ``gpu_block`` sizes the blocks for the card,
``gpu_cards``): H 64, 80,
96, 128 and 256, with and without ALiBi and emulation dims, bf16 and float32, forward and gradient
(tests/attention/gpu_compile_test.py; docs/accelerator.md). The speed, and the
numerics of the GPU / TPU matmul units (float32 operands at HIGHEST, bf16 at DEFAULT: exact
products) are proven only on a device: not yet run on a GPU or TPU.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
E emulation dims, D padded head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import flash_kernels, flash_tpu, gpu_cards, patterns
from jaxpe.attention.backends import AlibiSpec, kernel_length, padded_head_dim
from jaxpe.attention.fused import check_kernel_operands
from jaxpe.attention.masks import AttentionMask, dense_segment_ids, kernel_segment_ids
from jaxpe.attention.rope_spec import RopeSpec, kernel_tables
from jaxpe.ops import checks as _checks

MAX_BLOCK = 128
"""Rows per q and k block (T up to 128 runs as one block of the next power of two >= 16)."""

PIPELINE_ROWS = 2
"""Copies of a q/k row plus a v row ``gpu_block`` counts per block row of a Triton flash kernel (the
other side's blocks in ``num_stages`` = 2 pipeline buffers, ``flash_kernels.triton_params``; its own
side's block and Triton's layout scratch fit in what that leaves: measured below)."""


EXTRA_LANES = 64
"""Float32 lanes a row of emulation dims is counted as at least (``gpu_block``), four copies: Triton
lays the narrow float32 ``[rows, E]`` operands of the backward's extra matmuls out wider than E."""

SLACK = 2048
"""Bytes ``gpu_block`` adds to every kernel's count (Triton's barriers and rounding; measured below)."""


def gpu_block(
  width: int, v_width: int, itemsize: int, extra_width: int = 0, budget: int | None = None
) -> int:
  """Rows per q and k block of the Triton kernels (``target="gpu"``): the largest power of two
  <= ``MAX_BLOCK`` (and >= 16) whose bytes fit ``budget`` bytes of shared memory, by default the
  card's (``gpu_cards.shared_memory()``: 232448 on an H100 / H200, 166912 on an A100, 101376 on an
  L4; the card a program is built for, ``gpu_cards.card``).

  A block of b rows is counted as ``b * PIPELINE_ROWS * (width + v_width) * itemsize`` (q/k and v
  blocks) ``+ b * b * itemsize`` (the backward's ``[b, b]`` probability / score tile, an operand of
  its transposed matmuls) ``+ b * 16 * max(extra_width, EXTRA_LANES)`` (emulation dims, when any)
  ``+ SLACK``. Fitted to what Triton asked for at 128 rows, B 2 x T 256 x N 4 (XLA's "requested
  ...", deviceless A100 compiles; the largest kernel of the gradient where noted): bf16 H 128
  forward 98816 and the gradient within 166912 (counted 165888), bf16 H 256 forward 229888 (297984),
  float32 H 128 forward 262656 (329728), float32 H 64 gradient 198144 (198656), bf16 H 64 with 2
  emulation dims gradient 167424 (231424), bf16 H 128 with them 199168 (297984). So: bf16 H <= 128
  128 rows on an H100 and an A100; bf16 H 256, float32 H 80-128 64 on both; float32 H 64 and bf16 H
  64 with emulation dims 128 on an H100, 64 on an A100 (198144 and 167424 bytes exceed its 166912);
  float32 H 256 32. On an H100 the same blocks as the first count (``3 x b x row bytes``) gave.

  Args:
    width: padded q/k head dim D. v_width: padded v head dim Dv. itemsize: bytes of q/k/v's dtype.
    extra_width: padded emulation dims E (``precise_dims``; float32), 0 without. budget: bytes of
    shared memory per block (default: the card's).
  """
  if budget is None:
    budget = gpu_cards.shared_memory()
  extra = 16 * max(extra_width, EXTRA_LANES) if extra_width else 0
  row = PIPELINE_ROWS * (width + v_width) * itemsize + extra
  block = MAX_BLOCK
  while block > 16 and block * (row + block * itemsize) + SLACK > budget:
    block //= 2
  return block


def default_block(
  t_len: int, head_dim: int, itemsize: int, precise_dims: int = 0, target: str = "gpu"
) -> int:
  """Rows per q and k block ``attend`` runs when given no ``block``: ``min(MAX_BLOCK, T')`` (T' =
  ``kernel_length("flash", T)``: T up to 128 as one block), on ``target="gpu"`` at most
  ``gpu_block`` of the padded head dim H and emulation dims E (the Triton kernels' shared memory).
  The one place the block is chosen (the cost model of ``benchmarks/attention_bench.flash_flops``
  counts block pairs with it).

  Args:
    t_len: T, token positions. head_dim: H of v. itemsize: bytes of the widest of q, k, v's dtypes.
    precise_dims: E (float32 emulation dims), 0 without. target: one of ``TARGETS``.
  """
  block = min(MAX_BLOCK, kernel_length("flash", t_len))
  if target == "gpu":  # wide heads: fewer rows, so the Triton kernels fit the shared memory
    wide = padded_head_dim("flash", head_dim)
    extra = padded_head_dim("flash", precise_dims) if precise_dims else 0
    block = min(block, gpu_block(wide, wide, itemsize, extra))
  return block


TARGETS = ("gpu", "tpu")
"""``attend``'s kernel families: Triton (``flash_kernels``) and Mosaic (``flash_tpu``)."""


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: AttentionMask | None,
  bias: jax.Array | None = None,
  alibi_spec: AlibiSpec | None = None,
  rope_spec: RopeSpec | None = None,
  precise_dims: int = 0,
  interpret: bool = False,
  sinks: jax.Array | None = None,
  block: int | None = None,
  target: str = "gpu",
  local_window_size: int | tuple[int, int] | None = None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
) -> jax.Array:
  """``jaxpe.attention.attention`` on ``flash``, its shared checks done: ``[B, T, N, H]`` of v's dtype.

  Args:
    q: ``[B, T, N, H + E]`` float queries (E = ``precise_dims``), not rotated when ``rope_spec``
      is given (its first H dims are rotated in the kernel).
    k: ``[B, T, K, H + E]`` float keys, ``N % K == 0``.
    v: ``[B, T, K, H]`` float values.
    scale: score scale, > 0.
    mask: an ``AttentionMask`` or None.
    bias: must be None (the kernel takes no dense bias).
    alibi_spec, rope_spec: checked specs (``check_alibi_spec`` / ``check_rope_spec``).
    precise_dims: E, trailing float32 dims of q and k (contracted in float32).
    interpret: run the kernels of ``target`` in Pallas interpret mode (CPU).
    sinks: None or ``[N]`` float attention-sink logits (gpt-oss; arXiv 2309.17453): ``exp(sink_h)``
      starts each row's online softmax (running max ``sink_h``, sum 1), a term with no value;
      differentiable (``d sink_h = -sum_rows exp(sink_h - lse) * delta``, delta = ``sum(o * do)``,
      from the forward's log-sum-exp, which includes the sink).
    block: rows per block, a power of two >= 8 (tests); default ``kernel_length`` (T up to 128
      as one block, else 128; ``target="gpu"``: fewer rows for wide heads, ``gpu_block``). ``target="tpu"`` outside interpret mode: a multiple of 128 or at
      least the padded T (Mosaic's tiling of the key-row operands).
    target: ``"gpu"`` (Triton kernels, ``flash_kernels``) or ``"tpu"`` (Mosaic kernels blocked
      over k/v, ``flash_tpu``); lower them for ``"cuda"`` / ``"tpu"`` respectively.
    local_window_size: None, an int w (``(w, w)``) or ``(left, right)`` ints >= 0 in tokens: query i
      sees key j only if ``i - left <= j <= i + right`` (jax.nn.dot_product_attention's meaning;
      with ``mask.causal``, ``(left, 0)``). Key blocks wholly outside every row's window of a q
      block are skipped (GPU: the loop bounds; TPU: not on the grid), the rest masked per element.
    chunk_size: None or an int >= 1 (Llama 4's ``attention_chunk_size``): query i sees key j only if
      ``i // chunk_size == j // chunk_size``; key blocks of other chunks are skipped as above.
      i and j are token indices in the row (in a packed row, document boundaries come from the
      segment ids; chunks and windows count from the row's start).
    logits_soft_cap: None or a finite float > 0 (Gemma 2's ``attn_logit_softcapping``): the scaled
      scores become ``cap * tanh(s / cap)`` before the native ALiBi bias, the mask and the sinks;
      the backward multiplies ``ds`` by ``1 - tanh^2``. Refused with ``precise_dims`` > 0 (the
      ``rope_alibi`` emulation dims put ALiBi inside ``q.k``, which the cap would bend).

  Raises:
    ValueError: a bias, a dense mask or an IndexMask, sinks not a float ``[N]``, T != S, H = 0, q/k not H + E dims,
      concrete positions >= 2^24 with ``RopeSpec.phase_precision="exact"``, a bad ``block``,
      a ``target`` not in ``TARGETS``, a window side < 0, ``chunk_size`` < 1, ``logits_soft_cap``
      not finite > 0, ``logits_soft_cap`` with ``precise_dims`` > 0.
    TypeError: a window, chunk size or cap of the wrong type (``patterns.check_pattern``).
  """
  if target not in TARGETS:
    raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
  window, chunk, cap = patterns.check_pattern(local_window_size, chunk_size, logits_soft_cap)
  if cap is not None and precise_dims:
    raise ValueError(
      f"attention implementation 'flash' cannot take logits_soft_cap with precise_dims={precise_dims} "
      "(emulated ALiBi dims inside q.k would be soft-capped); give ALiBi as alibi_spec (added after "
      "the cap in the kernel) and precise_dims=0"
    )
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (q.shape[2],) or not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(
        f"sinks must be a float array [N] = [{q.shape[2]}], got {sinks.dtype}{list(sinks.shape)}"
      )
  if bias is not None:
    raise ValueError(
      "attention implementation 'flash' takes no bias tensor: for ALiBi pass alibi_spec=AlibiSpec(...) "
      "(a native bias inside the kernel) or use implementation='xla'"
    )
  check_kernel_operands("flash", q, k, v, mask, precise_dims)
  batch, t_len, num_heads, _ = q.shape
  num_kv, head_dim = k.shape[2], v.shape[-1]
  if rope_spec is not None and rope_spec.phase_precision == "exact":
    for name, pos in (("q_positions", rope_spec.q_positions), ("k_positions", rope_spec.k_positions)):
      if not isinstance(pos, jax.core.Tracer) and np.size(pos) and int(np.max(np.asarray(pos))) >= 2**24:
        raise ValueError(
          f"RopeSpec.{name} reach {int(np.max(np.asarray(pos)))}: the flash kernel's exact phases hold "
          "positions below 2^24; use phase_precision='float32'"
        )
  if block is None:
    length = kernel_length("flash", t_len)
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q, k, v))
    block = default_block(t_len, head_dim, itemsize, precise_dims, target)
  else:
    if not _checks.is_int(block) or block < 8 or block & (block - 1):
      raise ValueError(f"block must be a power of two >= 8, got {block!r}")
    block = int(block)
    length = -(-t_len // block) * block
    if target == "tpu" and not interpret and block % 128 and block < length:
      raise ValueError(
        f"block must be a multiple of 128 or at least the padded T ({length}) for target='tpu' "
        f"outside interpret mode (Mosaic's (8, 128) tiling), got {block}"
      )
  if batch == 0 or t_len == 0:
    return jnp.zeros((batch, t_len, num_heads, head_dim), v.dtype)
  mask = mask or AttentionMask(causal=False)
  if mask.segment_ids is not None:
    mask = dataclasses.replace(mask, segment_ids=dense_segment_ids(mask.segment_ids))

  dim = padded_head_dim("flash", head_dim)
  extra_t = length - t_len
  # GPU, T a whole number of blocks: q, k, v stay H wide (no padded copies around the kernels); the
  # Triton blocks are D = dim lanes wide and lanes >= H are masked in the kernels (Config.lanes)
  lanes = head_dim if target == "gpu" and not extra_t and dim != head_dim else 0

  def pad(x, width):  # [B, T, ., W] -> [B, length, ., width] (zeros past T and W; none: no copy)
    if not extra_t and width == x.shape[-1]:
      return x
    return jnp.pad(x, ((0, 0), (0, extra_t), (0, 0), (0, width - x.shape[-1])))

  def layout(x, width):  # gpu: [B, length, ., width], read in place; tpu: [B, ., length, width]
    return pad(x, width) if target == "gpu" else jnp.transpose(pad(x, width), (0, 2, 1, 3))

  def row(x, dtype=jnp.float32):  # [B, T] -> [B, 1, length]
    return jnp.pad(x, ((0, 0), (0, extra_t)))[:, None, :].astype(dtype)

  def column(x, dtype=jnp.float32):  # [B, T] -> [B, length, 1] (gpu); tpu: [B, 1, length], lane-dense
    if target == "tpu":
      return row(x, dtype)
    return jnp.pad(x, ((0, 0), (0, extra_t)))[:, :, None].astype(dtype)

  aux: dict[str, jax.Array] = {}
  qe = ke = None
  if precise_dims:
    width = padded_head_dim("flash", precise_dims)  # a power of two: Triton loads power-of-two blocks
    qe = layout(q[..., head_dim:].astype(jnp.float32), width)
    ke = layout(k[..., head_dim:].astype(jnp.float32), width)
  if window is not None:  # a side reaching the padded T restricts nothing (and stays int32-safe)
    window = tuple(None if side >= length else side for side in window)
    window = None if window == (None, None) else window
  cfg = flash_kernels.Config(
    scale=float(scale),
    causal=mask.causal,
    block=block,
    groups=num_heads // num_kv,
    interpret=interpret,
    target=target,
    window=window,
    chunk=chunk if chunk is not None and chunk < length else None,
    soft_cap=cap,
    sinks=sinks is not None,
    length=length,
    lanes=lanes,
  )
  if rope_spec is not None:
    tables = kernel_tables(rope_spec, dim)
    aux.update(rq=column(rope_spec.q_positions), rk=column(rope_spec.k_positions))
    exact = rope_spec.phase_precision == "exact"
    split = rope_split(rope_spec.layout, rope_spec.inv_freq.shape[0], dim) if target == "gpu" else 0
    aux["amp"] = tables["amp"]
    if not split:
      aux["perm"] = tables["perm"]
    if exact:
      aux["turns"] = tables["turns"]
    else:
      aux["freq"] = tables["freq"]
    xpos = rope_spec.xpos_scale_base is not None
    if xpos:  # float32(p - offset), the int32 difference of xpos_scale
      offset = jnp.int32(rope_spec.xpos_offset)
      aux.update(
        xq=column(rope_spec.q_positions.astype(jnp.int32) - offset),
        xk=column(rope_spec.k_positions.astype(jnp.int32) - offset),
        logz=tables["logz"],
      )
    cfg = dataclasses.replace(
      cfg,
      rope=True,
      xpos=xpos,
      exact=exact,
      scale_base=float(rope_spec.xpos_scale_base or 512.0),
      split=split,
    )
  if alibi_spec is not None:
    aux.update(
      aq=column(alibi_spec.q_positions, jnp.int32),  # int32: i - j exact in the kernel (as alibi_bias)
      ak=row(alibi_spec.k_positions, jnp.int32),
      slopes=jnp.asarray(alibi_spec.slopes, jnp.float32).reshape(num_heads, 1, 1),
    )
  valid = None if mask.valid is None else mask.valid.astype(bool)
  kernel_mask = dataclasses.replace(
    mask,
    valid=None
    if valid is None and not extra_t
    else jnp.pad(jnp.ones((batch, t_len), bool) if valid is None else valid, ((0, 0), (0, extra_t))),
    segment_ids=None if mask.segment_ids is None else jnp.pad(mask.segment_ids, ((0, 0), (0, extra_t))),
  )
  ids = kernel_segment_ids(kernel_mask, batch, length)
  if ids is not None:
    aux.update(sq=ids[:, None, :] if target == "tpu" else ids[:, :, None], sk=ids[:, None, :])
  sink_logits = None if sinks is None else sinks.astype(jnp.float32)
  out = _flash(
    cfg,
    layout(q[..., :head_dim], lanes or dim),
    layout(k[..., :head_dim], lanes or dim),
    layout(v, lanes or dim),
    qe,
    ke,
    sink_logits,
    aux,
  )
  if target == "tpu":
    out = jnp.transpose(out, (0, 2, 1, 3))
  out = out[:, :t_len, :, :head_dim]
  if valid is not None:
    out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out.astype(v.dtype)


def rope_split(layout: str, half: int, dim: int) -> int:
  """The rotate-half width h the kernel rotates elementwise (``flash_kernels.Config.split``), or 0
  for the ``[D, D]`` permutation matmul: ``"half"`` layout with h (= R / 2) and ``dim - 2h`` (the
  unrotated rest, padding included) powers of two or 0, so each lane range is a power-of-two block
  (Triton); ``"interleaved"`` pairs are adjacent lanes, which lane ranges cannot separate."""
  rest = dim - 2 * half
  pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
  return half if layout == "half" and pow2(half) and (rest == 0 or pow2(rest)) else 0


_KERNELS = {"gpu": flash_kernels, "tpu": flash_tpu}


def _kernel_aux(qe, ke, aux, sinks=None):
  extra = dict(aux)
  if qe is not None:
    extra.update(qe=qe, ke=ke)
  if sinks is not None:  # the forward kernel's only: [N, 1, 1], read as slopes are
    extra["sinks"] = sinks.reshape(-1, 1, 1)
  return extra


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, qe, ke, sinks, aux):
  """``o`` in the kernel layout (``[B, T, N, Dv]`` gpu, ``[B, N, T, Dv]`` tpu), differentiable in q, k,
  v, qe, ke and the float32 sink logits ``[N]`` (or None); undifferentiated, the forward kernel writes
  no log-sum-exp (the backward's residual)."""
  return _KERNELS[cfg.target].forward(q, k, v, _kernel_aux(qe, ke, aux, sinks), cfg, residuals=False)[0]


def _flash_fwd(cfg, q, k, v, qe, ke, sinks, aux):
  o, lse = _KERNELS[cfg.target].forward(q, k, v, _kernel_aux(qe, ke, aux, sinks), cfg)
  return o, (q, k, v, qe, ke, sinks, aux, o, lse)


def _flash_bwd(cfg, res, do):
  q, k, v, qe, ke, sinks, aux, o, lse = res
  dq, dk, dv, dqe, dke = _KERNELS[cfg.target].backward(q, k, v, _kernel_aux(qe, ke, aux), o, lse, do, cfg)
  zeros = jax.tree.map(jnp.zeros_like, aux)  # positions, tables, slopes, ids: constants
  dsinks = None if sinks is None else _sink_grad(cfg, sinks, o, lse, do)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dqe, dke, dsinks, zeros


def _sink_grad(cfg, sinks, o, lse, do):
  """``d sink_h = -sum_{b, t} P_sink * delta``: the sink is one more score with no value (its
  ``dP = 0``), so its ``ds = P_sink (0 - delta)``, ``P_sink = exp(sink_h - lse)`` (lse includes the
  sink: finite), ``delta = sum(o * do)`` over the value dims (zero on padding rows: no cotangent)."""
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # gpu [B, T, N]; tpu [B, N, T]
  if cfg.target == "gpu":
    delta = jnp.transpose(delta, (0, 2, 1))
  lse = lse.reshape(delta.shape)  # [B, N, T, 1] (gpu) or [B, N, 1, T] (tpu) -> [B, N, T]
  return -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2))


_flash.defvjp(_flash_fwd, _flash_bwd)
