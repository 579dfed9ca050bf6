"""Speed of jaxpe's ops against references measured in the same run.

  python benchmarks/ops_bench.py [--small]

Prints one row per measurement (also the ``ceiling`` and ``ops`` groups of ``benchmarks/run.py``,
which records them):
  * the machine's figures: a float32 m^3 matmul's FLOP/s and ``x * 2 + 1``'s bytes/s (best of the
    rounds; information only: every ratio below is against a ceiling measured at its own shapes);
  * RoPE with exact phases vs the float32-product phases (``phase_precision="float32"``, what
    apply_rope computed before exact phases; goal <= 1.15x), vs HF-style rotate-half in JAX with
    precomputed cos/sin, vs transformers' torch ``apply_rotary_pos_emb`` (with its rotary embedding),
    and as a fraction of the elementwise ceiling on the same arrays (``ceilings.bandwidth_fn``);
    xPos and the RoPE-emulated ALiBi dims against the same kind of ceiling, the sinusoidal embedding
    (write only) against a pure write of its output;
  * RoPE-emulated ALiBi attention vs native ALiBi attention (the cost of the 2 extra dims);
  * jaxpe.dot_product_attention vs jax.nn.dot_product_attention, forward + backward.
Each comparison times its functions alternately (``ceilings.alternate``): medians for the measured
code, the best round for a ceiling.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ceilings import alternate, bandwidth_fn, best, blocking, median

import jaxpe

Row = dict[str, Any]


def row(group: str, name: str, value: float, unit: str, **extra) -> Row:
  """One measurement: ``value`` in ``unit``; optional ``ratio`` (against ``vs``) and ``goal``
  (``">= 0.6"`` / ``"<= 1.15"``, on the ratio)."""
  return {"group": group, "name": name, "value": float(value), "unit": unit, **extra}


def rope_rotate_half_reference(x, positions, base=10000.0):
  """HF transformers' apply_rotary_pos_emb (rotate-half layout) in JAX."""
  h = x.shape[-1]
  inv = 1.0 / (base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  freqs = positions.astype(jnp.float32)[..., None] * inv[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def ceilings(*, small: bool, rounds: int = 5) -> dict[str, float]:
  """``{"matmul_flops": FLOP/s of a float32 m^3 matmul, "elementwise_bytes": bytes/s of x * 2 + 1,
  "matmul_m": m}``, each the best of ``rounds`` alternating rounds (m = 1024 small, else 2048; x of
  16.7 M float32 elements, 4.2 M small). The machine's figures at one size: ratios use ceilings
  measured at their own shapes (``benchmarks/ceilings.py``)."""
  m = 1024 if small else 2048
  a = jax.random.normal(jax.random.key(0), (m, m), jnp.float32)
  x = jax.random.normal(jax.random.key(1), (2, 512, 16, 256) if small else (8, 2048, 16, 64), jnp.float32)
  t = alternate({"mm": blocking(jnp.matmul, a, a), "el": bandwidth_fn([x], [x.shape])}, rounds=rounds)
  return {
    "matmul_flops": 2 * m**3 / best(t["mm"]),
    "elementwise_bytes": 2 * x.size * 4 / best(t["el"]),
    "matmul_m": m,
  }


def ceiling_rows(ceil: dict[str, float]) -> list[Row]:
  return [
    row("ceiling", f"matmul {ceil['matmul_m']}^3 float32", ceil["matmul_flops"] / 1e9, "GFLOP/s"),
    row("ceiling", "elementwise x*2+1 float32", ceil["elementwise_bytes"] / 1e9, "GB/s"),
  ]


def _torch_rope_seconds(shape, repeats: int) -> float | None:
  """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb on q and k of ``shape`` [B, T, N, H]
  (laid out [B, N, T, H] as HF holds them), median seconds; None without torch/transformers."""
  try:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
  except ImportError:
    return None
  b, t, n, h = shape
  config = LlamaConfig(hidden_size=n * h, num_attention_heads=n, max_position_embeddings=max(t, 2048))
  rotary = LlamaRotaryEmbedding(config)
  gen = torch.Generator().manual_seed(0)
  q = torch.randn(b, n, t, h, generator=gen)
  k = torch.randn(b, n, t, h, generator=gen)
  pos = torch.arange(t)[None].expand(b, t)

  def run():
    cos, sin = rotary(q, pos)
    return apply_rotary_pos_emb(q, k, cos, sin)

  times = []
  with torch.no_grad():
    run()
    for _ in range(repeats):
      t0 = time.perf_counter()
      run()
      times.append(time.perf_counter() - t0)
  return statistics.median(times)


def op_rows(*, small: bool, rounds: int = 7) -> list[Row]:
  """RoPE (exact and float32 phases), xPos, emulation dims, sinusoidal against ceilings on their own
  arrays; RoPE against other RoPEs; attention comparisons. Each comparison alternates its functions
  over ``rounds`` rounds."""
  b, t, n, h = (2, 512, 8, 64) if small else (8, 2048, 16, 64)
  shape = f"[{b},{t},{n},{h}]"
  key = jax.random.key(0)
  x = jax.random.normal(key, (b, t, n, h), jnp.float32)
  x2 = jax.random.normal(jax.random.key(3), (b, t, n, h), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  rows = []

  def bandwidth_row(name, times, op, inputs, out_shapes):
    """``op``'s median against the best of x*2+1 on the same inputs and output shapes."""
    nbytes = 4 * (sum(a.size for a in inputs) + sum(int(np.prod(s)) for s in out_shapes))
    t_op, t_ceil = median(times[op]), best(times[f"{op} ceiling"])
    return row(
      "ops",
      name,
      t_op * 1e3,
      "ms",
      ratio=t_ceil / t_op,
      vs=f"x*2+1 on the same arrays, {t_ceil * 1e3:.3g} ms, {nbytes / t_ceil / 1e9:.3g} GB/s (elementwise ceiling)",
      goal=">= 0.6",
    )

  inv = jaxpe.rope_inv_freq(h)
  slopes = np.asarray(jaxpe.alibi_slopes(n))
  theta = jaxpe.emulation_theta(max_phase=0.1, max_len=t)
  d_model = n * h
  aug = (b, t, n, h + 2)
  times = alternate(
    {
      "exact": blocking(lambda x, p: jaxpe.apply_rope(x, p, layout="interleaved"), x, pos),
      "exact ceiling": bandwidth_fn([x], [x.shape]),
      "float32": blocking(
        lambda x, p: jaxpe.apply_rope(x, p, phase_precision="float32", layout="interleaved"), x, pos
      ),
      "float32 ceiling": bandwidth_fn([x], [x.shape]),
      "rotate-half": blocking(rope_rotate_half_reference, x, pos),
      # inv_freq as a jit argument (a learnable or module-held frequency): converted in the graph.
      "traced": blocking(
        lambda x, p, i: jaxpe.apply_rope(x, p, inv_freq=i, layout="interleaved"), x, pos, inv
      ),
      "both half": blocking(
        lambda x, k, p: (jaxpe.apply_rope(x, p, layout="half"), jaxpe.apply_rope(k, p, layout="half")),
        x,
        x2,
        pos,
      ),
      "xpos": blocking(lambda x, p: jaxpe.apply_xpos(x, p, kind="query", layout="interleaved"), x, pos),
      "xpos ceiling": bandwidth_fn([x], [x.shape]),
      "rope_alibi": blocking(
        lambda q, k, p: jaxpe.apply_rope_alibi(q, k, p, p, slopes=slopes, theta=theta), x, x2, pos
      ),
      "rope_alibi ceiling": bandwidth_fn([x, x2], [aug, aug]),
      "sinusoidal": blocking(lambda p: jaxpe.sinusoidal_embedding(p, d_model=d_model), pos),
      # the sinusoidal embedding's ceiling: a pure write of its output
      "write": blocking(lambda p: jnp.broadcast_to(p.astype(jnp.float32)[:, :, None], (b, t, d_model)), pos),
    },
    rounds=rounds,
  )
  t_exact = median(times["exact"])
  rows.append(bandwidth_row(f"apply_rope exact {shape}", times, "exact", [x], [x.shape]))
  rows.append(
    row(
      "ops",
      "apply_rope exact vs rotate-half JAX",
      t_exact * 1e3,
      "ms",
      ratio=median(times["rotate-half"]) / t_exact,
      vs="rotate-half (x faster)",
      goal=">= 1.0",
    )
  )
  rows.append(
    row(
      "ops",
      "apply_rope exact / float32 phases (time)",
      t_exact * 1e3,
      "ms",
      ratio=t_exact / median(times["float32"]),
      vs="phase_precision=float32",
      goal="<= 1.15",
    )
  )
  rows.append(bandwidth_row(f"apply_rope float32 phases {shape}", times, "float32", [x], [x.shape]))
  t_traced = median(times["traced"])
  rows.append(
    row(
      "ops",
      "apply_rope exact, traced / concrete inv_freq (time)",
      t_traced * 1e3,
      "ms",
      ratio=t_traced / t_exact,
      vs="concrete inv_freq",
      goal="<= 1.15",
    )
  )
  t_both = median(times["both half"])
  t_torch = _torch_rope_seconds((b, t, n, h), repeats=5)
  if t_torch is not None:
    rows.append(
      row(
        "ops",
        "apply_rope q,k (half) vs torch HF apply_rotary_pos_emb",
        t_both * 1e3,
        "ms",
        ratio=t_torch / t_both,
        vs=f"torch {t_torch * 1e3:.1f} ms (x faster)",
        goal=">= 1.0",
      )
    )
  rows.append(bandwidth_row(f"apply_xpos {shape}", times, "xpos", [x], [x.shape]))
  rows.append(
    bandwidth_row(f"apply_rope_alibi q,k (H+2 out) {shape}", times, "rope_alibi", [x, x2], [aug, aug])
  )
  # A write-only op against a pure write of the same output (its ceiling: no read).
  t_sin, t_write = median(times["sinusoidal"]), best(times["write"])
  rows.append(
    row(
      "ops",
      f"sinusoidal_embedding [{b},{t},{d_model}] vs a pure write",
      t_sin * 1e3,
      "ms",
      ratio=t_write / t_sin,
      vs=f"write-only ceiling {t_write * 1e3:.2g} ms",
      goal=">= 0.6",
    )
  )

  ta = min(t, 1024)
  q, k, v = (jax.random.normal(jax.random.key(i), (b, ta, n, h), jnp.float32) for i in range(3))
  p = pos[:, :ta]
  mask = jaxpe.dense_attention_mask(p, p)
  theta = jaxpe.emulation_theta(max_phase=0.1, max_len=ta)

  def native(q, k, v):
    return jaxpe.dot_product_attention(q, k, v, scale=h**-0.5, bias=jaxpe.alibi_bias(slopes, p, p), mask=mask)

  def emulated(q, k, v):
    qa, ka = jaxpe.apply_rope_alibi(q, k, p, p, slopes=slopes, theta=theta)
    return jaxpe.dot_product_attention(qa, ka, v, scale=h**-0.5, mask=mask)

  def grads(fn):
    return lambda q, k, v: jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)

  def ours(q, k, v):
    return jaxpe.dot_product_attention(q, k, v, scale=h**-0.5, mask=mask)

  def theirs(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=h**-0.5, is_causal=True)

  times = alternate(
    {
      "native": blocking(native, q, k, v),
      "emulated": blocking(emulated, q, k, v),
      "ours": blocking(grads(ours), q, k, v),
      "theirs": blocking(grads(theirs), q, k, v),
    },
    rounds=3,
  )
  t_native, t_emul = median(times["native"]), median(times["emulated"])
  rows.append(
    row(
      "ops",
      f"ALiBi attention RoPE-emulated T={ta}",
      t_emul * 1e3,
      "ms",
      ratio=t_emul / t_native,
      vs=f"native ALiBi {t_native * 1e3:.0f} ms (time)",
      goal="<= 1.1",
    )
  )
  t_ours, t_theirs = median(times["ours"]), median(times["theirs"])
  rows.append(
    row(
      "ops",
      f"attention fwd+bwd T={ta}",
      t_ours * 1e3,
      "ms",
      ratio=t_theirs / t_ours,
      vs="jax.nn.dot_product_attention (x faster)",
      goal=">= 1.0",
    )
  )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--small", action="store_true", help="smaller shapes (quick check)")
  args = parser.parse_args()
  print(f"devices: {jax.devices()}")
  for r in ceiling_rows(ceilings(small=args.small)) + op_rows(small=args.small):
    ratio = f"  {r['ratio']:.2f} vs {r['vs']}" if "ratio" in r else ""
    print(f"{r['name']}: {r['value']:.4g} {r['unit']}{ratio}")


if __name__ == "__main__":
  main()
