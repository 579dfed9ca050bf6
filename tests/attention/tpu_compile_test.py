"""jaxpe's ``flash`` kernel COMPILES for TPU v5e and v6e on this CPU-only host, for every option it
takes, forward and gradient, bf16 and float32; ``splash`` and ``xla`` beside it.

Lowering (flash_lowering_test.py) runs Pallas' rules only; here XLA:TPU and Mosaic compile each
program for a compile-only device of a deviceless topology (``lowering_check.compile_tpu``:
``get_topology_desc(platform="tpu", ...)``, a one-device mesh, ``jax.jit(f).lower(...).compile()``).
Issue 45: every TPU flash program lowered but Mosaic refused the kernels ("Bad lhs type": HIGHEST
precision on bf16 x bf16 matmuls); these tests failed with that error before the fix.

Needs the ``libtpu`` package (``pip install "jax[tpu]==<jax version>"``); without it the module is
skipped, with the reason. conftest's ``JAX_PLATFORMS=cpu`` does not stop it: the TPU plugin is loaded
for the topology, not as a backend (``jax.devices()`` stays the CPU's). ``lowering_check.TPU_ENVIRONMENT``
is set first (``ALLOW_MULTIPLE_LIBTPU_LOAD``: xdist workers each load libtpu).

Memory: ``memory_analysis().temp_size_in_bytes`` is XLA:TPU's HBM temporaries (buffers it places in
VMEM are not counted). The bounds: at the tiny shapes, ``TINY_TEMP_BOUND``; at T 2048 the gradient's
temporaries below a quarter of one float32 ``[N, T, T]`` score array (no quadratic buffer).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.attention import AlibiSpec, AttentionMask, RopeSpec, attention

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _load(name: str, path: Path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules.setdefault(name, module)
  spec.loader.exec_module(module)
  return sys.modules[name]


lc = _load("lowering_check", ROOT / "benchmarks" / "lowering_check.py")
if not lc.libtpu_installed():
  pytest.skip(
    'libtpu is not installed (pip install "jax[tpu]==<the installed jax>"): the TPU compiler and '
    "Mosaic are needed to compile for a TPU generation without one",
    allow_module_level=True,
  )
cases = _load("flash_lowering_cases", HERE / "flash_lowering_test.py")  # OPTIONS, _program, KERNELS

TINY_TEMP_BOUND = 1 << 20
"""HBM temporaries of one tiny program (B 1, T <= 200, N <= 4, H 64) on v5e / v6e: at most 1 MiB.
Measured 0 for every option, forward and gradient (XLA:TPU keeps these buffers in VMEM); before the
undifferentiated forward stopped writing the log-sum-exp, up to 571 KiB (t200 forward bf16 on v5e:
its ``[B, N, T, 1]`` float32, the minor dim padded to 128 lanes). v5p keeps less in VMEM (up to
1.8 MiB, t200 gradient): ``test_flash_patterns_compile_for_v4_and_v5p`` bounds it apart."""
SUBSET = ("t200", "xpos", "gqa", "segments", "precise_dims", "rope_interleaved_float32")
"""The options v6e and float32 compile (the most code between them: every table, mask and operand
kind): every option in bf16 on v5e, these beside it, keep the module near 30 s on 2 busy cores."""
PATTERNS = ("window", "window_two_sided", "chunk", "soft_cap", "sinks", "patterns_all")
"""The attention patterns and sinks (issue 47 / 48): every one on v5e and v6e, gradient (one program
with the forward, dq and dk/dv kernels: Mosaic's grids over the needed key / query blocks only, the
sink logits' gradient); all of them together in float32 and as a forward alone too."""


def _compile(fn, args, chip):
  text, compiled = lc.compile_tpu(fn, args, chip)
  return text, compiled, compiled.memory_analysis().temp_size_in_bytes


def _flash_case(option: str, chip: str, dtype: str, grad: bool):
  fn, structs = cases._program(option, "tpu", grad)
  text, compiled, temp = _compile(fn, structs(cases.DTYPES[dtype]), chip)
  expected = cases.KERNELS["tpu"] if grad else cases.KERNELS["tpu"][:1]
  assert sorted(cases.kernel_calls(text, "tpu")) == sorted(expected)
  assert "tpu_custom_call" in compiled.as_text()
  assert temp <= TINY_TEMP_BOUND, f"{option} {dtype} on {chip}: {temp} bytes of temporaries"


@pytest.mark.parametrize(
  "option, dtype",
  [(o, "bfloat16") for o in cases.OPTIONS] + [(o, "float32") for o in (*SUBSET, "patterns_all")],
)
def test_flash_gradient_compiles_for_v5e(option, dtype):
  # value_and_grad: one program holding the forward, dq and dk/dv kernels
  _flash_case(option, "v5e", dtype, grad=True)


@pytest.mark.parametrize("option", SUBSET + PATTERNS)
def test_flash_gradient_compiles_for_v6e(option):
  _flash_case(option, "v6e", "bfloat16", grad=True)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("option", ("t200", "patterns_all"))
def test_flash_forward_alone_compiles(chip, option):
  # undifferentiated: the forward kernel without the log-sum-exp (the sinks, windows and chunks in it)
  _flash_case(option, chip, "bfloat16", grad=False)


OTHER_GENERATIONS = ("v4", "v5p")
"""TPU v4 and v5p (two TensorCores a chip): the attention patterns and sinks in one program each."""


@pytest.mark.parametrize("chip", OTHER_GENERATIONS)
def test_flash_patterns_compile_for_v4_and_v5p(chip):
  # one program per generation (~7 s each on 2 busy cores): the gradients (forward with its
  # log-sum-exp, dq, dk/dv kernels) of every pattern at once (causal window + chunk + soft cap +
  # sinks + ALiBi + RoPE + GQA + padding: patterns_all) and of the two-sided, non-causal window
  parts = ("patterns_all", "window_two_sided")
  programs = [cases._program(option, "tpu", True) for option in parts]

  def fn(*groups):
    return tuple(f(*args) for (f, _), args in zip(programs, groups))

  args = [structs(jnp.bfloat16) for _, structs in programs]
  text, compiled, temp = _compile(fn, args, chip)
  assert sorted(cases.kernel_calls(text, "tpu")) == sorted(cases.KERNELS["tpu"] * len(parts))
  assert compiled.as_text().count("tpu_custom_call") >= 3 * len(parts)
  # v4: 0 bytes (all in VMEM); v5p keeps more in HBM: 1.70 MB measured, all O(T) (the head-major
  # copies of q, k, v and the gradients), below one float32 [B, N, T, T] score array of patterns_all
  b, t_len, heads = cases.B, cases.OPTIONS["patterns_all"]["t_len"], cases.OPTIONS["patterns_all"]["heads"][0]
  assert temp < b * heads * t_len * t_len * 4, f"{chip}: {temp} bytes of temporaries"


def _attention_grad(impl: str, length: int, dtype=jnp.bfloat16, heads=2, dim=128):
  def loss(q, k, v):
    out = attention(q, k, v, scale=dim**-0.5, mask=AttentionMask(causal=True), implementation=impl)
    return jnp.sum(out.astype(jnp.float32))

  struct = jax.ShapeDtypeStruct((1, length, heads, dim), dtype)
  return jax.grad(loss, argnums=(0, 1, 2)), (struct, struct, struct)


@pytest.mark.parametrize("impl", ["flash", "splash", "xla"])
def test_every_tpu_backend_compiles_without_a_quadratic_temporary(impl):
  # attention(implementation=...) as a model calls it, gradient, B 1 x T 2048 x N 2 x H 128 bf16
  length, heads = 2048, 2
  fn, args = _attention_grad(impl, length, heads=heads)
  text, compiled, temp = _compile(fn, args, "v5e")
  kernels = "tpu_custom_call" in text and "tpu_custom_call" in compiled.as_text()
  assert kernels == (impl != "xla")
  scores = heads * length * length * 4  # one float32 [N, T, S] score array: 32 MiB
  assert temp < scores // 4, f"{impl}: {temp} bytes of temporaries"


def test_flash_per_token_operands_stay_lane_dense_at_a_long_context():
  # the gradient's log-sum-exp and delta ([B, N, T] float32 each) and the per-token positions and
  # segment ids as [., T, 1] columns took 128 lanes per token in HBM; as [., 1, T] rows they hold T
  # on the lanes. B 2 x T 8192 x N 8 x K 2 x H 128 bf16, causal, padding, RoPE with xPos, ALiBi, on
  # v5e: 18.0 MiB of temporaries with the statistics as rows and the per-token columns, 1.4 MiB now
  # (B 1 without the encodings: 33.7 MB with the statistics as columns)
  batch, length, heads, kv, dim = 2, 8192, 8, 2, 128
  slopes = np.asarray(jaxpe.alibi_slopes(heads), np.float64)

  def loss(q, k, v, pos, valid):
    out = attention(
      q,
      k,
      v,
      scale=dim**-0.5,
      mask=AttentionMask(valid=valid, causal=True),
      implementation="flash",
      rope_spec=RopeSpec(jaxpe.rope_inv_freq(dim), pos, pos, layout="half", xpos_scale_base=512.0),
      alibi_spec=AlibiSpec(slopes, pos, pos, max_position=65536),
    )
    return jnp.sum(out.astype(jnp.float32))

  s = jax.ShapeDtypeStruct
  kv_struct = s((batch, length, kv, dim), jnp.bfloat16)
  args = (s((batch, length, heads, dim), jnp.bfloat16), kv_struct, kv_struct)
  args += (s((batch, length), jnp.int32), s((batch, length), jnp.bool_))
  _, _, temp = _compile(jax.grad(loss, argnums=(0, 1, 2)), args, "v5e")
  column_bytes = batch * length * 128 * 4  # one [B, T, 1] 32-bit column padded to 128 lanes: 8 MiB
  assert temp < column_bytes // 2, f"{temp} bytes of temporaries"


def test_bad_chip_is_refused():
  with pytest.raises(ValueError, match=r"chip must be one of \['v4', 'v5e', 'v5p', 'v6e'\], got 'v9'"):
    lc.tpu_devices("v9")
