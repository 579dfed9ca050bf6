"""Attention backends x encodings: time and memory, as ratios against ``xla`` in the same run.

  python benchmarks/attention_bench.py [--lengths 1024 2048 ...] [--heads 16] [--head-dim 64]
  python benchmarks/attention_bench.py --cost-table [--heads 16] [--kv-heads 16] [--head-dim 64 128]

``--cost-table`` prints only the cost table (any platform, nothing runs): for each fused backend and
form (``rope``, the baseline; ``alibi lean``, ``alibi exact``, ``alibi rotated k=1``, ``rope_alibi``)
the shapes its kernel receives, read with ``jax.eval_shape`` of ``jaxpe.attention.fused.prepare``
(bf16 q/k/v): extra q/k dims, the padded q/k dim, the v dim, FLOPs of the two attention matmuls
(``2 N T'^2 (Dqk + Dv)``) and bytes of q, k, v and the output the kernel reads and writes, both
relative to ``rope`` on the same backend with the same H, and those bytes (MiB, B 1) at T 1k..64k
(the kernels' memory is O(T): these operands and per-row softmax statistics). pallas_gpu repeats
the kv heads inside its ``attend`` (its ``mha`` has no grouped heads): its bytes count N heads.
``flash`` (jaxpe's own kernel) rows: ``rope`` (an interleaved ``RopeSpec``, rotated in the kernel
with a ``[D, D]`` permutation matmul), ``rope half`` (rotate-half: elementwise, no matmul), ``alibi``
(native bias in the kernel), ``rope_alibi`` (its 2 float32 dims contracted in the kernel),
``rope + alibi`` (both specs); operands from its layout rules (``flash_kernel_operands``), matmul
FLOPs of its forward, dq and dk/dv kernels counted with the ``[D, D]`` rotation matmuls
(``flash_flops``), also against plain attention on flash (``none``), and the native bias's
elementwise ops apart.

For each context T, encoding and backend (``jaxpe.attention``) it compiles one causal self-attention
forward (B = 1 sequence, N heads, K = N, head dim H) and prints:
  * extra q/k dims of the ALiBi emulation and the head dim the kernel computes with (padding), with
    the FLOP ratio of the two attention matmuls against an unpadded H (causal FLOPs
    ``2 B N T^2 (Dqk + Dv) / 2``);
  * temporaries of the compiled program (``compiled.memory_analysis().temp_size_in_bytes``; on a GPU
    also the device's peak bytes in use after the run), and its ratio against ``xla`` for the same
    encoding;
  * median wall time when the run fits (``--time-max-gib`` of temporaries), and its ratio against
    ``xla``.
Encodings: ``rope`` (stands for every encoding that only transforms q and k: none, learned,
sinusoidal, rope, xpos), ``alibi`` (``xla``: native bias; fused kernels: the lean bf16 emulation),
``alibi_rot`` (rotated emulation, order 1, on fused kernels), ``rope_alibi`` (order 1).
Backends not native to this machine are skipped, except the Pallas kernels, which run in interpret
mode (marked ``interp``: their time and memory say nothing about a GPU or TPU), timed up to
``--interpret-max-len`` and compiled for memory up to ``--interpret-memory-max-len``. On a GPU or TPU
the same command runs the real kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe import emulation
from jaxpe.attention import backends, flash, flash_kernels, flash_patterns, fused, kernels, masks
from jaxpe.ops import alibi, rope

ENCODINGS = ("rope", "alibi", "alibi_rot", "rope_alibi")
GIB = 2.0**30


def _attention_fn(backend: str, encoding: str, t_len: int, heads: int, head_dim: int, interpret: bool):
  slopes = alibi.alibi_slopes_f64(heads)
  mask = masks.AttentionMask(causal=True)
  theta = emulation.emulation_theta(max_phase=0.1, max_len=t_len)

  def fn(q, k, v):
    pos = jnp.arange(t_len, dtype=jnp.int32)[None]
    kw = dict(scale=head_dim**-0.5, mask=mask, implementation=backend, interpret=interpret)
    if encoding == "rope":
      inv = rope.rope_inv_freq(head_dim)
      return kernels.attention(
        rope.apply_rope(q, pos, inv_freq=inv, layout="interleaved"),
        rope.apply_rope(k, pos, inv_freq=inv, layout="interleaved"),
        v,
        **kw,
      )
    if encoding in ("alibi", "alibi_rot"):
      form = "lean" if encoding == "alibi" else "rotated"
      spec = backends.AlibiSpec(slopes, pos, pos, max_position=t_len, form=form, order=1, theta=theta)
      return kernels.attention(q, k, v, alibi_spec=spec, **kw)
    q_aug, k_aug = emulation.apply_rope_alibi(q, k, pos, pos, slopes=slopes, theta=theta, order=1)
    return kernels.attention(q_aug, k_aug, v, precise_dims=2, **kw)

  return fn


def _dims(backend: str, encoding: str, head_dim: int, t_len: int, heads: int) -> tuple[int, int]:
  """(extra q/k dims, head dim the kernel computes with)."""
  form = {"rope": None, "alibi": "lean", "alibi_rot": "rotated", "rope_alibi": "rotated"}[encoding]
  if backend in ("xla", "flash", "tokamax") and encoding == "alibi_rot":
    form = None  # xla, flash and tokamax run ALiBi natively
  slopes = alibi.alibi_slopes_f64(heads)
  extra = backends.emulation_dim_count(
    backend, alibi_form=form, order=1, max_position=t_len, slopes=slopes, scale=head_dim**-0.5
  )
  return extra, backends.padded_head_dim(backend, head_dim + extra)


COST_FORMS = ("rope", "alibi lean", "alibi exact", "alibi rotated k=1", "rope_alibi")
COST_BACKENDS = ("cudnn", "splash", "pallas_gpu")
COST_LENGTHS = (1024, 4096, 16384, 65536)


def kernel_shapes(backend: str, form: str, t_len: int, heads: int, kv_heads: int, head_dim: int) -> dict:
  """Shapes the kernel of ``backend`` receives for ``form``: ``{"q", "k", "v"}`` (``[B, T', ., D]``, B 1).

  Read with ``jax.eval_shape`` of ``fused.prepare`` (bf16 inputs), so no kernel runs (cuDNN's
  shapes are read on CPU too); pallas_gpu's kv heads as its ``attend`` repeats them.
  """
  slopes = alibi.alibi_slopes_f64(heads)
  theta = emulation.emulation_theta(max_phase=0.1, max_len=max(t_len, 2))
  bf16 = jnp.bfloat16
  q = jax.ShapeDtypeStruct((1, t_len, heads, head_dim), bf16)
  k = jax.ShapeDtypeStruct((1, t_len, kv_heads, head_dim), bf16)
  mask = masks.AttentionMask(causal=True)

  def prep(q, k, v):
    pos = jnp.arange(t_len, dtype=jnp.int32)[None]
    spec, precise = None, 0
    if form.startswith("alibi"):
      kind = form.split()[1]
      spec = backends.AlibiSpec(slopes, pos, pos, max_position=65536, form=kind, order=1, theta=theta)
      spec = backends.check_alibi_spec(spec, 1, t_len, t_len, heads, fused=True)
    elif form == "rope_alibi":
      q, k = emulation.apply_rope_alibi(q, k, pos, pos, slopes=slopes, theta=theta, order=1)
      v = jnp.repeat(v, k.shape[2] // v.shape[2], axis=2)  # per-head rotated keys: N kv heads
      precise = 2
    qf, kf, vf, _ = fused.prepare(
      q, k, v, scale=head_dim**-0.5, mask=mask, alibi_spec=spec, precise_dims=precise, implementation=backend
    )
    return qf, kf, vf

  qf, kf, vf = jax.eval_shape(prep, q, k, k)
  shapes = {"q": qf.shape, "k": kf.shape, "v": vf.shape}
  if backend == "pallas_gpu":  # attend repeats the kv heads for jax's mha
    shapes["k"] = (*kf.shape[:2], heads, kf.shape[3])
    shapes["v"] = (*vf.shape[:2], heads, vf.shape[3])
  return shapes


def cost_row(backend: str, form: str, heads: int, kv_heads: int, head_dim: int, lengths=COST_LENGTHS) -> dict:
  """One row of the cost table (see the module docstring); ratios against ``rope`` on ``backend``."""

  def cost(f, t_len):
    sh = kernel_shapes(backend, f, t_len, heads, kv_heads, head_dim)
    t_k, d_qk, d_v = sh["q"][1], sh["q"][3], sh["v"][3]
    flops = 2 * heads * t_k * t_k * (d_qk + d_v)
    n_bytes = 2 * t_k * (heads * d_qk + sh["k"][2] * d_qk + sh["v"][2] * d_v + heads * d_v)  # bf16
    return sh, flops, n_bytes

  t_ref = 1024
  sh, flops, n_bytes = cost(form, t_ref)
  _, flops_rope, bytes_rope = cost("rope", t_ref)
  extra = emulation_extra_dims(backend, form, heads, head_dim)
  return {
    "backend": backend,
    "form": form,
    "extra": extra,
    "qk_dim": sh["q"][3],
    "v_dim": sh["v"][3],
    "k_heads": sh["k"][2],
    "flops": flops / flops_rope,
    "bytes": n_bytes / bytes_rope,
    "mib": {t: cost(form, t)[2] / 2**20 for t in lengths},
  }


def emulation_extra_dims(backend: str, form: str, heads: int, head_dim: int) -> int:
  """Extra q/k dims of ``form`` before padding (``backends.emulation_dim_count``)."""
  if form == "rope":
    return 0
  kind = "rotated" if form in ("alibi rotated k=1", "rope_alibi") else form.split()[1]
  return backends.emulation_dim_count(
    backend,
    alibi_form=kind,
    order=1,
    max_position=65536,
    slopes=alibi.alibi_slopes_f64(heads),
    scale=head_dim**-0.5,
  )


FLASH_FORMS = ("rope", "rope half", "alibi", "rope_alibi", "rope + alibi")
FLASH_EMULATION_DIMS = 2  # rope_alibi of order 1: float32 dims of q and k


def flash_kernel_operands(form: str, t_len: int, heads: int, kv_heads: int, head_dim: int) -> dict:
  """``{name: (shape, dtype name)}`` of the ``flash`` forward kernel's operands and output ``o`` (B 1).

  From the layout rules of ``jaxpe.attention.flash`` (not traced), the Triton kernels' token-major
  ``[B, T', heads, D]`` (the TPU kernels take the same operands head-major): T' = ``kernel_length``,
  q/k and v padded to D = ``padded_head_dim("flash", H)``; ``rope`` / ``rope + alibi`` pass an interleaved
  ``RopeSpec`` (unrotated q/k; positions, ``perm [D, D]``, ``amp``, exact-phase ``turns``), ``rope
  half`` a rotate-half one (R = H; no ``perm`` where ``flash.rope_split`` rotates elementwise), ``alibi`` an
  ``AlibiSpec`` (positions and slopes), ``rope_alibi`` q/k rotated by ``apply_rope_alibi`` (float32,
  its default ``out_dtype``; K kv heads) plus its 2 float32 dims as ``qe`` / ``ke``; segment ids where T is padded; ``none``: none.
  """
  length, d = backends.kernel_length("flash", t_len), backends.padded_head_dim("flash", head_dim)
  qk_dtype = "float32" if form == "rope_alibi" else "bfloat16"  # apply_rope_alibi's out_dtype
  ops = {
    "q": ((1, length, heads, d), qk_dtype),
    "k": ((1, length, kv_heads, d), qk_dtype),
    "v": ((1, length, kv_heads, d), "bfloat16"),
    "o": ((1, length, heads, d), "bfloat16"),
  }
  column, row = (1, length, 1), (1, 1, length)
  if form == "rope_alibi":  # the key part is head-independent: K kv heads
    ops["qe"] = ((1, length, heads, FLASH_EMULATION_DIMS), "float32")
    ops["ke"] = ((1, length, kv_heads, FLASH_EMULATION_DIMS), "float32")
  if form in ("rope", "rope half", "rope + alibi"):
    ops.update(rq=(column, "float32"), rk=(column, "float32"))
    ops.update(amp=((1, d), "float32"), turns=((8, d), "float32"))
    if form != "rope half" or not flash.rope_split("half", head_dim // 2, d):
      ops["perm"] = ((d, d), "float32")  # the rotation matmul's signed permutation
  if form in ("alibi", "rope + alibi"):
    ops.update(aq=(column, "int32"), ak=(row, "int32"), slopes=((heads, 1, 1), "float32"))
  if length > t_len:  # padded rows: segment ids
    ops.update(sq=(column, "int32"), sk=(row, "int32"))
  return ops


def flash_flops(form: str, t_len: int, heads: int, kv_heads: int, head_dim: int) -> dict:
  """Matmul FLOPs of the ``flash`` kernels (``fwd``, ``dq``, ``dkv``; B 1, causal) and ``alibi_ops``.

  Counted from ``flash_kernels`` with the kernels' own block arithmetic (target ``"gpu"``, the
  Triton kernels): b = ``flash.default_block`` (128, or 64 where the Triton blocks must shrink for
  the shared memory, e.g. ``rope_alibi``'s float32 q/k with emulation dims), nb = T' / b, and the
  causal block pairs each program visits, ``flash_patterns.key_blocks`` (forward, dq) and
  ``query_blocks`` (dk/dv) summed over the blocks: nb (nb + 1) / 2 per head (a diagonal pair is a
  whole block). Per pair: ``q.k`` 2 b^2 (D + E), ``p.v``
  2 b^2 Dv (forward); dq adds ``do.v`` and ``ds.k`` (+ ``ds.ke``); dk/dv ``p.do``, ``do.v``,
  ``ds.q`` (+ ``ds.qe``). In-kernel RoPE (but the elementwise rotate-half: no ``perm``) rotates with
  the ``[D, D]`` permutation matmul (2 b D^2):
  the k block once per pair in forward and dq, the q block once per pair in dk/dv, and once per
  program the own block (forward), the own block and its gradient (dq, dk/dv). ``alibi_ops``:
  elementwise ops of the native bias ``s - m (i - j)`` (3 per score, in each of the 3 kernels).
  """
  ops = flash_kernel_operands(form, t_len, heads, kv_heads, head_dim)
  length, d = ops["q"][0][1], ops["q"][0][3]  # [B, T, N, D]
  dv, kk = ops["v"][0][3], ops["k"][0][2]
  e = FLASH_EMULATION_DIMS if "qe" in ops else 0
  itemsize = max(jnp.dtype(ops[x][1]).itemsize for x in ("q", "k", "v"))
  b = flash.default_block(t_len, head_dim, itemsize, e, "gpu")
  nb = length // b
  cfg = flash_kernels.Config(scale=1.0, causal=True, block=b, groups=heads // kk, length=length)
  visited = lambda blocks: sum(hi - lo for lo, hi in (blocks(cfg, i, nb) for i in range(nb)))  # noqa: E731
  pairs = heads * visited(flash_patterns.key_blocks)  # all heads
  pairs_kv = heads * visited(flash_patterns.query_blocks)  # K kv heads x G query heads each
  rot = 2 * b * d * d if "perm" in ops else 0
  score = 2 * b * b * (d + e)
  return {
    "fwd": pairs * (score + 2 * b * b * dv + rot) + heads * nb * rot,
    "dq": pairs * (score + 2 * b * b * dv + 2 * b * b * (d + e) + rot) + heads * nb * 2 * rot,
    "dkv": pairs_kv * (score + 4 * b * b * dv + 2 * b * b * (d + e) + rot) + kk * nb * 2 * rot,
    "alibi_ops": 3 * 3 * pairs * b * b if "slopes" in ops else 0,
  }


def flash_cost_row(
  form: str, heads: int, kv_heads: int, head_dim: int, lengths=COST_LENGTHS, t_ref: int = 1024
) -> dict:
  """A ``flash`` row of the cost table: ``cost_row``'s keys, FLOPs with the in-kernel rotation,
  and against plain attention on flash (``none``): ``flops_none`` (forward), ``train_none``
  (forward + dq + dk/dv) and ``alibi_ops`` (the bias's elementwise ops over all three kernels, over
  ``none``'s forward + backward matmul FLOPs). Bytes: every operand once (bf16 q, k, v, o; float32
  emulation dims, positions, tables), at B 1. Ratios at T = ``t_ref``."""

  def n_bytes(f, t_len):
    ops = flash_kernel_operands(f, t_len, heads, kv_heads, head_dim)
    return sum(int(np.prod(shape)) * jnp.dtype(dtype).itemsize for shape, dtype in ops.values())

  ops = flash_kernel_operands(form, t_ref, heads, kv_heads, head_dim)
  got, rope_f, none_f = (flash_flops(f, t_ref, heads, kv_heads, head_dim) for f in (form, "rope", "none"))
  train = lambda c: c["fwd"] + c["dq"] + c["dkv"]  # noqa: E731
  return {
    "backend": "flash",
    "form": form,
    "extra": FLASH_EMULATION_DIMS if "qe" in ops else 0,
    "qk_dim": ops["q"][0][3],
    "v_dim": ops["v"][0][3],
    "k_heads": ops["k"][0][2],
    "flops": got["fwd"] / rope_f["fwd"],
    "bytes": n_bytes(form, t_ref) / n_bytes("rope", t_ref),
    "flops_none": got["fwd"] / none_f["fwd"],
    "train_none": train(got) / train(none_f),
    "alibi_ops": got["alibi_ops"] / train(none_f),
    "mib": {t: n_bytes(form, t) / 2**20 for t in lengths},
  }


def print_cost_table(heads: int, kv_heads: int, head_dims) -> None:
  """The cost table as markdown, one block per H."""
  for h in head_dims:
    print(f"\nN {heads}, K {kv_heads}, H {h}, bf16, causal; ratios against rope on the same backend")
    print("(vs none: plain attention on the same backend; fwd+bwd and ALiBi ops: flash's three kernels)")
    mib = " | ".join(f"MiB T {t // 1024}k" for t in COST_LENGTHS)
    print(
      "| backend | form | extra dims | q/k dim | v dim | kv heads in kernel | FLOPs | bytes | FLOPs vs none "
      f"| fwd+bwd FLOPs vs none | ALiBi elementwise ops vs none | {mib} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(COST_LENGTHS))
    rows = [cost_row(b, f, heads, kv_heads, h) for b in COST_BACKENDS for f in COST_FORMS]
    rows += [flash_cost_row(f, heads, kv_heads, h) for f in FLASH_FORMS]
    for r in rows:
      cells = " | ".join(f"{r['mib'][t]:.3g}" for t in COST_LENGTHS)
      flash_row = r["backend"] == "flash"
      vs_none = r["flops_none"] if flash_row else r["flops"]  # rope outside the kernel: none's shapes
      train = f"{r['train_none']:.3g}x" if flash_row else "-"
      bias = f"{r['alibi_ops']:.3g}x" if flash_row else "0"
      print(
        f"| {r['backend']} | {r['form']} | {r['extra']} | {r['qk_dim']} | {r['v_dim']} | {r['k_heads']} | "
        f"{r['flops']:.3g}x | {r['bytes']:.3g}x | {vs_none:.3g}x | {train} | {bias} | {cells} |",
        flush=True,
      )


def _time(compiled, args, repeats: int) -> float:
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument(
    "--dtype", default=None, help="q/k/v dtype; default bfloat16 on GPU/TPU, float32 on CPU"
  )
  parser.add_argument("--interpret-max-len", type=int, default=1024, help="longest T timed in interpret mode")
  parser.add_argument(
    "--interpret-memory-max-len",
    type=int,
    default=8192,
    help="longest T compiled (memory only) in interpret mode",
  )
  parser.add_argument("--time-max-gib", type=float, default=2.0, help="time only runs with fewer temporaries")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cost-table", action="store_true", help="print only the cost table (runs nothing)")
  parser.add_argument("--kv-heads", type=int, default=None, help="K of the cost table (default N)")
  parser.add_argument("--cost-head-dims", type=int, nargs="+", default=[64, 128], help="H of the cost table")
  args = parser.parse_args()
  if args.cost_table:
    print_cost_table(args.heads, args.kv_heads or args.heads, args.cost_head_dims)
    return
  native = backends.platform_backends()
  on_cpu = jax.default_backend() == "cpu"
  dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
  n, h = args.heads, args.head_dim
  print(f"devices: {jax.devices()}; dtype {dtype.name}; B 1, N {n}, K {n}, H {h}; causal forward")
  print(
    "| T | encoding | backend | extra dims | head dim used | FLOP ratio | temp GiB | temp / xla | ms | time / xla |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for t_len in args.lengths:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, t_len, n, h)), dtype) for _ in range(3))
    refs = {}  # encoding -> (temp, secs) of xla; alibi_rot is compared with native ALiBi on xla
    for encoding in ENCODINGS:
      for backend in backends.BACKENDS:
        interpret = backend not in native
        if interpret and (backend == "cudnn" or t_len > args.interpret_memory_max_len):
          continue
        if backend == "xla" and encoding == "alibi_rot":
          continue  # the same program as xla alibi
        fn = _attention_fn(backend, encoding, t_len, n, h, interpret)
        try:
          compiled = jax.jit(fn).lower(q, k, v).compile()
        except Exception as err:  # noqa: BLE001  a kernel that refuses the size: say so, go on
          print(
            f"| {t_len} | {encoding} | {backend} | - | - | - | failed: {type(err).__name__}: {str(err)[:80]} | | | |"
          )
          continue
        temp = compiled.memory_analysis().temp_size_in_bytes
        extra, used = _dims(backend, encoding, h, t_len, n)
        v_dim = backends.padded_v_dim(backend, h, used)
        flop_ratio = (used + v_dim if backend != "xla" else 2 * h + extra) / (2 * h)
        secs = None
        if temp / GIB <= args.time_max_gib and not (interpret and t_len > args.interpret_max_len):
          secs = _time(compiled, (q, k, v), args.repeats)
          if not on_cpu:
            stats = jax.devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
              temp = max(temp, stats["peak_bytes_in_use"])
        if backend == "xla":
          refs[encoding] = (temp, secs)
        ref_temp, ref_secs = refs.get("alibi" if encoding == "alibi_rot" else encoding, (None, None))
        name = backend + (" (interp)" if interpret else "")
        temp_ratio = f"{temp / ref_temp:.3g}" if ref_temp else "-"
        time_ratio = f"{secs / ref_secs:.3g}" if secs and ref_secs else "-"
        ms = f"{secs * 1e3:.3g}" if secs else "-"
        print(
          f"| {t_len} | {encoding} | {name} | {extra} | {used} | {flop_ratio:.3g} | {temp / GIB:.3g} | {temp_ratio} "
          f"| {ms} | {time_ratio} |",
          flush=True,
        )


if __name__ == "__main__":
  main()
