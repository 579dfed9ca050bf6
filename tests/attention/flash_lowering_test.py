"""jaxpe's ``flash`` kernel lowers for GPU (Triton) and TPU (Mosaic) on this CPU-only machine, for
every option it takes, forward and backward, bf16 and float32.

``jax.export`` for ``"cuda"`` / ``"tpu"`` runs every Pallas lowering rule (Triton's, Mosaic's) and
emits the platform's custom call (``__gpu$xla.gpu.triton``, ``tpu_custom_call``); it does not compile
the Triton / Mosaic module, so compilation, speed and numerics on the device are not proven here
(the numerics of both kernel families are tested in interpret mode in flash_test.py).

``lower_flash`` and ``kernel_calls`` are the helpers for a lowering table (one program per option,
platform and dtype; ``grad=True``: the value and the q/k/v gradients, whose module holds the forward
kernel too).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import AlibiSpec, AttentionMask, RopeSpec, flash, flash_tpu
from jaxpe.ops.rope_scaling import rope_frequencies

B, T, N, K, H = 1, 32, 2, 2, 64
SCALE = 0.125
PLATFORMS = {"cuda": "gpu", "tpu": "tpu"}  # lowering platform -> flash.attend's target
CUSTOM_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
KERNELS = {  # the pallas_call names of each target's kernels (flash_kernels / flash_tpu)
  "cuda": ("jaxpe_flash_forward_kernel", "jaxpe_flash_dq_kernel", "jaxpe_flash_dkv_kernel"),
  "tpu": ("jaxpe_flash_tpu_forward_kernel", "jaxpe_flash_tpu_dq_kernel", "jaxpe_flash_tpu_dkv_kernel"),
}

OPTIONS = {  # option -> settings of one program (defaults: T, N, K above, no mask, no encoding)
  "plain": {},
  "causal": dict(causal=True),
  "padding": dict(causal=True, valid=True),
  "segments": dict(segments=True),
  "gqa": dict(causal=True, heads=(4, 2)),
  "alibi": dict(causal=True, alibi=True),
  "rope_half_exact": dict(causal=True, rope=("half", "exact")),
  "rope_half_float32": dict(rope=("half", "float32")),
  "rope_interleaved_exact": dict(causal=True, rope=("interleaved", "exact")),
  "rope_interleaved_float32": dict(rope=("interleaved", "float32")),
  "rope_yarn": dict(causal=True, rope=("half", "exact"), scaling=dict(rope_type="yarn", factor=4.0)),
  "rope_longrope_partial": dict(
    rope=("half", "float32"),
    scaling=dict(rope_type="longrope", short_factor=[1.0] * 16, long_factor=[2.0] * 16),
    rotary_dim=H // 2,
  ),
  "xpos": dict(causal=True, rope=("interleaved", "exact"), xpos=True),
  "precise_dims": dict(causal=True, precise=6),  # E 6 (order 3): padded to 8 lanes
  "t200": dict(causal=True, valid=True, t_len=200, alibi=True, rope=("half", "exact")),
  # attention patterns and sinks (T 384: three blocks of 128, key blocks outside skipped)
  "window": dict(causal=True, window=(100, 0), t_len=384),
  "window_two_sided": dict(window=(130, 60), valid=True, t_len=384),
  "chunk": dict(causal=True, chunk=160, t_len=384),
  "soft_cap": dict(causal=True, cap=30.0, alibi=True),
  "sinks": dict(causal=True, sinks=True, segments=True),
  "patterns_all": dict(
    causal=True,
    valid=True,
    window=(200, 0),
    chunk=256,
    cap=50.0,
    sinks=True,
    alibi=True,
    rope=("half", "exact"),
    heads=(4, 2),
    t_len=384,
  ),
}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _program(option: str, platform: str, grad: bool):
  """``(fn, arg structs)`` of one lowering case."""
  o = OPTIONS[option]
  t_len = o.get("t_len", T)
  heads, kv = o.get("heads", (N, K))
  extra = o.get("precise", 0)
  target = PLATFORMS[platform]
  inv_freq = factor = None
  if "rope" in o:
    scaling = o.get("scaling")
    if scaling is not None:
      scaling = {**scaling, "original_max_position_embeddings": 16}
    inv_freq, factor = rope_frequencies(
      scaling, head_dim=H, rotary_dim=o.get("rotary_dim"), max_position_embeddings=64, seq_len=t_len
    )
  slopes = 2.0 ** -np.arange(1, heads + 1)

  def fn(q, k, v, sinks, pos, valid, segments):
    mask = AttentionMask(
      causal=o.get("causal", False),
      valid=valid if o.get("valid") else None,
      segment_ids=segments if o.get("segments") else None,
    )
    rope_spec = alibi_spec = None
    if "rope" in o:
      layout, precision = o["rope"]
      xpos = dict(xpos_scale_base=512.0, xpos_gamma=0.4, xpos_offset=3) if o.get("xpos") else {}
      rope_spec = RopeSpec(
        jnp.asarray(inv_freq, jnp.float32),
        pos,
        pos,
        layout=layout,
        attention_factor=float(factor),
        phase_precision=precision,
        **xpos,
      )
    if o.get("alibi"):
      alibi_spec = AlibiSpec(slopes, pos, pos, max_position=1024)
    return flash.attend(
      q,
      k,
      v,
      scale=SCALE,
      mask=mask,
      alibi_spec=alibi_spec,
      rope_spec=rope_spec,
      precise_dims=extra,
      interpret=False,
      target=target,
      sinks=sinks if o.get("sinks") else None,
      local_window_size=o.get("window"),
      chunk_size=o.get("chunk"),
      logits_soft_cap=o.get("cap"),
    )

  if grad:
    value = fn

    def fn(q, k, v, sinks, *rest):  # noqa: F811
      loss = lambda q, k, v, sinks: jnp.sum(value(q, k, v, sinks, *rest).astype(jnp.float32))  # noqa: E731
      return jax.value_and_grad(loss, argnums=(0, 1, 2, 3) if o.get("sinks") else (0, 1, 2))(q, k, v, sinks)

  def structs(dtype):
    s = jax.ShapeDtypeStruct
    return (
      s((B, t_len, heads, H + extra), dtype),
      s((B, t_len, kv, H + extra), dtype),
      s((B, t_len, kv, H), dtype),
      s((heads,), jnp.float32),  # sink logits (used by the "sinks" options)
      s((B, t_len), jnp.int32),
      s((B, t_len), jnp.bool_),
      s((B, t_len), jnp.int32),
    )

  return fn, structs


def lower_flash(option: str, platform: str, dtype, grad: bool, chip: str | None = None) -> str:
  """The StableHLO text of ``flash.attend`` (``grad``: its value and q/k/v gradients) for option
  ``option`` (a key of ``OPTIONS``) lowered for ``platform`` ("cuda" or "tpu") with q, k, v of
  ``dtype``; ``chip`` (tpu only): lower as on that generation (``flash_tpu.tpu_chip``).

  Raises: whatever the lowering raises (the first line names the rule that refused).
  """
  fn, structs = _program(option, platform, grad)
  export = jax.export.export(
    jax.jit(fn),
    platforms=(platform,),
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(CUSTOM_CALL["cuda"])],
  )
  if chip is None:
    return export(*structs(dtype)).mlir_module()
  with flash_tpu.tpu_chip(chip):
    return export(*structs(dtype)).mlir_module()


def kernel_calls(text: str, platform: str) -> list[str]:
  """The names of jaxpe's flash kernels among the platform's custom calls in ``text``, in order."""
  calls = [line for line in text.splitlines() if f"custom_call @{CUSTOM_CALL[platform]}" in line]
  names = []
  for line in calls:
    found = re.findall(r"jaxpe_flash\w*_kernel", line)
    names.append(found[0] if found else "?")
  return names


LOWERED = [
  (option, platform, dtype)
  for option in OPTIONS
  for platform in PLATFORMS
  for dtype in DTYPES
  if not (platform == "tpu" and dtype == "bfloat16")
]
"""The lowering cases: every option x platform x dtype but TPU bf16, which tpu_compile_test.py compiles
for v5e (every option, gradient: compiling runs this lowering first, then XLA:TPU and Mosaic), so a
lowering row there repeated its work (22 programs, ~4 s each on 2 busy cores)."""


@pytest.mark.parametrize("option, platform, dtype", LOWERED)
def test_every_option_lowers_forward_and_backward(option, platform, dtype):
  # one program: the forward kernel (the custom_vjp's forward rule), dq and dk/dv
  text = lower_flash(option, platform, DTYPES[dtype], grad=True)
  assert sorted(kernel_calls(text, platform)) == sorted(KERNELS[platform])
  assert "jaxpe_cpu_flash" not in text


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_lowers_for_a_named_tpu_generation(chip):
  text = lower_flash("t200", "tpu", jnp.bfloat16, grad=True, chip=chip)
  assert sorted(kernel_calls(text, "tpu")) == sorted(KERNELS["tpu"])


def _forward_results(text: str, platform: str) -> str:
  """The result types of the forward kernel's custom call in ``text`` (after its ``->``)."""
  calls = [x for x in text.splitlines() if f"custom_call @{CUSTOM_CALL[platform]}" in x]
  # by the kernel's own name (the first on its line): a dq / dkv line may carry the forward's name
  # in an inline location ("jvp(jaxpe_flash_forward_kernel)") when another test turned those on
  (line,) = [x for x in calls if re.findall(r"jaxpe_flash\w*_kernel", x)[:1] == [KERNELS[platform][0]]]
  return line.split(" loc(")[0].rsplit("->", 1)[1]


def test_forward_alone_is_one_kernel_writing_no_log_sum_exp():
  # undifferentiated, the forward kernel writes o alone: the log-sum-exp is the backward's residual,
  # [B, N, T, 1] float32 on GPU, [B, N, 1, T] on TPU (a lane-dense row: as a column, its minor dim of
  # 1 took 128 lanes, 8 MiB at B 2 x N 8 x T 1024)
  lse = {"cuda": f"{B}x{N}x{T}x1xf32>", "tpu": f"{B}x{N}x1x{T}xf32>"}
  for platform in PLATFORMS:
    text = lower_flash("rope_half_exact", platform, jnp.float32, grad=False)
    assert kernel_calls(text, platform) == [KERNELS[platform][0]]
    assert _forward_results(text, platform).strip().startswith("tensor<")  # one result: o (no tuple)
    text = lower_flash("rope_half_exact", platform, jnp.float32, grad=True)
    assert lse[platform] in _forward_results(text, platform)


@pytest.mark.parametrize("option", ["plain", "gqa", "precise_dims", "t200"])
def test_the_triton_kernels_read_the_callers_layout_in_place(option):
  # issue 45: q, k, v were transposed to [B, N, T, H] around the Triton kernels and o back (16 MiB
  # of temporaries at B 2 x T 1024 x N 8 x H 128 bf16); now the forward program transposes nothing
  # and the gradient only delta's [B, T, N] float32 row statistics
  forward = lower_flash(option, "cuda", jnp.bfloat16, grad=False)
  assert "stablehlo.transpose" not in forward
  grad = lower_flash(option, "cuda", jnp.bfloat16, grad=True)
  results = [line.rsplit("->", 1)[1] for line in grad.splitlines() if "stablehlo.transpose" in line]
  assert len(results) == 1 and re.search(r"tensor<\d+x\d+x\d+xf32>", results[0]), results


def test_bad_target_and_chip_are_refused():
  q = jnp.zeros((B, 16, N, 8))
  with pytest.raises(ValueError, match=r"target must be one of \('gpu', 'tpu'\)"):
    flash.attend(q, q, q, scale=SCALE, mask=None, interpret=True, target="cuda")
  with pytest.raises(ValueError, match="block must be a multiple of 128 or at least the padded T"):
    flash.attend(q, q, q, scale=SCALE, mask=None, interpret=False, target="tpu", block=8)
  with pytest.raises(ValueError, match="tpu_chip name must be one of"):
    with flash_tpu.tpu_chip("v9"):
      pass
