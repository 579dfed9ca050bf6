"""BLOOM-560M-shaped model: importer time and peak memory, forward and generation speed against
transformers, measured in the same run (random weights: no model hub here).

  python benchmarks/bloom_bench.py [--small]

Rows (also the ``bloom`` group of ``benchmarks/run.py``):
  * ``bloom.from_hf`` on a transformers ``BloomForCausalLM``: seconds, and the peak resident memory
    it adds (Linux ``VmHWM`` after resetting it) as a multiple of the state dict's float32 bytes;
  * one forward of 1 x ``--tokens`` float32 (jitted jaxpe, compiled first, vs torch ``no_grad``):
    seconds and the time ratio, and jaxpe's model FLOP/s (its matmuls, ``ceilings.decoder_matmuls``:
    ``2 N`` per token for the N non-embedding kernels, the tied 1024 x 250,880 head and causal
    attention) against the float32 matmul ceiling at those shapes, timed alternately with it;
  * greedy generation with the KV cache, 1 prompt of 32 tokens, ``--new`` new tokens: tokens/s of
    ``jaxpe.generate`` (compiled first) vs transformers' ``generate``.
``--small`` keeps 2 of the 24 layers and a 32,768-token vocabulary (a quick check of the code path).
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from ceilings import (
  alternate,
  best_by_shape,
  ceiling_seconds,
  decoder_matmuls,
  matmul_fns,
  median,
  useful_flops,
)
from ops_bench import Row, row

BLOOM_560M = dict(
  vocab_size=250880,
  hidden_size=1024,
  n_layer=24,
  n_head=16,
  layer_norm_epsilon=1e-5,
  tie_word_embeddings=True,
)


def _rss_kib(field: str) -> int:
  text = Path("/proc/self/status").read_text()
  return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def _reset_peak() -> bool:
  """Resets the peak resident set size (Linux >= 4.0); False where that is not possible."""
  try:
    Path("/proc/self/clear_refs").write_text("5")
    return True
  except OSError:
    return False


def _median_seconds(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def bloom_rows(*, small: bool, tokens: int = 512, new: int = 32) -> list[Row]:
  import torch
  import transformers

  from jaxpe import bloom
  from jaxpe.model.generate import generate

  config = dict(BLOOM_560M, **({"n_layer": 2, "vocab_size": 32768} if small else {}))
  label = "BLOOM-560M" if not small else "BLOOM-560M shape, 2 layers, V 32768"
  torch.manual_seed(0)
  hf = transformers.BloomForCausalLM(transformers.BloomConfig(**config)).eval()
  state_bytes = sum(p.numel() * 4 for p in hf.parameters())
  n_params = state_bytes // 4
  gc.collect()
  measured_peak = _reset_peak()
  rss0 = _rss_kib("VmRSS")
  t0 = time.perf_counter()
  model = bloom.from_hf(hf)
  t_import = time.perf_counter() - t0
  peak = (_rss_kib("VmHWM") - rss0) * 1024
  rows = [row("bloom", f"import {label} ({n_params / 1e6:.0f} M params)", t_import, "s")]
  if measured_peak:
    rows.append(
      row(
        "bloom",
        "import peak extra memory",
        peak / 2**30,
        "GiB",
        ratio=peak / state_bytes,
        vs="state dict bytes",
        goal="<= 2.0",
      )
    )

  ids = np.random.default_rng(0).integers(5, config["vocab_size"], (1, tokens))
  fwd = jax.jit(lambda m, x: m(x))
  x = jnp.asarray(ids, jnp.int32)
  matmuls = decoder_matmuls(model.cfg, 1, tokens, backward=False)
  times = alternate({"jaxpe": lambda: jax.block_until_ready(fwd(model, x)), **matmul_fns(matmuls)}, rounds=3)
  t_jax = median(times["jaxpe"])
  t_ceil = ceiling_seconds(matmuls, best_by_shape(times))
  with torch.no_grad():
    xt = torch.as_tensor(ids)
    hf(xt)
    t_torch = _median_seconds(lambda: hf(xt), 2)
  flops = useful_flops(matmuls)
  rows.append(
    row(
      "bloom",
      f"forward 1 x {tokens} float32, jaxpe jit",
      t_jax,
      "s",
      ratio=t_jax / t_torch,
      vs=f"transformers {t_torch:.2f} s (time)",
      goal="<= 1.0",
    )
  )
  rows.append(
    row(
      "bloom",
      "forward model FLOP/s",
      flops / t_jax / 1e9,
      "GFLOP/s",
      ratio=t_ceil / t_jax,
      vs=f"matmul ceiling at its shapes, {flops / t_ceil / 1e9:.0f} GFLOP/s",
    )
  )

  prompt = np.random.default_rng(1).integers(5, config["vocab_size"], (1, 32))
  pj = jnp.asarray(prompt, jnp.int32)
  jax.block_until_ready(generate(model, pj, max_new_tokens=new))
  t_gen = _median_seconds(lambda: jax.block_until_ready(generate(model, pj, max_new_tokens=new)), 2)
  kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
  with torch.no_grad():
    pt = torch.as_tensor(prompt)
    hf.generate(pt, **kw)
    t_hf = _median_seconds(lambda: hf.generate(pt, **kw), 2)
  rows.append(
    row(
      "bloom",
      f"greedy generate 1 x 32 + {new}, KV cache",
      new / t_gen,
      "tokens/s",
      ratio=t_hf / t_gen,
      vs=f"transformers generate {new / t_hf:.1f} tokens/s (x faster)",
      goal=">= 1.0",
    )
  )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args()
  for r in bloom_rows(small=args.small):
    ratio = f"  {r['ratio']:.2f} vs {r['vs']}" if "ratio" in r else ""
    print(f"{r['name']}: {r['value']:.4g} {r['unit']}{ratio}")


if __name__ == "__main__":
  main()
