"""``attention(..., implementation=...)``: one entry point for the dense reference and the fused kernels.

Checks the arguments the same way for every backend (the same errors, table in docs/contracts.md),
then runs ``xla`` (``jaxpe.attention.xla``: the einsum reference, dense bias and masks, the KV
cache) or a fused kernel (``jaxpe.attention.fused``: ALiBi through its bias-free emulation, masks as
segment ids; one module per kernel: ``cudnn``, ``splash``, ``pallas_gpu``), ``flash``
(``jaxpe.attention.flash``: jaxpe's Pallas kernel, RoPE and ALiBi inside) or ``tokamax``
(``jaxpe.attention.tokamax``, where installed: ALiBi and a dense bias as its native bias). The backends, what each
needs and which run here are in ``jaxpe.attention.backends``.

Adding a backend: a module with ``attend(q, k, v, mask, *, scale, interpret)``, its name in
``backends.BACKENDS``, ``HEAD_DIM_MULTIPLE`` and ``platform_backends`` (and ``kernel_length`` if it
tiles T), and one line in ``fused.KERNELS``. A kernel that applies the encodings itself (``flash``:
RoPE from a ``RopeSpec``, ALiBi from an ``AlibiSpec``) gets the checked specs from ``attention``
directly, before ``fused``.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxpe.attention import cudnn, flash, fused, numerics, platforms, xla
from jaxpe.attention import patterns as pattern_lib
from jaxpe.attention import sinks as sink_lib
from jaxpe.attention import tokamax as tokamax_backend
from jaxpe.attention.backends import (
  AUTO_PREFERENCE,
  AlibiSpec,
  accepts_impl,
  available_backends,
  check_alibi_spec,
  check_implementation,
  resolve_backend,
  unavailable_message,
)
from jaxpe.attention.masks import AttentionMask, IndexMask
from jaxpe.attention.position_bias import PositionBias, check_position_bias, refuse_on_fused
from jaxpe.attention.reference import check_scale, default_precise_dims, torch_layout_named
from jaxpe.attention.rope_spec import RopeSpec, apply_rope_spec, check_rope_spec
from jaxpe.ops import checks as _checks


@accepts_impl
def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: AttentionMask | IndexMask | jax.Array | None = None,
  bias: jax.Array | None = None,
  alibi_spec: AlibiSpec | None = None,
  precise_dims: int | None = None,
  implementation: str = "xla",
  interpret: bool = False,
  sinks: jax.Array | None = None,
  position_bias: PositionBias | None = None,
  rope_spec: RopeSpec | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
) -> jax.Array:
  """``softmax(softcap(q.k * scale) + bias + ALiBi, masked) . v`` on the chosen backend.

  Args:
    q: ``[B, T, N, Hq]`` float queries (``Hq = H + precise_dims``).
    k: ``[B, S, K, Hq]`` float keys.
    v: ``[B, S, K, H]`` float values.
    scale: score scale, usually ``1/sqrt(H)``; finite, > 0.
    mask: an ``AttentionMask`` (every backend), an ``IndexMask`` (slot indices: the KV cache, context
      shards; ``xla`` only), a dense bool mask ``[B, 1|N, T, S]`` (``xla`` only), or None (no mask).
      On ``xla`` every form but the dense mask runs blockwise (``jaxpe.attention.blockwise``:
      O(T x block) memory); a dense mask or bias runs on the dense reference.
    bias: dense float bias ``[B, N, T, S]`` (``xla`` only).
    alibi_spec: ALiBi: native bias on ``xla``, its bias-free emulation on fused kernels.
    position_bias: a learned relative bias (T5, Kerple, FIRE; ``PositionBias``), ``xla`` only:
      computed per block pair there (or added densely with a dense mask or bias), differentiable
      in its parameters; not together with ``alibi_spec``.
    precise_dims: trailing float32 dims of q and k that carry an emulation (``rope_alibi``):
      contracted at ``precision=HIGHEST`` on ``xla``, split into bf16-exact products on the kernels.
      Default None: the dims beyond v's width, ``Hq - H`` (safe for a raw ``apply_rope_alibi``
      output); 0 contracts every dim at the default precision.
    implementation: the backend, one of ``IMPLEMENTATIONS`` (``impl=``, the old spelling, is
      accepted with a DeprecationWarning for one release).
    interpret: run the Pallas kernels in interpret mode (CPU tests).
    rope_spec: RoPE (any scaling, xPos) of the first H dims of q and k (``RopeSpec``): applied with
      jaxpe's ops before attention on every backend but ``flash``, which rotates q/k blocks inside
      its kernel; q and k are then given unrotated.
    sinks: optional ``[N]`` float attention-sink logits (``jaxpe.attention.sinks``; gpt-oss, arXiv
      2309.17453): ``exp(sink_h)`` joins each row's softmax denominator, with no value. ``xla``
      (blockwise from the lse, dense as one more key slot), ``splash`` (native ``sinks``) and
      ``flash`` (in its online softmax);
      differentiable (q, k, v, sinks). cudnn and pallas_gpu refuse them.
    local_window_size: optional ``(left, right)`` ints >= 0 in tokens (an int w: ``(w, w)``),
      ``jax.nn.dot_product_attention``'s name and meaning: query i sees key j only if
      ``i - left <= j <= i + right``; with a causal mask ``(left, 0)``. transformers'
      ``sliding_window = w`` (Mistral, Gemma 2/3, gpt-oss; it counts the query itself) is
      ``(w - 1, 0)``. i and j are slots (an ``AttentionMask``, a dense mask or none: the indices
      ``0..T-1`` / ``0..S-1``; an ``IndexMask``'s ``q_index`` / ``k_index``): a window is a
      distance, the same in slots and positions within a document of a packed row or after left
      padding (transformers measures packed windows in ``position_ids``: the same pairs). ``xla`` skips key blocks wholly outside the window.
    chunk_size: optional int >= 1, Llama 4's ``attention_chunk_size``: query i sees key j only if
      ``p_i // chunk_size == p_j // chunk_size``, on top of the other masks, with p the tokens'
      positions: each row's chunks start at its first real token and restart with each packed
      document (an ``AttentionMask``'s ``valid`` / ``segment_ids``, ``patterns.document_positions``;
      transformers' ``create_chunked_causal_mask``), an ``IndexMask``'s ``q_positions`` /
      ``k_positions`` (else its slots), the indices ``0..T-1`` / ``0..S-1`` without a mask or with a
      dense one. splash and flash count chunks from slot 0 in their kernels: they refuse
      ``chunk_size`` with padding or segment ids (``auto`` then runs ``xla``).
    logits_soft_cap: optional finite float > 0, Gemma 2's ``attn_logit_softcapping``: the scores
      ``s = q.k * scale`` become ``cap * tanh(s / cap)`` before the mask, the bias / ALiBi and the
      sinks (transformers' ``gemma2.eager_attention_forward``). Refused with ``precise_dims > 0``
      and, on a fused kernel, with an ``alibi_spec`` emulated inside q.k (the cap would squash ALiBi).
      ``flash`` runs all three in its kernel (key blocks outside the window / chunks skipped;
      ``jaxpe.attention.flash_patterns``); ``implementation="auto"`` passes over a kernel that
      refuses one.

  Returns:
    ``[B, T, N, H]`` array of ``v.dtype``.

  Raises (the same checks, and the same messages, on every backend; table in docs/contracts.md):
    ValueError: an unknown or unavailable backend (lists the available ones); shapes that do not
      fit (ranks, B, S, K, Hq, N % K, no heads); ``scale`` NaN, inf, 0 or negative;
      ``precise_dims`` outside 0..Hq; an ``AttentionMask`` whose ``valid`` / ``segment_ids`` are
      not ``[B, T]`` or used with T != S; bad ``AlibiSpec`` fields (slopes not ``[N]``, finite and
      >= 0; positions not ``[B, T]``/``[B, S]`` or negative; ``max_position`` outside 1..2^24;
      ``form``, ``order`` 1..8, ``theta`` > 0). Fused kernels only: a bias or dense mask (says to
      use ``alibi_spec`` / ``AttentionMask``); T != S; H = 0; a head dim cudnn refuses (> 256 with
      the emulation dims); a float16 kernel with an emulation (bf16 parts overflow float16);
      concrete positions >= ``max_position`` with the lean or exact form; the rotated form with a slope 0
      or a theta whose phase reaches pi/2; ``sinks`` not ``[N]``, or given to cudnn / pallas_gpu;
      ``local_window_size`` with a side < 0 or > 2^31 or not a pair, ``chunk_size`` outside 1..2^31,
      ``logits_soft_cap`` NaN, inf or <= 0, or with ``precise_dims > 0``; a backend that cannot run
      one of them (names the backend and the option).
    TypeError: ``local_window_size`` / ``chunk_size`` not ints (bools, floats), ``logits_soft_cap``
      not a concrete real number; non-float ``sinks``; non-float q, k, v; a ``scale`` that is not a concrete real number (bool, string,
      traced); a non-int ``precise_dims``; a non-bool ``interpret``; a mask that is neither an
      ``AttentionMask`` nor an array; ``AttentionMask`` fields of the wrong dtype (float or bool
      segment ids, float ``valid``, non-bool ``causal``); ``alibi_spec`` not an ``AlibiSpec``;
      AlibiSpec fields of the wrong type.

  Masks: segment ids of any integer dtype and value are compared exactly on every backend (the
  fused kernels get them ranked per row by ``masks.dense_segment_ids``). Real query rows get
  the same result on every backend; padding query rows (``valid`` False) are zeros on the fused
  kernels and what the dense mask gives on ``xla``.
  """
  interpret = _checks.check_bool("interpret", interpret)
  q, k, v = (_checks.as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
  name = check_implementation(implementation)
  if precise_dims is None and all(getattr(x, "ndim", 0) == 4 for x in (q, v)):
    precise_dims = default_precise_dims(None, q.shape[-1], v.shape[-1])

  def check(q, k, v):  # the size checks, run again on q, k, v as [B, N, T, H] to name that layout
    checked = _check_inputs(q, k, v, scale, mask, alibi_spec, precise_dims)
    spec = None
    if rope_spec is not None:
      spec = check_rope_spec(rope_spec, q.shape[0], q.shape[1], k.shape[1], q.shape[-1] - precise_dims)
    return checked, spec

  with torch_layout_named(q, k, v, check):
    (q, k, v, scale, mask, alibi_spec), checked_rope = check(q, k, v)
  rope_spec = checked_rope if rope_spec is not None else rope_spec
  pattern = pattern_lib.check_pattern(local_window_size, chunk_size, logits_soft_cap)
  pattern_lib.check_cap_precise_dims(pattern, precise_dims)
  if sinks is not None:
    sinks = sink_lib.check_sinks(sinks, q.shape[2])
  if position_bias is not None:
    if alibi_spec is not None:
      raise ValueError("give alibi_spec or position_bias, not both (one position bias per attention)")
    position_bias = check_position_bias(position_bias, q.shape[0], q.shape[1], k.shape[1], q.shape[2])
  call = dict(
    scale=scale,
    mask=mask,
    bias=bias,
    alibi_spec=alibi_spec,
    precise_dims=precise_dims,
    sinks=sinks,
    position_bias=position_bias,
    rope_spec=rope_spec,
    interpret=interpret,
    pattern=pattern,
  )

  def run(impl, target="gpu"):
    if impl == "xla":
      return lambda: _run(impl, target, q, k, v, **call)
    # A kernel's branch differentiates once; its second derivative is refused when that platform is
    # lowered, so that a platform whose branch is xla (auto on the CPU) differentiates twice.
    traced, rebuild = _traced_operands(call)  # arguments, not closures, of the custom derivative
    kernel = platforms.once_differentiable(
      lambda q, k, v, *traced: _run(impl, target, q, k, v, **rebuild(traced)),
      SECOND_DERIVATIVE.format(impl=impl),
    )
    return lambda: kernel(q, k, v, *traced)

  if interpret:  # interpret mode runs anywhere: the host decides, as before
    return run(resolve_backend(name, interpret=True))()
  out_like = jax.ShapeDtypeStruct((*q.shape[:3], v.shape[-1]), v.dtype)
  branches, memo = {}, {}
  for platform in platforms.PLATFORMS:
    key = _platform_plan(name, platform)
    if key not in memo:
      if key[0] == "refused":
        memo[key] = lambda message=key[1]: platforms.refused(message, out_like, q, k, v)
      elif key[0] == "auto":
        memo[key] = _auto_branch([run(b, t) for b, t in key[1]])
      else:
        memo[key] = run(*key)
    branches[platform] = memo[key]
  return platforms.per_platform(branches)


SECOND_DERIVATIVE = (
  "attention implementation {impl!r} differentiates once: a second derivative (jax.grad of jax.grad, "
  "jax.hessian) of its kernel cannot be lowered for this platform; use implementation='xla' for higher "
  "derivatives (implementation='auto' uses xla on the CPU)"
)
"""The refusal of a kernel's second derivative (``platforms.once_differentiable``)."""

FLASH_TARGETS: dict[str, str] = {"cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
"""Lowering platform -> ``flash.attend(target=)``: Triton on GPUs, the k/v-blocked Mosaic kernel on TPUs."""


def _traced_operands(call: dict) -> tuple[list[jax.Array], Callable[[list], dict]]:
  """``(traced, rebuild)``: the traced arrays of ``attention``'s keyword arguments ``call`` (masks,
  sinks, the fields of an ``AlibiSpec`` / ``RopeSpec``, a position bias's parameters) and the function
  that puts others in their places. Concrete values (slopes, Python numbers) stay as they are."""
  specs = (AlibiSpec, RopeSpec)
  leaves, tree = jax.tree.flatten(call, is_leaf=lambda x: isinstance(x, specs))
  traced: list[jax.Array] = []
  plan: list[tuple] = []
  for leaf in leaves:
    if isinstance(leaf, specs):
      names = [f.name for f in dataclasses.fields(leaf) if isinstance(getattr(leaf, f.name), jax.core.Tracer)]
      plan.append(("spec", leaf, names, len(traced)))
      traced += [getattr(leaf, n) for n in names]
    elif isinstance(leaf, jax.core.Tracer):
      plan.append(("traced", len(traced)))
      traced.append(leaf)
    else:
      plan.append(("const", leaf))

  def rebuild(values) -> dict:
    out = []
    for entry in plan:
      if entry[0] == "spec":
        _, leaf, names, at = entry
        out.append(dataclasses.replace(leaf, **dict(zip(names, values[at : at + len(names)]))))
      else:
        out.append(values[entry[1]] if entry[0] == "traced" else entry[1])
    return jax.tree.unflatten(tree, out)

  return traced, rebuild


def _platform_plan(name: str, platform: str) -> tuple:
  """What ``attention`` runs for backend ``name`` when lowered for ``platform``: ``(backend, target)``,
  ``("refused", message)``, or ``("auto", ((backend, target), ...))`` (tried in order)."""
  target = FLASH_TARGETS.get(platform, "gpu")
  available = available_backends(platform=platform)
  if name == "auto":
    tried = tuple(
      (b, target)
      for b in AUTO_PREFERENCE[platform]
      if b in available and b != "xla" and (b != "cudnn" or platform != "cuda" or cudnn.detected())
    )
    return ("auto", (*tried, ("xla", "gpu"))) if tried else ("xla", "gpu")
  if name not in available:
    return ("refused", unavailable_message(name, interpret=False, platform=platform))
  if (
    name == "cudnn" and platform == "cuda" and not cudnn.detected()
  ):  # jax traces cuDNN only where it finds it
    return ("refused", cudnn.NOT_DETECTED)
  return (name, target if name == "flash" else "gpu")


def _auto_branch(candidates):
  """The first candidate (a branch of no arguments) that traces; the last (``xla``) always runs."""

  def branch():
    for candidate in candidates[:-1]:
      try:
        return candidate()
      except (ValueError, NotImplementedError):
        continue  # this kernel refuses the call (its argument checks, or jax's cuDNN rule): the next one
    return candidates[-1]()

  return branch


def _run(
  impl,
  target,
  q,
  k,
  v,
  *,
  scale,
  mask,
  bias,
  alibi_spec,
  precise_dims,
  sinks,
  position_bias,
  rope_spec,
  interpret,
  pattern,
):
  """``attention`` on backend ``impl`` (its shared checks done); ``target``: the ``flash`` kernel's."""
  if pattern.active and impl != "xla":
    pattern_lib.refuse(
      impl, pattern, emulated_alibi=alibi_spec is not None and impl not in NATIVE_ALIBI, bias=bias
    )
    pattern_lib.refuse_chunk_offsets(impl, pattern, mask)
  if impl != "xla" and not interpret:  # a kernel lowers for one platform per program
    q, k, v = platforms.one_platform(q, k, v, message=ONE_PLATFORM.format(impl=impl))
  if rope_spec is not None and impl != "flash":
    q, k = apply_rope_spec(rope_spec, q, k, q.shape[-1] - precise_dims)
  if position_bias is not None and impl != "xla":
    refuse_on_fused(impl)
  if alibi_spec is not None and impl not in NATIVE_ALIBI:  # the bias-free emulation's own checks
    alibi_spec = check_alibi_spec(alibi_spec, q.shape[0], q.shape[1], k.shape[1], q.shape[2], fused=True)
  if impl != "xla" and isinstance(mask, AttentionMask) and mask.valid is not None:
    # padding keys' values (NaN too) never reach a kernel's P.V (xla's paths zero them themselves)
    k, v = numerics.zero_hidden_keys(k, v, mask.valid)
  if impl == "xla":
    return xla.attend(
      q,
      k,
      v,
      scale=scale,
      mask=mask,
      bias=bias,
      alibi_spec=alibi_spec,
      precise_dims=precise_dims,
      sinks=sinks,
      position_bias=position_bias,
      pattern=pattern,
    )
  if impl == "flash":
    return flash.attend(
      q,
      k,
      v,
      scale=scale,
      mask=mask,
      bias=bias,
      alibi_spec=alibi_spec,
      rope_spec=rope_spec,
      precise_dims=precise_dims,
      interpret=interpret,
      sinks=sinks,
      target=target,
      local_window_size=pattern.window,
      chunk_size=pattern.chunk,
      logits_soft_cap=pattern.cap,
    )
  if impl == "tokamax":  # native broadcast bias: ALiBi as BLOOM's key-only bias, no emulation
    return tokamax_backend.attend(
      q,
      k,
      v,
      mask,
      scale=scale,
      interpret=interpret,
      bias=bias,
      alibi_spec=alibi_spec,
      precise_dims=precise_dims,
      sinks=sinks,
      pattern=pattern if pattern.active else None,
    )
  return fused.attend(
    q,
    k,
    v,
    scale=scale,
    mask=mask,
    bias=bias,
    alibi_spec=alibi_spec,
    precise_dims=precise_dims,
    implementation=impl,
    interpret=interpret,
    sinks=sinks,
    pattern=pattern if pattern.active else None,
  )


ONE_PLATFORM = (
  "attention implementation {impl!r} is a fused kernel, which lowers for one platform per program: jax "
  "lowers each kept branch of a program for several platforms (jax.export(..., platforms=(...)) with "
  "more than one) for all of them, and a Pallas or cuDNN kernel cannot be lowered for another platform; "
  "lower or export once per platform (implementation='xla' lowers for several at once)"
)
NATIVE_ALIBI: tuple[str, ...] = ("xla", "flash", "tokamax")


def _check_inputs(q, k, v, scale, mask, alibi_spec, precise_dims):
  """The checks every backend shares (the same errors on xla and on the fused kernels)."""
  for name, arr in (("q", q), ("k", k), ("v", v)):
    _checks.check_rank(name, arr, 4, "[B, T, N, Hq]" if name == "q" else "[B, S, K, Hq]")
    _checks.check_float(name, arr)
  scale = check_scale("scale", scale)
  batch, t_len, num_heads, qk_dim = q.shape
  s_len, num_kv = k.shape[1], k.shape[2]
  if num_heads == 0 or num_kv == 0:
    raise ValueError(f"q and k need at least one head (N >= 1, K >= 1), got N={num_heads}, K={num_kv}")
  if num_heads % num_kv or k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != qk_dim:
    raise ValueError(
      f"q, k, v must be [B,T,N,Hq], [B,S,K,Hq], [B,S,K,H] with N % K == 0, got {q.shape}, {k.shape}, {v.shape}"
    )
  if isinstance(precise_dims, bool) or not isinstance(precise_dims, int | np.integer):
    raise TypeError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  if not 0 <= precise_dims <= qk_dim:
    raise ValueError(f"precise_dims must be an int in 0..Hq = {qk_dim}, got {precise_dims!r}")
  if isinstance(mask, AttentionMask):
    if s_len != t_len:
      raise ValueError(f"an AttentionMask is for self-attention (T == S), got T={t_len}, S={s_len}")
    mask = mask.check(batch, t_len)
  elif isinstance(mask, IndexMask):
    mask = mask.check()
    if mask.q_index.shape != (batch, t_len) or mask.k_index.shape != (batch, s_len):
      raise ValueError(
        f"IndexMask q_index / k_index must have shapes [B, T] = {[batch, t_len]} / [B, S] = "
        f"{[batch, s_len]}, got {tuple(mask.q_index.shape)} / {tuple(mask.k_index.shape)}"
      )
  elif mask is not None and not isinstance(mask, jax.Array | np.ndarray):
    raise TypeError(
      f"mask must be an AttentionMask, an IndexMask, a bool array [B, 1|N, T, S] or None, got {mask!r}"
    )
  if alibi_spec is not None:  # the fields every backend needs; the emulation's own checks in _run
    alibi_spec = check_alibi_spec(alibi_spec, batch, t_len, s_len, num_heads, fused=False)
  return q, k, v, scale, mask, alibi_spec
