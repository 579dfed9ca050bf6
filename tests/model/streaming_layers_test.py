"""Issue 47: StreamingLLM (``generate(streaming=...)``, ``jaxpe.model.streaming``) on a 3-layer model
against the paper's cache written here in numpy float64: every layer's keys and values kept from when
their token was fed (unrotated), re-rotated at their ranks in the cache at every step (Xiao et al.,
arXiv 2309.17453, section 3.2; mit-han-lab/streaming-llm's ``pos_shift``), past several wraps."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from streaming_test import BASE, _reference, _step  # tests/model/streaming_test.py: one copy

from jaxpe.model import Decoder
from jaxpe.model.config import ModelConfig
from jaxpe.model.generate import generate
from jaxpe.model.streaming import init_streaming_cache


def _erf(x):
  return np.vectorize(math.erf)(x)


def _paper_reference(model, prompt, steps, start, recent):
  """StreamingLLM's cache in numpy float64 for the default block (LayerNorm, exact GELU MLP, tied
  embeddings, interleaved RoPE): each token fed once, its unrotated keys and values kept per layer;
  a step rotates the kept ones (sinks + last ``recent``) at their ranks ``0, 1, ...``. Greedy tokens
  and logits ``[B, steps, V]``."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model)))
  cfg = model.cfg
  h, group = cfg.head_size, cfg.num_heads // cfg.kv_heads
  inv_freq = cfg.rope_theta ** (-np.arange(0, h, 2) / h)

  def norm(x, w):
    x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + cfg.layernorm_eps)
    return x * w["scale"] + w["bias"]

  def rotate(x, pos):  # x [..., H] interleaved pairs at positions pos [...]
    ang = pos[..., None] * inv_freq
    c, s_ = np.cos(ang), np.sin(ang)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s_
    out[..., 1::2] = x[..., 0::2] * s_ + x[..., 1::2] * c
    return out

  kv = [([], []) for _ in range(cfg.num_layers)]  # per layer: lists of [B, K, H] per token fed
  seq, tokens, logits = [list(r) for r in np.asarray(prompt)], [], []
  for t in range(prompt.shape[1] + steps - 1):
    n = t + 1
    kept = list(range(min(start, n))) + list(range(max(start, n - recent), n))
    x = p["embed"]["embedding"][[row[t] for row in seq]]  # [B, D]
    for i in range(cfg.num_layers):
      w = p["blocks"][i]
      y = norm(x, w["attn_norm"])
      q = np.einsum("bd,dnh->bnh", y, w["attn"]["q"]["kernel"])
      kv[i][0].append(np.einsum("bd,dkh->bkh", y, w["attn"]["k"]["kernel"]))
      kv[i][1].append(np.einsum("bd,dkh->bkh", y, w["attn"]["v"]["kernel"]))
      keys = rotate(np.stack([kv[i][0][j] for j in kept], 1), np.arange(len(kept), dtype=np.float64)[:, None])
      vals = np.stack([kv[i][1][j] for j in kept], 1)  # [B, S, K, H]
      q = rotate(q, np.float64(len(kept) - 1))
      keys, vals = np.repeat(keys, group, 2), np.repeat(vals, group, 2)
      a = np.einsum("bnh,bsnh->bns", q, keys) / math.sqrt(h)
      a = np.exp(a - a.max(-1, keepdims=True))
      out = np.einsum("bns,bsnh->bnh", a / a.sum(-1, keepdims=True), vals)
      x = x + np.einsum("bnh,nhd->bd", out, w["attn"]["o"]["kernel"])
      u = norm(x, w["mlp_norm"]) @ w["mlp"]["up"]["kernel"]
      x = x + (u * 0.5 * (1 + _erf(u / math.sqrt(2)))) @ w["mlp"]["down"]["kernel"]
    if t >= prompt.shape[1] - 1:
      out = norm(x, p["final_norm"]) @ p["embed"]["embedding"].T
      logits.append(out)
      tokens.append(out.argmax(-1))
      for row, tok in zip(seq, tokens[-1]):
        row.append(int(tok))
  return np.stack(tokens, 1), np.stack(logits, 1)


@pytest.mark.parametrize("t_len", [3, 9])
def test_three_layers_equal_the_papers_cache_in_numpy(t_len):
  """Deeper layers keep the states computed when their token was fed (the paper's cache, not its
  re-computation baseline): against numpy float64 past several wraps; equal to the fresh forward
  while nothing is evicted; scanned layers give the loop's tokens."""
  cfg = dict(BASE, num_layers=3)
  model = Decoder(ModelConfig(**cfg), rngs=nnx.Rngs(1))
  prompt = np.random.default_rng(t_len).integers(0, 32, (2, t_len)).astype(np.int32)
  want, want_logits = _paper_reference(model, prompt, 12, 2, 3)
  got = np.asarray(generate(model, prompt, max_new_tokens=12, streaming=(2, 3)))
  np.testing.assert_array_equal(got, want)
  cache = init_streaming_cache(model.cfg, 2, 2, 3)
  logits, cache = model(jnp.asarray(prompt[:, : min(t_len, 5)]), cache=cache)
  logits = logits[:, -1]
  for i in range(min(t_len, 5), t_len):
    logits, cache = _step(model, jnp.asarray(prompt[:, i : i + 1]), cache)
  worst = 0.0
  for i in range(12):
    worst = max(worst, float(np.max(np.abs(np.asarray(logits) - want_logits[:, i]))))
    logits, cache = _step(model, jnp.asarray(want[:, i : i + 1]), cache)
  print(f"3 layers, s=2 r=3 T={t_len}: max |dlogit| vs numpy float64 {worst:.2e}")
  assert worst < 1e-4
  if t_len == 3:
    fresh, _ = _reference(model, prompt, 3, 2, 3)  # 3 + 2 tokens fed: no eviction yet
    np.testing.assert_array_equal(got[:, :3], fresh)
    scanned = Decoder(ModelConfig(**cfg, scan_layers=True), rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(generate(scanned, prompt, max_new_tokens=12, streaming=(2, 3)), got)
