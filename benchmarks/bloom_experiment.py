"""BLOOM experiment: native ALiBi (transformers) vs jaxpe ALiBi vs jaxpe RoPE-emulated ALiBi.

Two models:

* ``large``: the public BLOOM-560M config (vocab 250,880, D 1024, 24 layers, 16 heads) with random
  weights from ``--seed`` (the trained weights cannot be downloaded here), or the real weights when
  ``--checkpoint DIR`` names a local HF checkpoint directory.
* ``small``: a BLOOM-compatible byte-level ALiBi model trained with ``jaxpe.trainer.train`` on the
  Python standard library's sources for ``--train-seconds``, exported to HF with
  ``jaxpe.bloom.save_hf`` and loaded in transformers for the native reference.

For each: max and mean |delta logit|, KL(native || x), top-1 agreement, per-head attention
statistics (entropy, max weight, variance of the weights over the visible keys, averaged over query
rows and layers), greedy-generation agreement over ``--gen-tokens`` tokens (batched, left-padded
prompts, KV cache), and for the small model held-out bits/byte and perplexity at 1x and 4x its
training context. Writes ``<out>/results.md``, ``<out>/results.json`` and plots.

  python benchmarks/bloom_experiment.py --out runs/bloom_experiment          # both parts
  python benchmarks/bloom_experiment.py --part small --train-seconds 120
  python benchmarks/bloom_experiment.py --part large --checkpoint /path/to/bloom-560m
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe import bloom, emulation, study
from jaxpe.attention import masks
from jaxpe.model.config import ModelConfig
from jaxpe.model.encodings import emulation_theta
from jaxpe.model.generate import generate
from jaxpe.ops import alibi, positions, rope
from jaxpe.train import data, trainer
from jaxpe.train.config import DataConfig, TrainConfig

# Public config of bigscience/bloom-560m (shared/DESIGN.md section 4).
BLOOM_560M = {
  "model_type": "bloom",
  "architectures": ["BloomForCausalLM"],
  "vocab_size": 250880,
  "hidden_size": 1024,
  "n_layer": 24,
  "n_head": 16,
  "layer_norm_epsilon": 1e-5,
  "initializer_range": 0.02,
  "tie_word_embeddings": True,
  "apply_residual_connection_post_layernorm": False,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "pad_token_id": 3,
}


# ------------------------------------------------------------------------------------- metrics


def compare_logits(ref: np.ndarray, out: np.ndarray, valid: np.ndarray, chunk: int = 64) -> dict[str, float]:
  """max/mean |delta logit|, mean KL(ref || out) in nats and top-1 agreement over valid positions.

  ``ref``, ``out``: ``[B, T, V]``; ``valid``: ``[B, T]`` bool. Computed in float64, ``chunk``
  positions at a time.
  """
  max_abs, sum_abs, sum_kl, agree, count = 0.0, 0.0, 0.0, 0, 0
  for b in range(ref.shape[0]):
    idx = np.flatnonzero(valid[b])
    for start in range(0, idx.size, chunk):
      sel = idx[start : start + chunk]
      r, o = ref[b, sel].astype(np.float64), out[b, sel].astype(np.float64)
      d = np.abs(r - o)
      max_abs = max(max_abs, float(d.max()))
      sum_abs += float(d.mean(axis=-1).sum())
      lr = r - np.logaddexp.reduce(r, axis=-1, keepdims=True)
      lo = o - np.logaddexp.reduce(o, axis=-1, keepdims=True)
      sum_kl += float((np.exp(lr) * (lr - lo)).sum())
      agree += int((r.argmax(-1) == o.argmax(-1)).sum())
      count += sel.size
  kl = max(sum_kl / count, 0.0)  # KL >= 0; float64 rounding can leave -1e-14
  return {"max_abs": max_abs, "mean_abs": sum_abs / count, "kl": kl, "top1": agree / count}


def head_stats(probs: np.ndarray, valid: np.ndarray) -> dict[str, np.ndarray]:
  """Per-head attention statistics, averaged over valid query rows: ``[N]`` each.

  entropy (nats), max weight, and the variance of the weights over the keys the row may see.
  ``probs``: ``[B, N, T, S]`` (zeros at masked keys); ``valid``: ``[B, T]`` bool (keys = queries).
  """
  p = probs.astype(np.float64)
  seen = (
    valid[:, None, None, :] & (np.arange(p.shape[3])[None, :] <= np.arange(p.shape[2])[:, None])[None, None]
  )
  n_keys = np.maximum(seen.sum(-1), 1)  # [B, 1, T]
  entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
  mean = 1.0 / n_keys
  var = (np.where(seen, (p - mean[..., None]) ** 2, 0.0)).sum(-1) / n_keys
  rows = np.broadcast_to(valid[:, None, :], entropy.shape)
  avg = lambda x: (x * rows).sum((0, 2)) / rows.sum((0, 2))  # noqa: E731
  return {"entropy": avg(entropy), "max": avg(p.max(-1)), "var": avg(var)}


def mean_stats(per_layer: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """``[L, N]`` arrays of each statistic from a list of per-layer dicts."""
  return {k: np.stack([s[k] for s in per_layer]) for k in per_layer[0]}


def jax_attention_stats(model, tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
  """Per-layer, per-head attention statistics of a jaxpe ``Decoder`` (``[L, N]`` each).

  Walks the blocks: each layer's attention probabilities are recomputed from its q/k projections
  with the model's position encoding (ALiBi bias, or the in-projection emulation pair), then the
  block itself advances the residual stream.
  """
  cfg = model.cfg
  tok, valid = jnp.asarray(tokens), jnp.asarray(mask, bool)
  pos = positions.positions_from_mask(jnp.asarray(mask))
  index = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  amask = masks.dense_attention_mask(index, index, k_valid=valid)
  x = model.embed(tok)
  if cfg.embed_layernorm:
    x = model.embed_norm(x)
  x = x.astype(jnp.float32)

  @jax.jit
  def probs_of(q, k):
    if cfg.pos_encoding == "rope_alibi" and cfg.rope_alibi_in_projection:
      inv_freq = jnp.asarray([0.0] * (cfg.head_size // 2) + [emulation_theta(cfg)], jnp.float32)
      q, k = (
        rope.apply_rope(q, pos, inv_freq=inv_freq, layout="interleaved"),
        rope.apply_rope(k, pos, inv_freq=inv_freq, layout="interleaved"),
      )
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.float32(math.sqrt(cfg.head_size))
    if cfg.pos_encoding == "alibi":
      logits = logits + alibi.alibi_bias(alibi.alibi_slopes(cfg.num_heads), pos, pos)
    logits = jnp.where(amask, logits, jnp.finfo(jnp.float32).min)
    return jnp.where(amask, jax.nn.softmax(logits, axis=-1), 0.0)

  per_layer = []
  for block in model.blocks:
    h = block.attn_norm(x).astype(cfg.dtype)
    p = probs_of(block.attn.q(h).astype(jnp.float32), block.attn.k(h).astype(jnp.float32))
    per_layer.append(head_stats(np.asarray(p), mask.astype(bool)))
    x, _ = block(x, pos, amask, kv_positions=pos)
  return mean_stats(per_layer)


def torch_outputs(hf, tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Logits ``[B, T, V]`` and per-layer attention statistics of a transformers BLOOM."""
  import torch

  with torch.no_grad():
    out = hf(torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask), output_attentions=True)
  stats = mean_stats([head_stats(a.numpy(), mask.astype(bool)) for a in out.attentions])
  return out.logits.numpy(), stats


def greedy_torch(hf, prompt: np.ndarray, mask: np.ndarray, new: int) -> np.ndarray:
  import torch

  with torch.no_grad():
    out = hf.generate(
      torch.as_tensor(prompt),
      attention_mask=torch.as_tensor(mask),
      max_new_tokens=new,
      min_new_tokens=new,
      do_sample=False,
      pad_token_id=0,
      eos_token_id=None,
    )
  return out[:, prompt.shape[1] :].numpy()


def agreement(ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
  """Share of equal tokens, and the mean index of the first differing token (= length if none)."""
  same = ref == out
  first = [int(np.argmin(row)) if not row.all() else row.size for row in same]
  return {"match": float(same.mean()), "first_diff": float(np.mean(first))}


# ------------------------------------------------------------------------------------- report


def _fmt(x: float) -> str:
  return f"{x:.3g}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.4f}"


def logits_table(rows: dict[str, dict[str, float]]) -> str:
  lines = [
    "| vs transformers (native ALiBi) | max abs delta logit | mean abs delta logit | KL (nats/token) | top-1 agreement |",
    "|---|---|---|---|---|",
  ]
  for name, r in rows.items():
    lines.append(
      f"| {name} | {_fmt(r['max_abs'])} | {_fmt(r['mean_abs'])} | {_fmt(r['kl'])} | {r['top1']:.4f} |"
    )
  return "\n".join(lines)


def attention_table(stats: dict[str, dict[str, np.ndarray]]) -> str:
  """Per head, averaged over layers: entropy / max weight / variance of each model, and the largest
  per-layer deviation from native over all layers and heads."""
  names = list(stats)
  n = stats[names[0]]["entropy"].shape[1]
  head = "| head | " + " | ".join(f"{m} entropy / max / var" for m in names) + " |"
  lines = [head, "|---|" + "---|" * len(names)]
  for h in range(n):
    cells = [
      f"{s['entropy'][:, h].mean():.4f} / {s['max'][:, h].mean():.4f} / {s['var'][:, h].mean():.3g}"
      for s in stats.values()
    ]
    lines.append(f"| {h} | " + " | ".join(cells) + " |")
  native = stats[names[0]]
  lines.append("")
  lines.append("| largest deviation from native over layers x heads | entropy | max weight | variance |")
  lines.append("|---|---|---|---|")
  for m in names[1:]:
    dev = [float(np.abs(stats[m][k] - native[k]).max()) for k in ("entropy", "max", "var")]
    lines.append(f"| {m} | {dev[0]:.3g} | {dev[1]:.3g} | {dev[2]:.3g} |")
  return "\n".join(lines)


def plot(stats, deltas, path: Path, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
  n = next(iter(stats.values()))["entropy"].shape[1]
  width = 0.8 / len(stats)
  for k, (name, s) in enumerate(stats.items()):
    a.bar(np.arange(n) + k * width, s["entropy"].mean(0), width, label=name)
  a.set_xticks(np.arange(n) + width * (len(stats) - 1) / 2, [str(h) for h in range(n)])
  a.set_xlabel("head")
  a.set_ylabel("attention entropy (nats), mean over layers")
  a.legend()
  for name, d in deltas.items():
    b.semilogy(np.maximum(d, 1e-12), lw=0.8, label=name)
  b.set_xlabel("position")
  b.set_ylabel("max |delta logit| vs transformers")
  b.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def per_position_delta(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
  return np.abs(ref[0].astype(np.float64) - out[0]).max(-1)


def left_pad(rows: list[np.ndarray], pad: int) -> tuple[np.ndarray, np.ndarray]:
  t = max(len(r) for r in rows)
  tokens = np.full((len(rows), t), pad, np.int64)
  mask = np.zeros((len(rows), t), np.int64)
  for b, r in enumerate(rows):
    tokens[b, t - len(r) :], mask[b, t - len(r) :] = r, 1
  return tokens, mask


def conversion_note(emu_cfg: ModelConfig, used: int) -> str:
  theta = emulation_theta(emu_cfg)
  amp = emulation.emulation_amplitudes(
    alibi.alibi_slopes_f64(emu_cfg.num_heads), head_dim=emu_cfg.head_size, theta=theta
  )
  return (
    f"Emulation: context {emu_cfg.rope_alibi_context}, theta = {theta:.4g} rad/token "
    f"(max phase {theta * emu_cfg.rope_alibi_context:.3g}), N_h from {amp.min():.4g} to {amp.max():.4g}; "
    f"predicted worst bias error {bloom.bias_error_bound(emu_cfg, emu_cfg.rope_alibi_context - 1).max():.3g} "
    f"logits over the context, {bloom.bias_error_bound(emu_cfg, used - 1).max():.3g} over the {used} tokens used."
  )


def compare_models(hf, models, tokens, mask, gen_prompt, gen_mask, gen_tokens, timings) -> dict:
  """Logits, attention statistics and greedy generation of native (``hf``) and jaxpe ``models`` (name -> model)."""
  t0 = time.time()
  ref, native_stats = torch_outputs(hf, tokens, mask)
  timings["torch forward + attentions (s)"] = time.time() - t0
  stats = {"native (transformers)": native_stats}
  rows, deltas, gens = {}, {}, {}
  valid = mask.astype(bool)
  for name, m in models.items():
    t0 = time.time()
    out = np.asarray(m(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)))
    timings[f"{name} forward (s)"] = time.time() - t0
    rows[name] = compare_logits(ref, out, valid)
    deltas[name] = per_position_delta(ref, out)
    del out
    stats[name] = jax_attention_stats(m, tokens, mask)
    gc.collect()
  t0 = time.time()
  ref_gen = greedy_torch(hf, gen_prompt, gen_mask, gen_tokens)
  timings["torch greedy generation (s)"] = time.time() - t0
  ours = {}
  for name, m in models.items():
    t0 = time.time()
    ours[name] = np.asarray(
      generate(m, jnp.asarray(gen_prompt), attention_mask=jnp.asarray(gen_mask), max_new_tokens=gen_tokens)
    )
    timings[f"{name} greedy generation (s)"] = time.time() - t0
    gens[name] = agreement(ref_gen, ours[name])
  for name in list(ours)[1:]:
    gens[f"{name} vs jaxpe ALiBi (not native)"] = agreement(ours["jaxpe ALiBi"], ours[name])
  return {"logits": rows, "stats": stats, "deltas": deltas, "generation": gens, "ref_gen": ref_gen}


def generation_table(gens: dict, n: int) -> str:
  lines = [
    f"| greedy, {n} new tokens, batched left-padded prompts | tokens equal to native | first differing token (mean) |",
    "|---|---|---|",
  ]
  for name, g in gens.items():
    lines.append(f"| {name} | {g['match']:.4f} | {g['first_diff']:.1f} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------- parts


def run_large(args, out: Path) -> tuple[str, dict]:
  import torch
  import transformers

  timings: dict[str, float] = {}
  t0 = time.time()
  if args.checkpoint:
    hf = transformers.BloomForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    source = f"real weights from {args.checkpoint}"
  else:
    torch.manual_seed(args.seed)
    config = {**BLOOM_560M, "n_layer": args.large_layers}
    hf = transformers.BloomForCausalLM(transformers.BloomConfig(**config)).eval()
    source = f"public BLOOM-560M config, random weights (torch seed {args.seed}, init std 0.02)"
    if args.large_layers != 24:
      source += f", only {args.large_layers} layers"
  timings["build transformers model (s)"] = time.time() - t0
  n_params = sum(p.numel() for p in hf.parameters())
  t0 = time.time()
  model = bloom.from_hf(hf)
  timings["import into jaxpe (s)"] = time.time() - t0
  t0 = time.time()
  emu = bloom.to_emulated(model, context=args.large_context, max_phase=args.max_phase)
  timings["convert to emulated (s)"] = time.time() - t0
  gc.collect()

  rng = np.random.default_rng(args.seed)
  vocab = hf.config.vocab_size
  tokens = rng.integers(5, vocab, (1, args.large_tokens))
  mask = np.ones_like(tokens)
  gen_prompt, gen_mask = left_pad([rng.integers(5, vocab, 32), rng.integers(5, vocab, 20)], pad=3)
  models = {"jaxpe ALiBi": model, f"jaxpe emulated ({args.large_context})": emu}
  for ctx in args.extra_contexts:
    models[f"jaxpe emulated ({ctx})"] = bloom.to_emulated(model, context=ctx, max_phase=args.max_phase)
  res = compare_models(hf, models, tokens, mask, gen_prompt, gen_mask, args.gen_tokens, timings)
  plot(res["stats"], res["deltas"], out / "bloom560m.png", f"BLOOM-560M-sized ({source})")
  text = "\n\n".join(
    [
      f"### BLOOM-560M-sized model\n\n{source}; {n_params / 1e6:.1f} M parameters, float32. Inputs: "
      f"{args.large_tokens} random token ids (no tokenizer offline), one sequence. "
      + " ".join(conversion_note(m.cfg, args.large_tokens) for m in list(models.values())[1:]),
      logits_table(res["logits"]),
      f"Attention statistics (per head, mean over the {hf.config.n_layer} layers; variance of the weights over the "
      "visible keys):",
      attention_table(res["stats"]),
      generation_table(res["generation"], args.gen_tokens)
      + "\n\nPrompts: two rows of random ids (32 and 20 tokens, left-padded).",
      "Timings: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()),
      "![BLOOM-560M-sized](bloom560m.png)",
    ]
  )
  summary = {k: res[k] for k in ("logits", "generation")}
  summary["stats"] = {m: {k: v.tolist() for k, v in s.items()} for m, s in res["stats"].items()}
  summary["timings"] = timings
  return text, summary


def small_train_config(args) -> TrainConfig:
  return TrainConfig(
    model=ModelConfig(
      vocab_size=256,
      d_model=64,
      num_layers=2,
      num_heads=4,
      max_len=args.small_context,
      pos_encoding="alibi",
      use_bias=True,
      embed_layernorm=True,
      gelu_approximate=True,
      tie_embeddings=True,
    ),
    data=DataConfig(max_bytes=4_000_000),
    workdir=str(args.workdir),
    seed=args.seed,
    seq_len=args.small_context,
    batch_size=32,
    num_steps=args.train_steps,
    learning_rate=3e-3,
    warmup_steps=50,
    eval_every=10**6,
    eval_batches=4,
    checkpoint_every=10**6,
    mesh_shape=(1, 1),
    sample_len=0,
    max_seconds=args.train_seconds,
  )


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
  """Mean next-token cross-entropy in nats of ``logits [B, T, V]`` for ``targets [B, T]``."""
  lg = logits.astype(np.float64)
  lse = np.logaddexp.reduce(lg, axis=-1)
  return float((lse - np.take_along_axis(lg, targets[..., None], -1)[..., 0]).mean())


def run_small(args, out: Path) -> tuple[str, dict]:
  import torch
  import transformers

  cfg = small_train_config(args)
  timings: dict[str, float] = {}
  summary_path = Path(cfg.workdir) / "summary.json"
  if args.retrain or not summary_path.is_file():
    t0 = time.time()
    result = trainer.train(cfg, progress=False)
    timings["training (s)"] = time.time() - t0
    train_info = result.__dict__
  else:
    train_info = json.loads(summary_path.read_text())
  model = study.load_trained(cfg)
  hf_dir = bloom.save_hf(model, out / "small_hf", overwrite=True)
  hf = transformers.BloomForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  long_ctx = 4 * args.small_context
  emu = bloom.to_emulated(model, context=long_ctx, max_phase=args.max_phase)

  corpus = data.load_corpus(None, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction)
  windows = data.eval_batches(corpus.eval, batch_size=args.small_windows, seq_len=long_ctx, num_batches=1)[0]
  windows = windows.astype(np.int64)  # [W, 4T + 1]
  inputs, targets = windows[:, :-1], windows[:, 1:]
  mask = np.ones_like(inputs)

  ppl_rows = {}
  with torch.no_grad():
    native = {
      "4x": hf(torch.as_tensor(inputs)).logits.numpy(),
      "1x": np.concatenate(
        [
          hf(torch.as_tensor(inputs[:, s : s + args.small_context])).logits.numpy()
          for s in range(0, long_ctx, args.small_context)
        ],
        axis=1,
      ),
    }
  models = {"jaxpe ALiBi": model, "jaxpe emulated": emu}
  for name, m in (("native (transformers)", None), *models.items()):
    row = {}
    for ctx in ("1x", "4x"):
      if m is None:
        lg = native[ctx]
      elif ctx == "4x":
        lg = np.asarray(m(jnp.asarray(inputs)))
      else:
        chunks = [
          np.asarray(m(jnp.asarray(inputs[:, s : s + args.small_context])))
          for s in range(0, long_ctx, args.small_context)
        ]
        lg = np.concatenate(chunks, axis=1)
      row[ctx] = perplexity(lg, targets)
    ppl_rows[name] = row

  rng = np.random.default_rng(args.seed + 1)
  starts = rng.integers(0, corpus.eval.size - 64, 3)
  prompts = [corpus.eval[s : s + n].astype(np.int64) for s, n in zip(starts, (48, 32, 16))]
  gen_prompt, gen_mask = left_pad(prompts, pad=32)
  res = compare_models(hf, models, inputs, mask, gen_prompt, gen_mask, args.gen_tokens, timings)
  plot(res["stats"], res["deltas"], out / "small.png", "small byte-level ALiBi model trained with jaxpe")

  ppl_lines = [
    f"| held-out | bits/byte @ 1x ({args.small_context}) | ppl @ 1x | bits/byte @ 4x ({long_ctx}) | ppl @ 4x "
    "| delta nats/byte vs native @ 1x / 4x |",
    "|---|---|---|---|---|---|",
  ]
  ref_row = ppl_rows["native (transformers)"]
  for name, row in ppl_rows.items():
    ppl_lines.append(
      f"| {name} | {row['1x'] / math.log(2):.4f} | {math.exp(row['1x']):.4f} | "
      f"{row['4x'] / math.log(2):.4f} | {math.exp(row['4x']):.4f} | "
      f"{row['1x'] - ref_row['1x']:.2g} / {row['4x'] - ref_row['4x']:.2g} |"
    )
  mc = cfg.model
  text = "\n\n".join(
    [
      f"### Small ALiBi model trained with jaxpe\n\nByte-level (V 256), D {mc.d_model}, {mc.num_layers} layers, "
      f"{mc.num_heads} heads, BLOOM options on; trained with `jaxpe.trainer.train` on the Python standard "
      f"library sources, context {args.small_context}, batch {cfg.batch_size}, {train_info['step']} steps "
      f"({train_info['wall_seconds']:.0f} s; held-out {train_info['eval_bits_per_byte']:.3f} bits/byte at the end of "
      f"training, unigram {train_info['unigram_bits_per_byte']:.3f}). Exported with `jaxpe.bloom.save_hf` and "
      f"loaded with `BloomForCausalLM.from_pretrained` for the native reference. Comparisons use "
      f"{args.small_windows} held-out windows of {long_ctx} bytes (4x the training context). "
      + conversion_note(emu.cfg, long_ctx),
      "\n".join(ppl_lines),
      logits_table(res["logits"]),
      "Attention statistics (per head, mean over layers) on the same windows:",
      attention_table(res["stats"]),
      generation_table(res["generation"], args.gen_tokens)
      + "\n\nPrompts: three held-out snippets (48, 32 and 16 bytes, left-padded).",
      "Timings: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()),
      "![small model](small.png)",
    ]
  )
  summary = {k: res[k] for k in ("logits", "generation")}
  summary["perplexity_nats"] = ppl_rows
  summary["train"] = train_info
  summary["timings"] = timings
  return text, summary


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--part", choices=("both", "large", "small"), default="both")
  p.add_argument("--out", type=Path, default=Path("runs/bloom_experiment"))
  p.add_argument("--checkpoint", default=None, help="local HF BLOOM checkpoint directory (real weights)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max-phase", type=float, default=0.1, help="largest emulation phase over the context")
  p.add_argument("--large-tokens", type=int, default=512, help="tokens in the BLOOM-560M comparison")
  p.add_argument(
    "--large-layers", type=int, default=24, help="layers (24 = BLOOM-560M; fewer for a smoke run)"
  )
  p.add_argument("--large-context", type=int, default=2048, help="context the 560M emulation is tuned for")
  p.add_argument(
    "--extra-contexts",
    type=int,
    nargs="*",
    default=[65536],
    help="further emulation contexts for the 560M model (65536 = the published example)",
  )
  p.add_argument("--gen-tokens", type=int, default=128)
  p.add_argument("--workdir", type=Path, default=Path("runs/bloom_small"), help="small model's training dir")
  p.add_argument("--small-context", type=int, default=128, help="training context of the small model")
  p.add_argument("--small-windows", type=int, default=16)
  p.add_argument("--train-steps", type=int, default=3000)
  p.add_argument("--train-seconds", type=float, default=150.0)
  p.add_argument("--retrain", action="store_true", help="train again even if the workdir holds a run")
  args = p.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  sections, summary = ["## BLOOM experiment: native ALiBi vs jaxpe ALiBi vs jaxpe emulated ALiBi"], {}
  start = time.time()
  if args.part in ("both", "small"):
    text, summary["small"] = run_small(args, args.out)
    sections.append(text)
    print(text, flush=True)
  if args.part in ("both", "large"):
    text, summary["large"] = run_large(args, args.out)
    sections.append(text)
    print(text, flush=True)
  sections.append(f"Total wall time {time.time() - start:.0f} s on {jax.devices()[0].platform}.")
  (args.out / "results.md").write_text("\n\n".join(sections) + "\n")
  (args.out / "results.json").write_text(json.dumps(summary, indent=2, default=float))
  print(f"wrote {args.out / 'results.md'}")


if __name__ == "__main__":
  main()
