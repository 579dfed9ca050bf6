"""Every attention backend for ``cuda`` COMPILED for an H100 (and a few rows for an A100) on this
CPU-only host (XLA:GPU, Triton, ptxas, cuDNN's rule for the card), forward and gradient, with and
without ALiBi, at the head sizes models use; and the train step of ``jaxpe-compile --target h100``.

Needs jax's CUDA plugin (``pip install "jaxpe[gpu-compile]"``: ``jax[cuda12]``, 4.9 GB with the
NVIDIA wheels, so not in the test extra); without it the module is skipped with that reason. Run it
from a venv that has the plugin: ``JAX_PLATFORMS=cpu <venv>/bin/python -m pytest
tests/attention/gpu_compile_test.py``. The full matrix (every H of ``lowering_check.HEAD_DIMS``) is
``python benchmarks/lowering_check.py --gpu``; its table is in docs/accelerator.md.

Issue 45 item 1: with ALiBi at H 128 ``pallas_gpu`` failed the real compile ("Shared memory size
limit exceeded: requested 327680, available: 232448": 128-row blocks of the head widened to 256), and
``cudnn`` was refused ("head dim must be <= 128": jax's cuDNN rule judged the CPU host, not the
card). These tests failed on both before the fix. ``flash`` at H 256 (and so ``auto`` at H 256 with
ALiBi: 264 dims, over cuDNN's 256) failed likewise ("requested 328192") until ``flash.gpu_block``
sized its blocks from the head widths and dtype.

Memory bound: the fused kernels' temporaries stay below ``COPIES`` float32 copies of the padded q
(no ``[B, N, T, S]`` score array at these shapes would fit that bound at T 1024).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

if importlib.util.find_spec("jax_cuda12_plugin") is None:
  pytest.skip(
    'jax\'s CUDA plugin is not installed (pip install "jaxpe[gpu-compile]", i.e. jax[cuda12]; 4.9 GB): '
    "XLA:GPU, Triton and ptxas are needed to compile for an H100 without one",
    allow_module_level=True,
  )

from jaxpe.attention import backends  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import lowering_check as lc  # noqa: E402

KERNEL = {"cudnn": "cudnn_fmha", "pallas_gpu": "triton", "flash": "triton", "auto": None, "xla": None}
COPIES = 8
"""Fused kernels' temporaries per program: at most this many float32 copies of q padded to the
kernel's head dim (measured at most 4: pallas_gpu's gradient with ALiBi at H 256)."""


def _extra(encoding: str, dim: int) -> int:
  """The most emulation dims the lean ALiBi form adds below position 65536 (3 slope parts x digits)."""
  if encoding != "alibi":
    return 0
  return backends.emulation_dim_count("cudnn", alibi_form="lean", max_position=65536)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("encoding", ["none", "alibi"])
@pytest.mark.parametrize(
  "backend, dim",
  [
    ("cudnn", 128),
    ("pallas_gpu", 128),
    ("flash", 128),
    ("auto", 128),
    ("xla", 128),
    ("pallas_gpu", 256),
    ("flash", 256),
    ("auto", 256),
  ],
)
def test_every_backend_compiles_for_h100(backend, dim, encoding, grad):
  got = lc.gpu_compile_row(backend, encoding, dim, grad=grad)
  assert isinstance(got, lc.Compiled), f"{backend} {encoding} H {dim}: {lc.describe(got)}"
  kinds = lc.call_kinds(got)
  if KERNEL[backend]:
    assert KERNEL[backend] in kinds
  if backend == "auto":  # cuDNN, or flash where cuDNN refuses the widened head (H 256 + ALiBi: 264 > 256)
    assert ("cudnn_fmha" in kinds) != ("triton" in kinds)
  if backend != "xla":
    impl = "flash" if backend == "auto" and "triton" in kinds else "cudnn" if backend == "auto" else backend
    padded = backends.padded_head_dim(impl, dim + _extra(encoding, dim))
    bound = COPIES * 2 * 256 * 4 * padded * 4  # B 2, T 256, N 4, float32
    assert got.temp <= bound, f"{backend} {encoding} H {dim}: {got.temp} bytes of temporaries"


def test_cudnn_with_alibi_at_h128_is_judged_for_the_card_not_the_host():
  """jax's cuDNN rule reads the local GPU's compute capability; on a CPU host it applied pre-Hopper
  limits (H <= 128) to an H100 program. ``targets.cuda_target`` answers for the card."""
  fn, args = lc.attention_case("cudnn", "alibi", jnp.bfloat16, grad=False, length=256, dim=128)
  text, _ = lc.compile_gpu(fn, args, "h100")
  assert "cudnn" in text


def test_the_train_step_compiles_for_h100_with_cudnn(capsys):
  from jaxpe.train import compile_cli

  overrides = ["model.attn_implementation=auto", "model.dtype=bfloat16", "sample_len=4"]
  with jax.numpy_dtype_promotion("standard"):
    code = compile_cli.main(["--config", "tiny", "--target", "h100", *overrides])
  out = capsys.readouterr().out
  assert code == 0, out
  assert "cudnn$fmha" in out and out.count(": fits") == 2


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("encoding, dim", [("alibi", 64), ("none", 128)])
def test_pallas_gpu_in_float32_fits_shared_memory(encoding, dim, grad):
  """float32 rows take twice a bf16 row's shared memory: 128-row blocks at H 128 (or H 64 widened by
  ALiBi to 72 and padded to 128) asked for 262656 bytes of 232448 before the blocks counted bytes."""
  got = lc.gpu_compile_row("pallas_gpu", encoding, dim, grad=grad, dtype=jnp.float32)
  assert isinstance(got, lc.Compiled), f"{encoding} H {dim}: {lc.describe(got)}"
  assert "triton" in lc.call_kinds(got)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize(
  "encoding, dim, dtype",
  [("rope_alibi", 128, jnp.bfloat16), ("none", 256, jnp.float32)],
  ids=["bf16-H128-emulation-dims", "float32-H256"],
)
def test_flash_blocks_fit_shared_memory(encoding, dim, dtype, grad):
  """``flash.gpu_block`` sizes the Triton blocks from the padded widths and the dtype. Before, 128-row
  blocks: float32 H 256 overflowed an H100's 232448 bytes of shared memory, and bf16 H 128 with 2
  float32 emulation dims asked 264704 in the gradient (counted at their 2 lanes, it fit on paper)."""
  got = lc.gpu_compile_row("flash", encoding, dim, grad=grad, dtype=dtype)
  assert isinstance(got, lc.Compiled), f"{encoding} H {dim} {jnp.dtype(dtype).name}: {lc.describe(got)}"
  assert "triton" in lc.call_kinds(got)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
def test_flash_reads_heads_off_a_power_of_two_in_place(grad):
  """H 80 (T 256: whole blocks): q, k, v stay 80 wide, the Triton blocks 128 lanes with the lanes
  past 80 masked, so the program's temporaries scale with H, below H 128's. Before, q, k, v were
  padded to 128 outside the kernels: bf16 H 80 held 1.25 / 1.77 MiB (forward / gradient) against
  0.50 / 1.02 at H 128; now 0.31 / 0.64."""
  got = {dim: lc.gpu_compile_row("flash", "none", dim, grad=grad) for dim in (80, 128)}
  for dim, row in got.items():
    assert isinstance(row, lc.Compiled), f"H {dim}: {lc.describe(row)}"
    assert "triton" in lc.call_kinds(row)
  assert got[80].temp < got[128].temp, {dim: row.temp for dim, row in got.items()}


@pytest.mark.parametrize(
  "backend, encoding, dim, dtype",
  [
    ("flash", "rope_alibi", 64, jnp.bfloat16),
    ("pallas_gpu", "none", 128, jnp.float32),
  ],
  ids=["flash-bf16-H64-emulation-dims", "pallas_gpu-float32-H128"],
)
def test_the_gradient_compiles_for_a100(backend, encoding, dim, dtype):
  """An A100 (sm_80) gives a block 166912 bytes of shared memory, an H100 232448: the blocks follow
  the card built for (``gpu_cards``). Before, sized for an H100 on every card, flash's gradient of
  bf16 H 64 with 2 emulation dims took 128-row blocks and failed for an A100 ("requested 167424,
  available: 166912")."""
  got = lc.gpu_compile_row(backend, encoding, dim, grad=True, chip="a100", dtype=dtype)
  assert isinstance(got, lc.Compiled), f"{backend} {encoding} H {dim}: {lc.describe(got)}"
  assert "triton" in lc.call_kinds(got)


def test_cudnn_refuses_a_head_wider_than_the_a100_takes_by_name():
  """cuDNN takes H <= 128 before Hopper: jaxpe refuses H 256 for an A100 naming the card's limit, and
  ``auto`` passes to ``flash``."""
  got = lc.gpu_compile_row("cudnn", "none", 256, grad=False, chip="a100")
  assert isinstance(got, ValueError) and "up to 128 on compute capability 8.0" in str(got)
  got = lc.gpu_compile_row("auto", "none", 256, grad=False, chip="a100")
  assert isinstance(got, lc.Compiled) and "triton" in lc.call_kinds(got)
