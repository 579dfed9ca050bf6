"""The parts of ``benchmarks/accelerator_check.py`` (its docstring says what each measures).

Each ``part_x(cfg, clock, result)`` appends dict rows to ``result["rows"]`` and reasons to
``result["skipped"]``; it asks ``clock.left()`` before each item and skips the rest once its deadline
is near. Shapes: B batch, T positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import backends, kernels, masks
from jaxpe.emulation import bf16_exact
from jaxpe.emulation.ops import apply_rope_alibi
from jaxpe.emulation.solver import emulation_theta
from jaxpe.ops import alibi, rope, xpos

GIB = 2.0**30
PEAK_SOURCE = "NVIDIA H100/H200 SXM datasheet: 989 TFLOP/s dense bf16"
NATIVE_ALIBI = ("xla", "tokamax")  # backends that take ALiBi as a bias (no emulation forms)
# Part b's floor: w_ij and w_ii each rounded to bf16 twice (the kernel's P for the PV product, then
# the output), |d log(w_ij / w_ii)| about 4 x 2^-9, plus the online softmax's rescaling: 2^-6. The
# xla row (native float32 bias, no emulation) measures the floor in the same run.
RESOLUTION = 2.0**-6


def datasheet_peak(device) -> float | None:
  """Dense bf16 FLOP/s of ``device`` by its datasheet, or None where not known here."""
  kind = device.device_kind.upper()
  return 989e12 if ("H100" in kind or "H200" in kind) else None


def alibi_forms() -> tuple[str, ...]:
  """The ``AlibiSpec.form`` values this jaxpe has (``exact``, ``rotated``, ``lean`` where merged)."""
  hint = typing.get_type_hints(backends.AlibiSpec)["form"]
  return tuple(typing.get_args(hint)) or ("exact",)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Sizes and backends of one run (``for_run``: GPU/TPU sizes, or tiny ones with ``smoke``)."""

  smoke: bool
  interpret: bool
  backends: tuple[str, ...]
  fused: str  # the bias-free kernel of part c (cudnn on GPU, splash on TPU, an interpret one in smoke)
  a_shape: tuple[int, int, int, int, int]  # B, T, N, K, H
  b_contexts: tuple[int, ...]
  c_lengths: tuple[int, ...]
  c_heads: int
  d_sizes: tuple
  e_small: bool
  e_tokens: int
  e_new: int
  peak: float | None
  repeats: int

  @classmethod
  def for_run(cls, *, smoke: bool, peak: float | None) -> Settings:
    native = backends.platform_backends()
    interpret = smoke or jax.default_backend() == "cpu"
    here = backends.available_backends(interpret=interpret)
    here = tuple(b for b in backends.BACKENDS if b in here)
    fused = next((b for b in ("cudnn", "splash", "flash", "pallas_gpu") if b in here and b in native), None)
    fused = fused or next((b for b in ("pallas_gpu", "splash") if b in here), "xla")
    if smoke:
      return cls(True, True, here, fused, (2, 64, 4, 2, 16), (128,), (128,), 2,
                 ((dict(d_model=32, num_layers=1, num_heads=2, vocab_size=256), 2, 32),),
                 True, 16, 4, peak, 1)  # fmt: skip
    return cls(False, interpret, here, fused, (2, 1024, 8, 4, 64), (2048, 8192, 65536),
               (1024, 8192, 65536), 16,
               ((dict(d_model=1024, num_layers=8, num_heads=16, vocab_size=32768), 8, 2048),
                (dict(d_model=2048, num_layers=8, num_heads=16, vocab_size=32768), 4, 2048)),
               False, 512, 32, peak, 3)  # fmt: skip


class Clock:
  """A part's deadline: ``left()`` seconds to it; ``ok(need, what, result)`` records a skip when short
  (a part's first item always runs: ``accelerator_check.main`` starts a part only with time left, or
  in ``--smoke``, so each part that starts gives a row)."""

  def __init__(self, deadline: float):
    self.deadline = deadline
    self.started = False

  def left(self) -> float:
    return self.deadline - time.perf_counter()

  def ok(self, need: float, what: str, result: dict) -> bool:
    if self.left() >= need or not self.started:
      self.started = True
      return True
    result["skipped"].append(f"{what}: part deadline ({self.left():.0f} s left, ~{need:.0f} s needed)")
    return False


def _timed(fn, args, repeats: int) -> float:
  """Median seconds of ``fn(*args)`` after one untimed call (``fn`` returns jax arrays or waits itself)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def encodings(backend: str) -> list[tuple[str, str | None]]:
  """``(encoding, ALiBi form)`` pairs of part a for ``backend``."""
  out = [("none", None), ("rope", None), ("xpos", None)]
  forms = [None] if backend in NATIVE_ALIBI else list(alibi_forms())
  out += [("alibi", f) for f in forms]
  return [*out, ("rope_alibi", None)]


def encoded_attention(encoding, form, backend, *, positions, mask, slopes, max_position, interpret):
  """``fn(q, k, v) -> [B, T, N, H]``: ``encoding`` applied as the model does, attention on ``backend``."""

  def fn(q, k, v):
    h = v.shape[-1]
    kw = dict(scale=h**-0.5, mask=mask, implementation=backend, interpret=interpret)
    if encoding == "rope":
      inv = rope.rope_inv_freq(h)
      q = rope.apply_rope(q, positions, inv_freq=inv, layout="interleaved")
      k = rope.apply_rope(k, positions, inv_freq=inv, layout="interleaved")
    elif encoding == "xpos":
      q = xpos.apply_xpos(q, positions, kind="query", layout="interleaved")
      k = xpos.apply_xpos(k, positions, kind="key", layout="interleaved")
    elif encoding == "alibi":
      spec_kw = {} if form is None else {"form": form}
      kw["alibi_spec"] = backends.AlibiSpec(
        slopes, positions, positions, max_position=max_position, **spec_kw
      )
    elif encoding == "rope_alibi":
      theta = emulation_theta(max_phase=0.1, max_len=max_position)
      k_full = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
      v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
      q, k = apply_rope_alibi(q, k_full, positions, positions, slopes=slopes, theta=theta, order=1)
    return kernels.attention(q, k, v, **kw)

  return fn


def part_a(cfg: Settings, clock: Clock, result: dict) -> None:
  batch, t_len, heads, kv, h = cfg.a_shape
  pad = t_len // 8
  rng = np.random.default_rng(0)
  base = [rng.normal(size=(batch, t_len, n, h)).astype(np.float32) for n in (heads, kv, kv)]
  weights = rng.normal(size=(batch, t_len, heads, h)).astype(np.float32)
  valid = np.arange(t_len)[None, :] >= np.array([[0]] + [[pad]] * (batch - 1))
  weights = weights * valid[:, :, None, None]
  positions = jnp.asarray(np.maximum(np.arange(t_len)[None, :] - np.array([[0]] + [[pad]] * (batch - 1)), 0))
  mask = masks.AttentionMask(valid=jnp.asarray(valid), causal=True)
  slopes = alibi.alibi_slopes_f64(heads)
  common = dict(positions=positions, mask=mask, slopes=slopes, max_position=t_len)

  def out_and_grads(fn):
    def loss(q, k, v):
      out = fn(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * weights), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  refs = {}
  # smoke: bf16 only, and each backend a share of the encodings (together every encoding once)
  cases = [(b, e) for b in cfg.backends for e in encodings(b)]
  if cfg.smoke:
    union = list(dict.fromkeys(e for _, e in cases))
    cases = []
    for j, e in enumerate(union):  # encoding j on backend j (round robin), else the first that has it
      have = [b for b in cfg.backends if e in encodings(b)]
      b = cfg.backends[j % len(cfg.backends)]
      cases.append((b if b in have else have[0], e))
  for dtype in ("bfloat16",) if cfg.smoke else ("bfloat16", "float32"):
    inputs = [jnp.asarray(x, dtype) for x in base]
    upcast = [x.astype(jnp.float32) for x in inputs]
    for backend, (encoding, form) in cases:
      if True:
        name = f"{dtype} {encoding}{'' if form is None else ' ' + form} on {backend}"
        if not clock.ok(3.0, name, result):
          return
        key = (dtype, encoding)
        if key not in refs:
          fn = encoded_attention(encoding, None, "xla", interpret=False, **common)
          with jax.default_matmul_precision("highest"):
            (_, out), grads = out_and_grads(fn)(*upcast)
          refs[key] = (np.asarray(out), [np.asarray(g) for g in grads])
        ref_out, ref_grads = refs[key]
        row = {"dtype": dtype, "encoding": encoding, "form": form or "native", "backend": backend}
        try:
          fn = encoded_attention(encoding, form, backend, interpret=cfg.interpret, **common)
          (_, out), grads = out_and_grads(fn)(*inputs)
        except Exception as err:  # noqa: BLE001  a backend that refuses a case: recorded, the rest go on
          row["max |d out|"] = f"refused: {type(err).__name__}: {str(err)[:90]}"
          result["rows"].append(row)
          continue
        out = np.asarray(out.astype(jnp.float32))
        rows_ok = valid[:, :, None, None]
        row["max |d out|"] = float(np.max(np.abs(np.where(rows_ok, out - ref_out, 0))))
        row["max |d grad|"] = max(
          float(np.max(np.abs(np.asarray(g.astype(jnp.float32)) - r)))
          for g, r in zip(grads, ref_grads, strict=True)
        )
        row["max |grad|"] = max(float(np.max(np.abs(r))) for r in ref_grads)
        result["rows"].append(row)


def part_b(cfg: Settings, clock: Clock, result: dict) -> None:
  heads, h, probes_n, queries = 16, 64, 64, 4
  slopes = alibi.alibi_slopes_f64(heads)
  forms = alibi_forms()
  for ctx in cfg.b_contexts:
    # probe keys at distances 0..15 and geometric beyond from the last query; queries: the last 4 rows
    dist = np.unique(np.concatenate([np.arange(16), np.geomspace(16, ctx - 1, probes_n - 16).astype(int)]))
    dist = dist[dist < ctx]
    keys = ctx - 1 - dist
    qrows = ctx - 1 - np.arange(queries)
    v = np.zeros((1, ctx, heads, probes_n), np.float32)
    v[0, keys, :, np.arange(len(keys))] = 1.0
    v = jnp.asarray(v, jnp.bfloat16)
    zeros = jnp.zeros((1, ctx, heads, h), jnp.bfloat16)
    pos = jnp.arange(ctx, dtype=jnp.int32)[None]
    distance = qrows[:, None] - keys[None, :]  # [Q, C]
    expected = -slopes[None, None, :] * distance[:, :, None]  # [Q, C, N] logits up to a row constant
    diag = np.array([int(np.flatnonzero(keys == i)[0]) for i in qrows])  # probe of key j = i
    # measurable: key visible and its weight not below 1e-6 of the diagonal's
    usable = (distance[:, :, None] >= 0) & (expected > math.log(1e-6))
    for backend in cfg.backends if not cfg.smoke else (cfg.backends[0], cfg.fused):
      for form in [None] if backend in NATIVE_ALIBI else forms[: 1 if cfg.smoke else None]:
        name = f"T {ctx} {backend} {form or 'native'}"
        if not clock.ok(4.0, name, result):
          return
        spec_kw = {} if form is None else {"form": form}
        spec = backends.AlibiSpec(
          slopes, pos, pos, max_position=max(ctx, 65536 if form == "exact" else ctx), **spec_kw
        )
        row = {"T": ctx, "backend": backend, "form": form or "native"}
        try:
          fn = jax.jit(
            lambda q, k, v, spec=spec, backend=backend: kernels.attention(
              q, k, v, scale=h**-0.5, mask=masks.AttentionMask(causal=True), alibi_spec=spec,
              implementation=backend, interpret=cfg.interpret,
            )[0, -queries:][::-1]
          )  # fmt: skip
          w = np.asarray(fn(zeros, zeros, v).astype(jnp.float32))  # [Q, N, C]
        except Exception as err:  # noqa: BLE001
          row["measured max |d logit|"] = f"refused: {type(err).__name__}: {str(err)[:90]}"
          result["rows"].append(row)
          continue
        w = np.transpose(w, (0, 2, 1))[:, : len(keys)]  # [Q, C, N]
        w_diag = w[np.arange(queries), diag][:, None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
          measured = np.log(w / w_diag) - expected
        ok = usable & np.isfinite(measured)
        row["measured max |d logit|"] = float(np.max(np.abs(np.where(ok, measured, 0))))
        row["pairs"] = int(ok.sum())
        row["resolution"] = RESOLUTION
        row["model max |d logit|"] = _predicted(form, backend, qrows, keys, slopes, h, ctx, diag, usable)
        result["rows"].append(row)


def _predicted(form, backend, qrows, keys, slopes, h, ctx, diag, usable) -> float | str:
  """The rounding model's ``max |e_ij - e_ii|`` for the probed pairs (bf16 inputs, float32 sums)."""
  if form is None:
    if backend == "tokamax":  # float32 key-only bias m_h j: its rounding, relative to the diagonal's
      bias = (np.float32(slopes)[None, :] * keys[:, None].astype(np.float32)).astype(np.float64)  # [C, N]
      err = bias - slopes[None, :] * keys[:, None]
      dev = err[None, :, :] - err[diag][:, None, :]
      return float(np.max(np.abs(np.where(usable, dev, 0))))
    return "native (float32 bias)"
  try:
    q, k = bf16_exact.alibi_term_dims(
      form, qrows, keys, slopes=slopes, head_dim=h, max_len=max(ctx, 65536) if form == "exact" else ctx
    )
  except (ValueError, TypeError) as err:
    return f"no model: {str(err)[:60]}"
  scores = bf16_exact.float32_accumulated_dot(q, k, "bfloat16").astype(np.float64) / math.sqrt(h)  # [Q, C, N]
  err = scores + slopes[None, None, :] * (qrows[:, None, None] - keys[None, :, None])
  dev = err - err[np.arange(len(qrows)), diag][:, None, :]
  return float(np.max(np.abs(np.where(usable, dev, 0))))


def part_c(cfg: Settings, clock: Clock, result: dict) -> None:
  heads, h = cfg.c_heads, 64
  slopes = alibi.alibi_slopes_f64(heads)
  fused = cfg.fused
  configs = [("RoPE", fused, None)]
  configs += [("RoPE", b, None) for b in ("flash", "tokamax") if b in cfg.backends and b != fused]
  configs += [("ALiBi dense bias", "xla", "dense"), ("ALiBi blockwise", "xla", None)]
  configs += [(f"ALiBi emulated {f}", fused, f) for f in alibi_forms()] if fused != "xla" else []
  configs += [("ALiBi", b, None) for b in ("flash", "tokamax") if b in cfg.backends]
  if cfg.smoke:  # the code path of each kind of row once
    configs = [c for c in configs if c[0] in ("RoPE", "ALiBi dense bias") or c[0].endswith(alibi_forms()[0])][
      :4
    ]
  limit = _device_bytes()
  for t_len in cfg.c_lengths:
    base_secs = None
    shape = (1, t_len, heads, h)
    pos = jnp.arange(t_len, dtype=jnp.int32)[None]
    mask = masks.AttentionMask(causal=True)
    for label, backend, form in configs:
      name = f"{label} on {backend}, T {t_len}"
      if not clock.ok(8.0 if t_len >= 16384 else 3.0, name, result):
        return
      interpret = backend not in backends.platform_backends() and backend not in backends.OPTIONAL_BACKENDS
      row = {"T": t_len, "attention": label, "backend": backend + (" (interp)" if interpret else "")}
      if form == "dense":
        need = 3 * 4 * heads * t_len * t_len  # bias, scores and probabilities, float32
        if need > 0.8 * limit:
          row["ms"] = (
            f"skipped: dense [1, N, T, T] float32 needs ~{need / GIB:.0f} GiB > {limit / GIB:.0f} GiB"
          )
          result["rows"].append(row)
          continue

      def loss(
        q, k, v, label=label, backend=backend, form=form, interpret=interpret, pos=pos, mask=mask, t_len=t_len
      ):
        kw = dict(scale=h**-0.5, mask=mask, implementation=backend, interpret=interpret)
        if label == "RoPE":
          inv = rope.rope_inv_freq(h)
          q = rope.apply_rope(q, pos, inv_freq=inv, layout="interleaved")
          k = rope.apply_rope(k, pos, inv_freq=inv, layout="interleaved")
        elif form == "dense":
          kw["bias"] = alibi.alibi_bias(jnp.asarray(slopes, jnp.float32), pos, pos)
        else:
          spec_kw = {} if form is None or backend in NATIVE_ALIBI else {"form": form}
          kw["alibi_spec"] = backends.AlibiSpec(slopes, pos, pos, max_position=max(t_len, 65536), **spec_kw)
        return jnp.sum(kernels.attention(q, k, v, **kw).astype(jnp.float32))

      key = jax.random.split(jax.random.key(0), 3)
      q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in key)
      try:
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        mem = compiled.memory_analysis()
        row["temp GiB"] = mem.temp_size_in_bytes / GIB if mem is not None else "-"
        secs = _timed(compiled, (q, k, v), cfg.repeats)
      except Exception as err:  # noqa: BLE001  OOM or a refused size: recorded
        row["ms"] = f"failed: {type(err).__name__}: {str(err)[:90]}"
        result["rows"].append(row)
        continue
      row["ms"] = secs * 1e3
      if label == "RoPE" and backend == fused:
        base_secs = secs
      row["time / RoPE"] = secs / base_secs if base_secs else "-"
      result["rows"].append(row)


def _device_bytes() -> int:
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats.get("bytes_limit", 8 * GIB))


def part_d(cfg: Settings, clock: Clock, result: dict) -> None:
  try:
    import ceilings
    import train_bench

    from jaxpe.model.config import ModelConfig
  except ImportError as err:
    result["skipped"].append(f"train step: {err} (carry the wheels: docs/accelerator.md)")
    return
  for size, batch, seq in cfg.d_sizes:
    name = f"D {size['d_model']} L {size['num_layers']} B {batch} T {seq}"
    if not clock.ok(20.0 if not cfg.smoke else 2.0, name, result):
      return
    model_cfg = ModelConfig(**size, max_len=seq, dtype="bfloat16", attn_implementation="auto")
    with jax.numpy_dtype_promotion("standard"):  # as the trainer runs (optax promotes implicitly)
      step = train_bench.trainer_step(model_cfg, batch=batch, seq=seq)
      step.run()  # compile
      secs = _timed(step.run, (), cfg.repeats + 2)
    flops = ceilings.useful_flops(ceilings.decoder_matmuls(model_cfg, batch, seq))
    row = {"model": name, "step ms": secs * 1e3, "model TFLOP/s": flops / secs / 1e12}
    row["MFU"] = flops / secs / cfg.peak if cfg.peak else "- (peak unknown)"
    result["rows"].append(row)


def part_e(cfg: Settings, clock: Clock, result: dict) -> None:
  try:
    import bloom_bench
    import torch
    import transformers

    from jaxpe import bloom
    from jaxpe.model.generate import generate
  except ImportError as err:
    result["skipped"].append(f"BLOOM: {err} (carry the wheels: docs/accelerator.md)")
    return
  config = dict(bloom_bench.BLOOM_560M)
  if cfg.e_small:
    config.update(n_layer=2, vocab_size=512, hidden_size=64, n_head=4)
  cuda = torch.cuda.is_available() and jax.default_backend() == "gpu"
  torch_device = "cuda" if cuda else "cpu"
  torch.backends.cuda.matmul.allow_tf32 = False
  if not clock.ok(30.0 if not cfg.smoke else 5.0, "BLOOM build, import and forward", result):
    return
  torch.manual_seed(0)
  t0 = time.perf_counter()
  hf = transformers.BloomForCausalLM(transformers.BloomConfig(**config)).eval()
  t_init = time.perf_counter() - t0
  model = bloom.from_hf(hf)
  hf = hf.to(torch_device)
  label = f"L {config['n_layer']} D {config['hidden_size']} V {config['vocab_size']}"
  result["rows"].append({"what": f"build (torch init {t_init:.1f} s) and import", "model": label,
                         "jaxpe": f"{time.perf_counter() - t0:.1f} s", "transformers": torch_device})  # fmt: skip
  ids = np.random.default_rng(0).integers(5, config["vocab_size"], (1, cfg.e_tokens))
  x = jnp.asarray(ids, jnp.int32)
  with jax.default_matmul_precision("highest"):
    fwd = jax.jit(lambda m, x: m(x))
    logits = np.asarray(fwd(model, x), np.float64)
    t_jax = _timed(fwd, (model, x), cfg.repeats)
  with torch.no_grad():
    xt = torch.as_tensor(ids, device=torch_device)
    ref = hf(xt).logits.double().cpu().numpy()

    def torch_fwd():
      hf(xt)
      if cuda:
        torch.cuda.synchronize()

    t_torch = _timed(torch_fwd, (), cfg.repeats)
  result["rows"].append({
    "what": f"forward 1 x {cfg.e_tokens} float32 (HIGHEST / no TF32), ms per token",
    "model": label, "jaxpe": t_jax * 1e3 / cfg.e_tokens, "transformers": t_torch * 1e3 / cfg.e_tokens,
    "max |d logits|": float(np.max(np.abs(logits - ref))), "max |logits|": float(np.max(np.abs(ref))),
  })  # fmt: skip
  if not clock.ok(10.0, "BLOOM generation", result):
    return
  new = cfg.e_new
  prompt = np.random.default_rng(1).integers(5, config["vocab_size"], (1, 32))
  pj = jnp.asarray(prompt, jnp.int32)
  out = np.asarray(generate(model, pj, max_new_tokens=new))
  t_gen = _timed(lambda: generate(model, pj, max_new_tokens=new), (), max(1, cfg.repeats - 1))
  kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
  with torch.no_grad():
    pt = torch.as_tensor(prompt, device=torch_device)
    hf_out = hf.generate(pt, **kw).cpu().numpy()

    def torch_generate():
      hf.generate(pt, **kw)
      if cuda:
        torch.cuda.synchronize()

    t_hf = _timed(torch_generate, (), max(1, cfg.repeats - 1))
  same = int(np.sum(out[0, -new:] == hf_out[0, -new:]))
  result["rows"].append({
    "what": f"greedy generate 1 x 32 + {new}, ms per new token", "model": label,
    "jaxpe": t_gen * 1e3 / new, "transformers": t_hf * 1e3 / new, "same tokens": f"{same}/{new}",
  })  # fmt: skip
