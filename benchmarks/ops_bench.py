"""Speed of jaxpe's ops against references measured in the same run.

  python benchmarks/ops_bench.py [--small]

Prints, for each op, its time and a ratio against a reference:
  * RoPE with exact phases vs the float32-product phases (``phase_precision="float32"``, what
    apply_rope computed before exact phases; goal <= 1.15x).
  * RoPE (complex multiplication) vs HF-style rotate-half with precomputed cos/sin, and its memory
    bandwidth as a fraction of a plain elementwise op over the same bytes (the ceiling).
  * RoPE-emulated ALiBi attention vs native ALiBi attention (the cost of the 2 extra dims).
  * jaxpe.dot_product_attention vs jax.nn.dot_product_attention, forward + backward.
  * A decoder train step's achieved FLOP/s vs a 2048^3 float32 matmul (MFU on this machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxpe


def bench(fn, *args, repeats: int = 7) -> float:
  """Median wall seconds of ``fn(*args)`` (jitted, compiled first)."""
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def rope_rotate_half_reference(x, positions, base=10000.0):
  """HF transformers' apply_rotary_pos_emb (rotate-half layout) in JAX."""
  h = x.shape[-1]
  inv = 1.0 / (base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  freqs = positions.astype(jnp.float32)[..., None] * inv[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--small", action="store_true", help="smaller shapes (quick check)")
  args = parser.parse_args()
  b, t, n, h = (2, 512, 8, 64) if args.small else (8, 2048, 16, 64)
  key = jax.random.key(0)
  x = jax.random.normal(key, (b, t, n, h), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  print(f"devices: {jax.devices()}")

  t_jaxpe = bench(lambda x, p: jaxpe.apply_rope(x, p), x, pos)
  t_f32 = bench(lambda x, p: jaxpe.apply_rope(x, p, phase_precision="float32"), x, pos)
  t_ref = bench(rope_rotate_half_reference, x, pos)
  print(
    f"RoPE exact phases {t_jaxpe * 1e3:.2f} ms vs float32-product phases (phase_precision='float32', "
    f"the pre-exact apply_rope) {t_f32 * 1e3:.2f} ms: ratio {t_jaxpe / t_f32:.2f}x (goal <= 1.15)"
  )
  t_copy = bench(lambda x: x * 2.0 + 1.0, x)
  gbytes = 2 * x.size * 4 / 1e9
  print(
    f"RoPE [B,T,N,H]={x.shape}: jaxpe {t_jaxpe * 1e3:.2f} ms, rotate-half reference {t_ref * 1e3:.2f} ms, "
    f"ratio {t_ref / t_jaxpe:.2f}x (>1 = jaxpe faster)"
  )
  print(
    f"  bandwidth {gbytes / t_jaxpe:.1f} GB/s vs elementwise ceiling {gbytes / t_copy:.1f} GB/s "
    f"= {t_copy / t_jaxpe:.0%} of ceiling"
  )

  ta = min(t, 1024)
  q = jax.random.normal(key, (b, ta, n, h), jnp.float32)
  k = jax.random.normal(jax.random.key(1), (b, ta, n, h), jnp.float32)
  v = jax.random.normal(jax.random.key(2), (b, ta, n, h), jnp.float32)
  p = pos[:, :ta]
  slopes = jaxpe.alibi_slopes(n)
  mask = jaxpe.make_attention_mask(p, p)
  theta = jaxpe.emulation_theta(max_phase=0.1, max_len=ta)

  def native(q, k, v):
    return jaxpe.dot_product_attention(q, k, v, scale=h**-0.5, bias=jaxpe.alibi_bias(slopes, p, p), mask=mask)

  def emulated(q, k, v):
    qa, ka = jaxpe.apply_rope_alibi(q, k, p, p, slopes=np.asarray(slopes), theta=theta)
    return jaxpe.dot_product_attention(qa, ka, v, scale=h**-0.5, mask=mask)

  t_native, t_emul = bench(native, q, k, v), bench(emulated, q, k, v)
  print(
    f"ALiBi attention T={ta}: native {t_native * 1e3:.1f} ms, RoPE-emulated {t_emul * 1e3:.1f} ms, "
    f"ratio {t_emul / t_native:.2f}x (extra q.k FLOPs {2 / h:.1%})"
  )

  def loss(fn):
    return lambda q, k, v: jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)

  def ours(q, k, v):
    return jaxpe.dot_product_attention(q, k, v, scale=h**-0.5, mask=mask)

  def theirs(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=h**-0.5, is_causal=True)

  t_ours, t_theirs = bench(loss(ours), q, k, v), bench(loss(theirs), q, k, v)
  print(
    f"attention fwd+bwd T={ta}: jaxpe {t_ours * 1e3:.1f} ms, jax.nn.dot_product_attention "
    f"{t_theirs * 1e3:.1f} ms, ratio {t_theirs / t_ours:.2f}x (>1 = jaxpe faster)"
  )

  m = 1024 if args.small else 2048
  a = jax.random.normal(key, (m, m), jnp.float32)
  t_mm = bench(lambda a: a @ a, a)
  peak = 2 * m**3 / t_mm
  step_flops, t_step, tokens = train_step_cost(small=args.small)
  print(
    f"matmul {m}^3: {peak / 1e9:.0f} GFLOP/s (ceiling); decoder train step: {step_flops / t_step / 1e9:.0f} "
    f"GFLOP/s = {step_flops / t_step / peak:.0%} MFU, {tokens / t_step:,.0f} tokens/s"
  )


def train_step_cost(*, small: bool) -> tuple[float, float, int]:
  """(FLOPs, seconds, tokens) of one default-config train step (6 N tokens + attention)."""
  import optax
  from flax import nnx

  from jaxpe.config import ModelConfig
  from jaxpe.model import Decoder
  from jaxpe.trainer import next_token_loss

  cfg = ModelConfig()
  bsz, seq = (8, 256) if small else (32, 256)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (bsz, seq + 1)), jnp.int32)

  def step(state, batch):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(next_token_loss)(model, batch)
    opt.update(model, grads)
    return nnx.state((model, opt))

  seconds = bench(step, state, batch, repeats=5)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  tokens = bsz * seq
  attn = 2 * 2 * cfg.num_layers * bsz * seq * seq * cfg.d_model  # q.k and w.v, forward
  return 6 * params * tokens + 3 * attn, seconds, tokens


if __name__ == "__main__":
  main()
