"""Model FLOPs and MFU (model FLOPs utilisation) of a training run, as maxtext and nanoGPT report
them: the model's FLOP/s against the devices' peak.

Model FLOPs count the matmuls the model needs, 3 x the forward pass (the backward pass takes two
products per forward one), with causal attention counted over the ``(T + 1) / 2`` keys each query
sees on average (PaLM, Chowdhery et al., arXiv 2204.02311, appendix B; FlashAttention-2, Dao, arXiv
2307.08691, section 4.1); recomputation (``remat``) is not model work and is not counted. The same
count as ``benchmarks/ceilings.py``'s ``useful_flops``.

The peak: on GPUs and TPUs the vendor's dense bfloat16 matmul peak per chip (``PEAK_FLOPS``, by
device kind), times the devices; on CPU, which has no published peak, the float32 matmul ceiling
measured at the start of the run on all the run's devices at once (``measure_cpu_ceiling``: the
MLP's ``[rows, D] @ [D, F]`` product at the step's shapes, as ``benchmarks/ceilings.py`` bounds the
step). Another device reports no MFU, only model FLOP/s.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.model import encodings
from jaxpe.model.config import ModelConfig

__all__ = ["PEAK_FLOPS", "measure_cpu_ceiling", "peak_flops", "train_flops_per_token"]

PEAK_FLOPS = {
  "H200": 989e12,
  "H100": 989e12,
  "A100": 312e12,
  "L4": 121e12,
  "TPU v4": 275e12,
  "TPU v5 lite": 197e12,
  "TPU v5e": 197e12,
  "TPU v5p": 459e12,
  "TPU v5": 459e12,
  "TPU v6 lite": 918e12,
  "TPU v6e": 918e12,
}
"""Dense bfloat16 matmul peak FLOP/s per chip, by a substring of ``device_kind`` (first match, in
this order); from the vendors' data sheets (NVIDIA H100/H200 SXM, A100, L4; Google Cloud TPU)."""


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Model FLOPs of one training token (forward and backward) of a decoder ``cfg`` on sequences of
  ``seq_len`` tokens: per layer the q, k, v, o projections, the MLP (a moe MLP: its router and the k
  experts a token runs, ``jaxpe.model.moe``'s ragged form, and a shared expert), causal attention's two products
  (q.k over the dims the encoding gives q and k: rope_alibi's 2k augmented dims too) and the
  encoding's own matmuls (``PositionalEncoding.matmul_flops_per_token``: FIRE's MLP over the causal
  pairs, CoPE's ``q @ pos_emb``); the logits once. Raises ValueError for ``seq_len < 1``."""
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  d, n, kv, h, f = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.mlp_size
  enc = encodings.for_config(cfg)
  hq = h + enc.qk_extra_dims()  # the q / k projections' outputs per head
  hk = enc.cache_key()[0]  # the dims of q.k in attention (the encoded keys)
  mlp = (3 if cfg.mlp_type == "gated" else 2) * d * f  # a gated MLP's gate, up and down
  if cfg.mlp_type == "moe":  # the router, and the k experts a token is routed to (jaxpe.model.moe)
    mlp = d * cfg.num_local_experts + (cfg.num_experts_per_tok + int(cfg.moe_shared_expert)) * 3 * d * f
  projections = d * n * hq + d * kv * hq + d * kv * h + n * h * d + mlp
  # q k^T and p v over the keys each query sees: the causal half, or its window / chunk (issue 47)
  attention = n * (hk + h) * _mean_keys_per_query(cfg, seq_len)
  own = enc.matmul_flops_per_token(seq_len) / 2  # multiply-adds, as the terms above
  forward = 2 * (cfg.num_layers * (projections + attention + own) + d * cfg.vocab_size)
  return 3.0 * forward


def _mean_keys_per_query(cfg: ModelConfig, seq_len: int) -> float:
  """Keys a query sees on average over the layers, for ``seq_len`` tokens: ``(T + 1) / 2`` causal;
  ``mean_i min(i + 1, w)`` for a sliding window w; ``mean_i (i mod C) + 1`` for chunks of C."""
  t = seq_len
  full = (t + 1) / 2
  w = cfg.sliding_window or 1
  sliding = full if t <= w else (w * (w + 1) / 2 + (t - w) * w) / t
  c = cfg.attention_chunk_size or 1
  q, r = divmod(t, c)
  chunked = (q * c * (c + 1) / 2 + r * (r + 1) / 2) / t
  cost = {"full_attention": full, "sliding_attention": sliding, "chunked_attention": chunked}
  if cfg.layer_types is not None:
    return sum(cost[k] for k in cfg.layer_types) / cfg.num_layers
  if cfg.sliding_window_pattern is not None:
    n = cfg.sliding_window_pattern
    globals_ = cfg.num_layers // n
    return (globals_ * full + (cfg.num_layers - globals_) * sliding) / cfg.num_layers
  return cost[cfg.layer_pattern(0).layer_type]  # one type for every layer


def measure_cpu_ceiling(devices: list, rows: int, d: int, f: int, *, repeats: int = 5) -> float:
  """The float32 matmul FLOP/s of ``devices`` (CPU devices, all running at once): ``[rows, d] @
  [d, f]`` on each (rows capped at 4096), the best of ``repeats`` timed calls after a compiling one.
  Raises ValueError for a size < 1."""
  if min(rows, d, f) < 1 or not devices:
    raise ValueError(f"rows, d and f must be >= 1 and devices non-empty, got {rows}, {d}, {f}, {devices}")
  rows = min(rows, 4096)
  mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  x = jax.device_put(jnp.ones((len(devices), rows, d), jnp.float32), split)
  w = jax.device_put(jnp.ones((len(devices), d, f), jnp.float32), split)
  product = jax.jit(lambda a, b: jnp.einsum("brd,bdf->brf", a, b), out_shardings=split)
  product(x, w).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    product(x, w).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * len(devices) * rows * d * f / best


def peak_flops(devices: list, cfg: ModelConfig, rows: int, *, processes: int = 1) -> tuple[float | None, str]:
  """``(peak FLOP/s or None, what it is)`` of a run on ``devices`` (this process's) in each of
  ``processes`` processes: the table's bfloat16 peak times the devices for a known accelerator, the
  float32 matmul ceiling measured on ``devices`` (``rows`` per device) on CPU, else None (MFU is then
  not reported)."""
  kind, count = devices[0].device_kind, len(devices) * processes
  if devices[0].platform == "cpu":
    ceiling = measure_cpu_ceiling(devices, rows, cfg.d_model, cfg.mlp_size) * processes
    return (
      ceiling,
      f"the float32 matmul ceiling measured on {count} CPU devices, {ceiling / 1e9:,.1f} GFLOP/s",
    )
  for name, peak in PEAK_FLOPS.items():
    if name.lower() in kind.lower():
      return peak * count, f"{count} x {kind}'s bfloat16 peak, {peak * count / 1e12:,.0f} TFLOP/s"
  return None, f"no peak known for {kind!r} (model FLOP/s only)"
