"""Speed of jaxpe's ops and train steps against references measured in the same run.

  python benchmarks/ops_bench.py [--small]

Prints one row per measurement (also the ``ops``, ``train`` and ``growth`` groups of
``benchmarks/run.py``, which records them):
  * the machine's ceilings: a float32 matmul's FLOP/s and ``x * 2 + 1``'s bytes/s;
  * RoPE with exact phases vs the float32-product phases (``phase_precision="float32"``, what
    apply_rope computed before exact phases; goal <= 1.15x), vs HF-style rotate-half in JAX with
    precomputed cos/sin, vs transformers' torch ``apply_rotary_pos_emb`` (with its rotary embedding),
    and as a fraction of the elementwise ceiling over the same bytes; xPos and the RoPE-emulated
    ALiBi dims against the same ceiling, the sinusoidal embedding (write only) against a pure
    write of its output;
  * RoPE-emulated ALiBi attention vs native ALiBi attention (the cost of the 2 extra dims);
  * jaxpe.dot_product_attention vs jax.nn.dot_product_attention, forward + backward;
  * a decoder train step's achieved FLOP/s vs the matmul (MFU on this machine), at the default size
    and at d_model 512 / 8 layers / 8 heads / B 8 x T 512; step time as T and D grow.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpe

Row = dict[str, Any]


def row(group: str, name: str, value: float, unit: str, **extra) -> Row:
  """One measurement: ``value`` in ``unit``; optional ``ratio`` (against ``vs``) and ``goal``
  (``">= 0.6"`` / ``"<= 1.15"``, on the ratio)."""
  return {"group": group, "name": name, "value": float(value), "unit": unit, **extra}


def bench(fn, *args, repeats: int = 7, jit: bool = True) -> float:
  """Median wall seconds of ``fn(*args)`` (jitted and compiled first unless ``jit=False``)."""
  fn = jax.jit(fn) if jit else fn
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


def ceilings(*, small: bool) -> dict[str, float]:
  """``{"matmul_flops": FLOP/s of a float32 m^3 matmul, "elementwise_bytes": bytes/s of x * 2 + 1}``
  (m = 1024 small, else 2048; x of 16.7 M float32 elements, 4.2 M small)."""
  m = 1024 if small else 2048
  a = jax.random.normal(jax.random.key(0), (m, m), jnp.float32)
  repeats = 3 if small else 7
  t_mm = bench(lambda a: a @ a, a, repeats=repeats)
  x = jax.random.normal(jax.random.key(1), (2, 512, 16, 256) if small else (8, 2048, 16, 64), jnp.float32)
  t_el = bench(lambda x: x * 2.0 + 1.0, x, repeats=repeats)
  return {"matmul_flops": 2 * m**3 / t_mm, "elementwise_bytes": 2 * x.size * 4 / t_el, "matmul_m": m}


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


def op_rows(ceil: dict[str, float], *, small: bool) -> list[Row]:
  """RoPE (exact and float32 phases), xPos, emulation dims, sinusoidal; attention comparisons."""
  b, t, n, h = (2, 512, 8, 64) if small else (8, 2048, 16, 64)
  shape = f"[{b},{t},{n},{h}]"
  key = jax.random.key(0)
  x = jax.random.normal(key, (b, t, n, h), jnp.float32)
  x2 = jax.random.normal(jax.random.key(3), (b, t, n, h), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  bw = ceil["elementwise_bytes"]
  io_bytes = 2 * x.size * 4  # read x, write the result
  rows = []

  def bandwidth_row(name, seconds, nbytes=io_bytes):
    return row(
      "ops", name, seconds * 1e3, "ms", ratio=nbytes / seconds / bw, vs="elementwise ceiling", goal=">= 0.6"
    )

  t_exact = bench(lambda x, p: jaxpe.apply_rope(x, p, layout="interleaved"), x, pos)
  t_f32 = bench(lambda x, p: jaxpe.apply_rope(x, p, phase_precision="float32", layout="interleaved"), x, pos)
  t_ref = bench(rope_rotate_half_reference, x, pos)
  rows.append(bandwidth_row(f"apply_rope exact {shape}", t_exact))
  rows.append(
    row(
      "ops",
      "apply_rope exact vs rotate-half JAX",
      t_exact * 1e3,
      "ms",
      ratio=t_ref / t_exact,
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
      ratio=t_exact / t_f32,
      vs="phase_precision=float32",
      goal="<= 1.15",
    )
  )
  rows.append(bandwidth_row(f"apply_rope float32 phases {shape}", t_f32))
  # inv_freq as a jit argument (a learnable or module-held frequency): converted in the graph.
  inv = jaxpe.rope_inv_freq(h)
  t_traced = bench(lambda x, p, i: jaxpe.apply_rope(x, p, inv_freq=i, layout="interleaved"), x, pos, inv)
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

  def both(x, k, p):
    return jaxpe.apply_rope(x, p, layout="half"), jaxpe.apply_rope(k, p, layout="half")

  t_both = bench(both, x, x2, pos)
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

  t_xpos = bench(lambda x, p: jaxpe.apply_xpos(x, p, kind="query", layout="interleaved"), x, pos)
  rows.append(bandwidth_row(f"apply_xpos {shape}", t_xpos))
  slopes = np.asarray(jaxpe.alibi_slopes(n))
  theta = jaxpe.emulation_theta(max_phase=0.1, max_len=t)
  t_emu = bench(lambda q, k, p: jaxpe.apply_rope_alibi(q, k, p, p, slopes=slopes, theta=theta), x, x2, pos)
  rows.append(
    bandwidth_row(
      f"apply_rope_alibi q,k (H+2 out) {shape}", t_emu, 4 * (2 * x.size + 2 * b * t * n * (h + 2))
    )
  )
  d_model = n * h
  t_sin = bench(lambda p: jaxpe.sinusoidal_embedding(p, d_model=d_model), pos)
  # A write-only op against a write-only ceiling: x*2+1's time is mostly its write (the kernel
  # faults in and zeroes the fresh output's pages: about 80% of its CPU time here), so the bytes of a
  # write alone over x*2+1's read+write bandwidth can reach only about 0.5.
  t_write = bench(lambda p: jnp.broadcast_to(p.astype(jnp.float32)[:, :, None], (b, t, d_model)), pos)
  write_bytes = b * t * d_model * 4
  rows.append(
    row(
      "ops",
      f"sinusoidal_embedding [{b},{t},{d_model}] vs a pure write",
      t_sin * 1e3,
      "ms",
      ratio=t_write / t_sin,
      vs=f"write-only ceiling {t_write * 1e3:.1f} ms (x*2+1 ceiling: {write_bytes / t_sin / bw:.2f})",
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

  t_native, t_emul = bench(native, q, k, v, repeats=3), bench(emulated, q, k, v, repeats=3)
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

  def grads(fn):
    return lambda q, k, v: jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)

  def ours(q, k, v):
    return jaxpe.dot_product_attention(q, k, v, scale=h**-0.5, mask=mask)

  def theirs(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=h**-0.5, is_causal=True)

  t_ours, t_theirs = bench(grads(ours), q, k, v, repeats=3), bench(grads(theirs), q, k, v, repeats=3)
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


def _model_and_batch(cfg, *, batch: int, seq: int):
  """(model, graphdef, state of (model, AdamW optimizer) as the trainer builds them, ``[batch, seq + 1]``
  int32 random tokens) for the train-step benchmarks."""
  from flax import nnx

  from jaxpe.model.decoder import Decoder
  from jaxpe.train.config import TrainConfig
  from jaxpe.train.optimizer import make_optimizer

  model = Decoder(cfg, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, make_optimizer(TrainConfig(model=cfg)), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)), jnp.int32)
  return model, graphdef, state, tokens


def train_step_cost(
  model_cfg=None, *, batch: int = 32, seq: int = 256, repeats: int = 5
) -> tuple[float, float, int]:
  """(FLOPs, median seconds, tokens) of one train step of ``model_cfg`` (default ``ModelConfig()``)
  on ``[batch, seq + 1]`` tokens, AdamW as the trainer uses it. FLOPs: ``6 N`` per token for the
  N parameters plus ``12 L T D`` per token for attention (q.k and w.v, forward and backward)."""
  from flax import nnx

  from jaxpe.model.config import ModelConfig
  from jaxpe.train.steps import next_token_loss

  cfg = model_cfg or ModelConfig()
  model, graphdef, state, tokens = _model_and_batch(cfg, batch=batch, seq=seq)

  def step(state, tokens):
    model, opt = nnx.merge(graphdef, state)
    _, grads = nnx.value_and_grad(next_token_loss)(model, tokens)
    opt.update(model, grads)
    return nnx.state((model, opt))

  seconds = bench(step, state, tokens, repeats=repeats)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  n_tokens = batch * seq
  return (6 * params + 12 * cfg.num_layers * seq * cfg.d_model) * n_tokens, seconds, n_tokens


def step_breakdown(model_cfg, *, batch: int, seq: int, repeats: int = 3) -> dict[str, float]:
  """Median seconds of the parts of a train step, each jitted alone on the step's shapes, forward +
  backward (gradients of the parameters and the input) where it says so:

  ``forward`` (the loss), ``forward_backward`` (``value_and_grad``), ``update`` (the AdamW update
  from given gradients); the model's own modules, L times on the same ``[B, T, D]`` input:
  ``attention_block`` (q/k/v/o projections, RoPE, attention), ``attention_core`` (the softmax
  attention alone on ``[B, T, N, H]``, as ``jaxpe.attention.attention(implementation="xla")`` runs it in the
  model), ``mlp`` (up, GELU, down), ``layernorm`` (the 2 L + 1 LayerNorms); ``embed_logits_loss``
  (token embedding, tied logits, cross-entropy).
  """
  from flax import nnx

  from jaxpe.attention import kernels
  from jaxpe.train.steps import next_token_loss

  cfg = model_cfg
  model, graphdef, state, tokens = _model_and_batch(cfg, batch=batch, seq=seq)

  def forward(state, tokens):
    model, _ = nnx.merge(graphdef, state)
    return next_token_loss(model, tokens)

  def forward_backward(state, tokens):
    model, _ = nnx.merge(graphdef, state)
    return nnx.value_and_grad(next_token_loss)(model, tokens)

  grads = jax.jit(forward_backward)(state, tokens)[1]

  def update(state, grads):
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, grads)
    return nnx.state((model, opt))

  n, h = cfg.num_heads, cfg.head_size
  q = jax.random.normal(jax.random.key(0), (batch, seq, n, h), jnp.float32)
  mask = jaxpe.AttentionMask(causal=True)

  def attention_core(q):
    def one(q):
      return kernels.attention(q, q, q, scale=h**-0.5, mask=mask, implementation="xla").sum()  # as the model

    return [jax.grad(one)(q + i) for i in range(cfg.num_layers)]

  x = jax.random.normal(jax.random.key(1), (batch, seq, cfg.d_model), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  blocks = list(model.blocks)

  def per_layer(modules, apply):
    """Seconds of gradients (parameters and input) of ``sum(apply(module, x))`` for each module."""
    mod_def, mod_state = nnx.split(modules)

    def run(mod_state, x):
      def loss(mod_state, x):
        return sum(apply(m, x + i).sum() for i, m in enumerate(nnx.merge(mod_def, mod_state)))

      return jax.grad(loss, argnums=(0, 1))(mod_state, x)

    return bench(run, mod_state, x, repeats=repeats)

  def attention_block(attn, x):
    return attn(x, positions, mask, kv_positions=positions)[0]

  norms = [m for b in blocks for m in (b.attn_norm, b.mlp_norm)] + [model.final_norm]
  embed_def, embed_state = nnx.split(model.embed)

  def embed_logits_loss(embed_state, x, tokens):
    def loss(embed_state, x):
      embed = nnx.merge(embed_def, embed_state)
      # the embedding lookup's gradient (a scatter-add) and the tied logits + loss on x
      logits = jnp.einsum("BTD,VD->BTV", x + embed(tokens[:, :-1]), embed.embedding[...])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return jax.grad(loss, argnums=(0, 1))(embed_state, x)

  return {
    "forward": bench(forward, state, tokens, repeats=repeats),
    "forward_backward": bench(forward_backward, state, tokens, repeats=repeats),
    "update": bench(update, state, grads, repeats=repeats),
    "attention_block": per_layer([b.attn for b in blocks], attention_block),
    "attention_core": bench(attention_core, q, repeats=repeats),
    "mlp": per_layer([b.mlp for b in blocks], lambda m, x: m(x)),
    "layernorm": per_layer(norms, lambda m, x: m(x)),
    "embed_logits_loss": bench(embed_logits_loss, embed_state, x, tokens, repeats=repeats),
  }


def train_rows(ceil: dict[str, float], *, small: bool) -> list[Row]:
  """Default-config step and the d_model 512 step as MFU against the matmul ceiling."""
  from jaxpe.model.config import ModelConfig

  big = ModelConfig(d_model=512, num_layers=8, num_heads=8, max_len=512)
  cases = [
    ("default (D 128, L 4, N 4)", ModelConfig(), 8 if small else 32, 256),
    ("D 512, L 8, N 8", big, 2 if small else 8, 256 if small else 512),
  ]
  rows = []
  for name, cfg, batch, seq in cases:
    flops, seconds, tokens = train_step_cost(cfg, batch=batch, seq=seq, repeats=3)
    rows.append(
      row(
        "train",
        f"train step {name}, B {batch} x T {seq}",
        seconds * 1e3,
        "ms",
        ratio=flops / seconds / ceil["matmul_flops"],
        vs="matmul ceiling (MFU)",
        goal=">= 0.55" if "512" in name else None,
        tokens_per_s=tokens / seconds,
      )
    )
  parts = step_breakdown(big, batch=batch, seq=seq)  # the D 512 case's parts, same shapes
  for part, secs in parts.items():
    rows.append(
      row(
        "train",
        f"D 512 step part: {part.replace('_', ' ').replace('forward backward', 'forward + backward')}",
        secs * 1e3,
        "ms",
        ratio=secs / seconds,
        vs="whole step (time)",
      )
    )
  return rows


def growth_rows(*, small: bool) -> list[Row]:
  """Train-step time per token as T grows (D 128) and as D grows (T 256), relative to the first."""
  from jaxpe.model.config import ModelConfig

  lengths = (128, 256) if small else (128, 256, 512, 1024)
  widths = (64, 128) if small else (64, 128, 256, 512)
  batch = 4 if small else 8
  rows = []
  first = None
  for t in lengths:
    _, seconds, tokens = train_step_cost(ModelConfig(max_len=t), batch=batch, seq=t, repeats=3)
    first = first or seconds / tokens
    rows.append(
      row(
        "growth",
        f"step time per token, D 128, T {t}",
        seconds / tokens * 1e6,
        "us/token",
        ratio=seconds / tokens / first,
        vs=f"T {lengths[0]}",
      )
    )
  first = None
  for d in widths:
    cfg = ModelConfig(d_model=d, num_heads=max(1, d // 32))
    _, seconds, tokens = train_step_cost(cfg, batch=batch, seq=256, repeats=3)
    first = first or seconds / tokens
    rows.append(
      row(
        "growth",
        f"step time per token, T 256, D {d}",
        seconds / tokens * 1e6,
        "us/token",
        ratio=seconds / tokens / first,
        vs=f"D {widths[0]}",
      )
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--small", action="store_true", help="smaller shapes (quick check)")
  args = parser.parse_args()
  print(f"devices: {jax.devices()}")
  ceil = ceilings(small=args.small)
  for r in ceiling_rows(ceil) + op_rows(ceil, small=args.small) + train_rows(ceil, small=args.small):
    ratio = f"  {r['ratio']:.2f} vs {r['vs']}" if "ratio" in r else ""
    print(f"{r['name']}: {r['value']:.4g} {r['unit']}{ratio}")


if __name__ == "__main__":
  main()
