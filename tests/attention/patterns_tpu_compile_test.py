"""splash with the attention patterns (its LocalMask / ChunkedCausalMask and attn_logits_soft_cap)
COMPILES for TPU v5e on this CPU-only host, forward and gradient: XLA:TPU and Mosaic compile the
kernels for a compile-only device (``benchmarks/lowering_check.compile_tpu``, as tpu_compile_test.py),
and the windowed gradient keeps no quadratic temporary at T 2048.

Needs the ``libtpu`` package; without it the module is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxpe.attention import AttentionMask, attention

ROOT = Path(__file__).resolve().parents[2]


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

OPTIONS = {
  "window": dict(local_window_size=(255, 0)),
  "chunk": dict(chunk_size=512),
  "all": dict(local_window_size=(255, 0), chunk_size=512, logits_soft_cap=50.0),
}


def _grad(opts, length=1024, heads=2, dim=128):
  def loss(q, k, v):
    out = attention(
      q, k, v, scale=dim**-0.5, mask=AttentionMask(causal=True), implementation="splash", **opts
    )
    return jnp.sum(out.astype(jnp.float32))

  struct = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.bfloat16)
  return jax.grad(loss, argnums=(0, 1, 2)), (struct, struct, struct)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_splash_pattern_gradient_compiles_for_v5e(name):
  fn, args = _grad(OPTIONS[name])
  text, compiled = lc.compile_tpu(fn, args, "v5e")
  assert "tpu_custom_call" in text and "tpu_custom_call" in compiled.as_text()


def test_splash_window_has_no_quadratic_temporary():
  length, heads = 2048, 2
  fn, args = _grad(OPTIONS["all"], length=length, heads=heads)
  _, compiled = lc.compile_tpu(fn, args, "v5e")
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < heads * length * length * 4 // 4, f"{temp} bytes of temporaries"
