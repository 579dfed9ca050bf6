"""Generation speed a user feels: greedy decoding with the KV cache against what they would use instead
(issue 36), measured in the same run, alternating.

  python benchmarks/generate_bench.py [--quick]

Rows (also the ``generate`` group of ``benchmarks/run.py``):
  * BLOOM-560M-shaped (built from a config, random weights, nothing downloaded), float32, greedy at
    1 x 32 prompt + 128 new tokens and 8 x 128 + 128: ``jaxpe.model.generate`` (compiled first) vs
    transformers' ``generate`` on the same weights (``jaxpe.bloom.from_hf``), the tokens compared;
    tokens/s (B x new tokens over the whole call), time to the first token (a call with one new
    token: prefill and the first pick) and the peak resident memory the call adds over what the
    process holds before it (Linux ``VmHWM`` after resetting it; weights and allocator caches not
    counted);
  * the default decoder (``ModelConfig()``: rope, D 128, L 4, V 256) against nanoGPT's ``generate``
    of the same model in PyTorch (``torch_reference.TorchDecoder.generate``: no KV cache, each token
    recomputes the window), the same weights (``load_jaxpe_params``), 8 x 64 + 128.
``--jaxpe-only`` times jaxpe alone (two checkouts compared by ``PYTHONPATH``). ``--quick``: BLOOM with 2 layers and a 32,768-token vocabulary at 1 x 8 + 16 and 4 x 16 + 16, the
decoder at 2 x 16 + 16: the code path in a few seconds, not the figures.
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from bloom_bench import BLOOM_560M, _reset_peak, _rss_kib
from ceilings import median
from ops_bench import Row, row


def _timed_with_peak(fn) -> tuple[object, float, float | None]:
  """``(fn(), its wall seconds, MiB of resident memory the call added at its peak)``; the memory
  None where the peak cannot be reset (Linux ``/proc/self/clear_refs``)."""
  gc.collect()
  reset = _reset_peak()
  rss0 = _rss_kib("VmRSS")
  t0 = time.perf_counter()
  out = fn()
  seconds = time.perf_counter() - t0
  return out, seconds, (_rss_kib("VmHWM") - rss0) / 1024 if reset else None


def _agreement(a: np.ndarray, b: np.ndarray) -> str:
  """How far two ``[B, n]`` token arrays agree: all equal, or the rows equal and the shortest
  common prefix."""
  if a.shape == b.shape and np.array_equal(a, b):
    return "tokens equal"
  same = [int(np.argmax(np.append(x != y, True))) for x, y in zip(a, b)]
  return (
    f"tokens differ: {sum(s == a.shape[1] for s in same)}/{len(same)} rows equal, first diff at {min(same)}"
  )


def _rows(label, batch, t_len, new, ref_name, times, mem, out_j, out_r) -> list[Row]:
  t_j, f_j = median(times["jaxpe"]), median(times["jaxpe first"])
  tag = f"{label} greedy {batch} x {t_len} + {new}"
  if "ref" not in times:  # --jaxpe-only
    return [
      row("generate", f"{tag}, tokens/s", batch * new / t_j, "tokens/s"),
      row("generate", f"{tag}, time to first token", f_j, "s"),
    ]
  t_r, f_r = median(times["ref"]), median(times["ref first"])
  rows = [
    row(
      "generate",
      f"{tag}, tokens/s",
      batch * new / t_j,
      "tokens/s",
      ratio=t_r / t_j,
      vs=f"{ref_name} {batch * new / t_r:.1f} tokens/s (x faster; {_agreement(out_j, out_r)})",
      goal=">= 1.5",
    ),
    row(
      "generate",
      f"{tag}, time to first token",
      f_j,
      "s",
      ratio=f_j / f_r,
      vs=f"{ref_name} {f_r:.3f} s (time)",
    ),
  ]
  if mem.get("jaxpe") is not None:
    rows.append(
      row(
        "generate",
        f"{tag}, peak extra memory of the call",
        mem["jaxpe"],
        "MiB",
        ratio=mem["jaxpe"] / max(mem["ref"], 1e-3),
        vs=f"{ref_name} {mem['ref']:.1f} MiB",
      )
    )
  return rows


def _measure(jx_gen, ref_gen, *, rounds: int, reference: bool = True):
  """``(times, peak memory, jaxpe's tokens, the reference's tokens)``: the full call and the
  one-token call of each, alternating, after compiling jaxpe's (the reference's full call runs only
  in the timed rounds: it is the slow one); memory and tokens from the first timed round."""
  jx_gen(None), jx_gen(1)
  if reference:
    ref_gen(1)
  fns = {"jaxpe": lambda: jx_gen(None), "jaxpe first": lambda: jx_gen(1)}
  if reference:
    fns.update({"ref": lambda: ref_gen(None), "ref first": lambda: ref_gen(1)})
  times = {name: [] for name in fns}
  mem, outs = {}, {}
  for r in range(rounds):
    for name, fn in fns.items():
      out, seconds, peak = _timed_with_peak(fn)
      times[name].append(seconds)
      if r == 0:
        mem[name], outs[name] = peak, np.asarray(out)
  return times, mem, outs.get("jaxpe"), outs.get("ref")


def bloom_generate_rows(*, quick: bool, reference: bool = True) -> list[Row]:
  import torch
  import transformers

  from jaxpe import bloom
  from jaxpe.model.generate import generate

  config = dict(BLOOM_560M, **({"n_layer": 2, "vocab_size": 32768} if quick else {}))
  label = "BLOOM-560M" if not quick else "BLOOM-560M shape (2 layers, V 32768)"
  torch.manual_seed(0)
  hf = transformers.BloomForCausalLM(transformers.BloomConfig(**config)).eval()
  model = bloom.from_hf(hf)
  shapes = [(1, 8, 16), (4, 16, 16)] if quick else [(1, 32, 128), (8, 128, 128)]
  rows: list[Row] = []
  for batch, t_len, new in shapes:
    prompt = np.random.default_rng(batch).integers(5, config["vocab_size"], (batch, t_len))
    pj, pt = jnp.asarray(prompt, jnp.int32), torch.as_tensor(prompt)

    def jx_gen(n, pj=pj, new=new):
      return jax.block_until_ready(generate(model, pj, max_new_tokens=n or new))

    def hf_gen(n, pt=pt, new=new):
      n = n or new
      kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
      with torch.no_grad():
        return hf.generate(pt, attention_mask=torch.ones_like(pt), **kw)[:, pt.shape[1] :].numpy()

    times, mem, out_j, out_r = _measure(jx_gen, hf_gen, rounds=2 if quick else 1, reference=reference)
    rows += _rows(label, batch, t_len, new, "transformers generate", times, mem, out_j, out_r)
  return rows


def decoder_generate_rows(*, quick: bool, reference: bool = True) -> list[Row]:
  import torch
  import torch_reference
  from flax import nnx

  from jaxpe.model.config import ModelConfig
  from jaxpe.model.decoder import Decoder
  from jaxpe.model.generate import generate

  cfg = ModelConfig()  # the default decoder: rope, D 128, L 4, N 4, V 256, max_len 256
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  ref = torch_reference.TorchDecoder.from_config(cfg).eval()
  torch_reference.load_jaxpe_params(ref, model)
  batch, t_len, new = (2, 16, 16) if quick else (8, 64, 128)
  prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, t_len))
  pj, pt = jnp.asarray(prompt, jnp.int32), torch.as_tensor(prompt)

  def jx_gen(n):
    return jax.block_until_ready(generate(model, pj, max_new_tokens=n or new))

  def torch_gen(n):
    return ref.generate(pt, n or new).numpy()

  times, mem, out_j, out_r = _measure(jx_gen, torch_gen, rounds=3, reference=reference)
  label = "default decoder (rope, D 128, L 4)"
  return _rows(label, batch, t_len, new, "nanoGPT torch generate", times, mem, out_j, out_r)


def generate_rows(*, quick: bool, reference: bool = True) -> list[Row]:
  return decoder_generate_rows(quick=quick, reference=reference) + bloom_generate_rows(
    quick=quick, reference=reference
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--only", choices=("bloom", "decoder"), default=None)
  parser.add_argument(
    "--jaxpe-only",
    action="store_true",
    help="time jaxpe alone (to compare two jaxpe checkouts by PYTHONPATH)",
  )
  args = parser.parse_args()
  kw = dict(quick=args.quick, reference=not args.jaxpe_only)
  if args.only == "bloom":
    rows = bloom_generate_rows(**kw)
  elif args.only == "decoder":
    rows = decoder_generate_rows(**kw)
  else:
    rows = generate_rows(**kw)
  for r in rows:
    ratio = f"  {r['ratio']:.2f} vs {r['vs']}" if "ratio" in r else ""
    print(f"{r['name']}: {r['value']:.4g} {r['unit']}{ratio}", flush=True)


if __name__ == "__main__":
  main()
