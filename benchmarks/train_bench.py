"""jaxpe's train step against PyTorch and against the matmul ceiling, with where its time goes.

  python benchmarks/train_bench.py [--small] [--no-compile] [--no-parts]

For each size (issue 21: D 512 / L 8 / N 8 / B 8 x T 512, and D 128 / L 4 / N 8 / B 32 x T 256 near
the default run; ``--small``: B 2 x T 256 and B 8 x T 256), in one process, timed alternately
(``ceilings.alternate``, medians):
  * jaxpe's trainer step (``jaxpe.train.state.create_state`` + ``jaxpe.train.steps.make_train_step``
    on a one-device mesh, state donated and fed back, as ``jaxpe.train.loop`` runs it);
  * the same model and AdamW step in PyTorch (``benchmarks/torch_reference.py``), eager, with
    ``torch.set_num_threads`` = the cores jax uses; and under ``torch.compile`` where it compiles
    (else the reason is printed); the ratio jaxpe time / torch time (goal <= 0.8);
  * the float32 matmul ceiling at the step's own matmul shapes (``ceilings.decoder_matmuls``, each
    shape and operand layout alone, best round): the ratio of jaxpe's achieved model FLOP/s to it
    (goal >= 0.65 at D 512); torch's in the record too;
  * the step's parts (``step_breakdown``), each jitted alone on the step's shapes, as fractions of
    the step: forward, forward + backward, the optimizer update, attention block, attention core,
    MLP, LayerNorms, embedding + logits + loss.
Also the ``growth`` group: step time per token as T and D grow. Rows are those of the ``train`` and
``growth`` groups of ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ceilings import (
  alternate,
  best_by_shape,
  blocking,
  ceiling_seconds,
  decoder_matmuls,
  matmul_fns,
  median,
  useful_flops,
)
from flax import nnx
from ops_bench import Row, row

from jaxpe.attention import kernels, masks
from jaxpe.model.config import ModelConfig
from jaxpe.train import host_devices, sharding, steps
from jaxpe.train import state as state_lib
from jaxpe.train.config import TrainConfig

SIZES = (
  ("D 512, L 8, N 8", ModelConfig(d_model=512, num_layers=8, num_heads=8, max_len=512), (8, 512), (2, 256)),
  ("D 128, L 4, N 8", ModelConfig(d_model=128, num_layers=4, num_heads=8, max_len=256), (32, 256), (8, 256)),
)
"""(label, model, (B, T), (B, T) with --small)."""


def cores() -> int:
  """CPU cores this process may run on (XLA's thread pool uses them all)."""
  return host_devices.cores()


def split_cores() -> None:
  """One CPU device per core for this process, as ``jaxpe-train`` has (``TrainConfig.cpu_devices``),
  unless JAX's backend started or ``XLA_FLAGS`` chose; one-device rows use the first device."""
  host_devices.apply(TrainConfig(batch_size=cores()))


split_cores()


@dataclasses.dataclass
class TrainerStep:
  """jaxpe's trainer step on fixed tokens: ``run()`` takes one step (feeding the donated state back)
  and waits for it; ``step`` is the jitted step and ``args()`` its current ``(state, tokens)``;
  ``initial`` a copy of the initial state (``(model, optimizer)`` split by ``graphdef``) that ``run``
  does not donate."""

  run: Any
  train_config: TrainConfig
  graphdef: Any
  initial: Any
  step: Any
  args: Any


def trainer_step(cfg: ModelConfig, *, batch: int, seq: int, devices: int = 1) -> TrainerStep:
  """jaxpe's trainer step as ``jaxpe.train.loop`` builds it (``state.create_state``,
  ``steps.make_train_step`` with the state and batch shardings) on a mesh of the first ``devices``
  devices, all on the ``data`` axis, on random ``[batch, seq + 1]`` int32 tokens."""
  tcfg = TrainConfig(model=cfg, batch_size=batch, seq_len=seq, mesh_shape=(devices, 1, 1))
  mesh = sharding.make_mesh(tcfg.mesh_shape, devices=jax.devices()[:devices])
  graphdef, state, shardings = state_lib.create_state(tcfg, mesh)
  batch_sharding = sharding.batch_sharding(mesh, tcfg.logical_rules)
  step = steps.make_train_step(
    graphdef,
    mesh=mesh,
    rules=tcfg.logical_rules,
    state_shardings=shardings,
    batch_sharding=batch_sharding,
    grad_accum_steps=tcfg.grad_accum_steps,
  )
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
  tokens = jax.device_put(tokens, batch_sharding)
  holder = [state]
  initial = jax.tree.map(jnp.copy, state)

  def run():
    holder[0], metrics = step(holder[0], tokens)
    jax.block_until_ready((holder[0], metrics))

  return TrainerStep(run, tcfg, graphdef, initial, step, lambda: (holder[0], tokens))


def torch_steps(cfg: ModelConfig, tcfg: TrainConfig, *, compile_model: bool) -> tuple[dict, dict[str, str]]:
  """``({"torch eager": run, "torch.compile": run}, {name: reason not measured})`` for the PyTorch
  reference of ``cfg`` on ``tcfg``'s batch shape (each run one optimizer step); empty runs and a
  reason without torch. torch.compile is compiled here (two warm-up steps); a failure is caught."""
  try:
    import torch
    import torch_reference
  except ImportError as err:
    return {}, {"torch": f"torch is not installed ({err})"}
  torch.set_num_threads(cores())
  gen = torch.Generator().manual_seed(0)
  tokens = torch.randint(0, cfg.vocab_size, (tcfg.batch_size, tcfg.seq_len + 1), generator=gen)
  runs, skipped = {}, {}
  eager = torch_reference.make_train_step(torch_reference.TorchDecoder.from_config(cfg), tcfg)
  runs["torch eager"] = lambda: eager(tokens)
  if compile_model:
    try:
      compiled = torch_reference.make_train_step(
        torch_reference.TorchDecoder.from_config(cfg), tcfg, compile_model=True
      )
      compiled(tokens)
      compiled(tokens)
      runs["torch.compile"] = lambda: compiled(tokens)
    except Exception as err:  # noqa: BLE001  report any compiler failure and go on
      skipped["torch.compile"] = f"did not compile: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
  else:
    skipped["torch.compile"] = "not measured (--quick / --no-compile)"
  return runs, skipped


def compare_rows(label: str, cfg: ModelConfig, *, batch: int, seq: int, rounds: int, compile_model: bool):
  """The rows of one size: jaxpe vs torch eager (and torch.compile), and vs the matmul ceiling."""
  trainer = trainer_step(cfg, batch=batch, seq=seq)
  tcfg = trainer.train_config
  # what jaxpe-train runs on this host (cpu_devices=auto): one device per core on the data axis
  split = host_devices.auto_count(tcfg.model_copy(update={"mesh_shape": (-1, 1, 1, 1)}), len(jax.devices()))
  jax_runs = {"jaxpe": trainer.run}
  # the goal rows time the cpu_devices=auto split where there is one
  main_run = label_main = "jaxpe"
  if split > 1 and jax.devices()[0].platform == "cpu":
    main_run, label_main = f"jaxpe, {split} CPU devices", f"jaxpe ({split} CPU devices)"
    jax_runs[main_run] = trainer_step(cfg, batch=batch, seq=seq, devices=split).run
  torch_runs, skipped = torch_steps(cfg, tcfg, compile_model=compile_model)
  matmuls = decoder_matmuls(cfg, batch, seq)
  mm_fns = matmul_fns(matmuls)
  times = alternate({**jax_runs, **torch_runs, **mm_fns}, rounds=rounds)
  t_jax = median(times[main_run])
  t_one = median(times["jaxpe"])
  flops = useful_flops(matmuls)
  t_ceil = ceiling_seconds(matmuls, best_by_shape(times))
  name = f"train step {label}, B {batch} x T {seq}"
  rows = []
  extra = {
    f"{k.replace(' ', '_').replace('.', '_')}_ms": median(v) * 1e3
    for k, v in times.items()
    if isinstance(k, str)
  }
  for reference, t_ref in ((k, median(times[k])) for k in torch_runs):
    rows.append(
      row(
        "train",
        f"{name}: {label_main} / {reference} (time)",
        t_jax * 1e3,
        "ms",
        ratio=t_jax / t_ref,
        vs=f"{reference} {t_ref * 1e3:.0f} ms",
        goal="<= 0.8" if reference == "torch eager" else "<= 1.1",  # issue 36 (eager: its stretch)
        torch_ceiling_ratio=t_ceil / t_ref,
        one_device_ratio=t_one / t_ref,
      )
    )
  if main_run != "jaxpe":
    rows.append(
      row(
        "train",
        f"{name}: {label_main} / jaxpe on one device (time)",
        t_jax * 1e3,
        "ms",
        ratio=t_jax / t_one,
        vs=f"one device {t_one * 1e3:.0f} ms",
      )
    )
  for reference, reason in skipped.items():
    print(f"{name}: {reference} {reason}", file=sys.stderr)
    rows.append(
      row(
        "train", f"{name}: {label_main} / {reference} (time)", t_jax * 1e3, "ms", vs=f"{reference} {reason}"
      )
    )
  rows.append(
    row(
      "train",
      f"{name}: {label_main} model FLOP/s / matmul ceiling at its shapes",
      flops / t_jax / 1e9,
      "GFLOP/s",
      ratio=t_ceil / t_jax,
      vs=f"ceiling {flops / t_ceil / 1e9:.0f} GFLOP/s",
      goal=">= 0.65" if cfg.d_model == 512 else None,
      **extra,
    )
  )
  return rows


def step_breakdown(model_cfg: ModelConfig, *, batch: int, seq: int, rounds: int = 3) -> dict[str, float]:
  """Median seconds of the parts of a train step, each jitted alone on the step's shapes, forward +
  backward (gradients of the parameters and the input) where it says so, timed alternately with the
  whole ``step`` (jaxpe's trainer step):

  ``forward`` (the loss), ``forward_backward`` (``value_and_grad``), ``update`` (the optimizer
  update from given gradients, with the step's gradient norm and parameter norm); the model's own
  modules, L times on the same ``[B, T, D]`` input: ``attention_block`` (q/k/v/o projections, RoPE,
  attention), ``attention_core`` (the softmax attention alone on ``[B, T, N, H]``, as
  ``jaxpe.attention.kernels.attention`` runs it in the model), ``mlp`` (up, GELU, down),
  ``layernorm`` (the 2 L + 1 LayerNorms); ``embed_logits_loss`` (token embedding, tied logits,
  cross-entropy).
  """
  cfg = model_cfg
  trainer = trainer_step(cfg, batch=batch, seq=seq)
  run, graphdef, state = trainer.run, trainer.graphdef, trainer.initial
  model, _ = nnx.merge(graphdef, state)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)), jnp.int32)

  def forward(state, tokens):
    model, _ = nnx.merge(graphdef, state)
    return steps.next_token_loss(model, tokens)

  def forward_backward(state, tokens):
    model, _ = nnx.merge(graphdef, state)
    return nnx.value_and_grad(steps.next_token_loss)(model, tokens)

  grads = jax.jit(forward_backward)(state, tokens)[1]

  def update(state, grads):
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, grads)
    return nnx.state((model, opt)), optax.tree.norm(grads), optax.tree.norm(nnx.state(model, nnx.Param))

  n, h = cfg.num_heads, cfg.head_size
  q = jax.random.normal(jax.random.key(0), (batch, seq, n, h), jnp.float32)
  mask = masks.AttentionMask(causal=True)

  def attention_core(q):
    def one(q):
      return kernels.attention(
        q, q, q, scale=h**-0.5, mask=mask, implementation=cfg.attn_implementation
      ).sum()

    return [jax.grad(one)(q + i) for i in range(cfg.num_layers)]

  x = jax.random.normal(jax.random.key(1), (batch, seq, cfg.d_model), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  blocks = list(model.blocks)

  def per_layer(modules, apply):
    """Gradients (parameters and input) of ``sum(apply(module, x))`` for each module."""
    mod_def, mod_state = nnx.split(modules)

    def grad(mod_state, x):
      def loss(mod_state, x):
        return sum(apply(m, x + i).sum() for i, m in enumerate(nnx.merge(mod_def, mod_state)))

      return jax.grad(loss, argnums=(0, 1))(mod_state, x)

    return blocking(grad, mod_state, x)

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

  parts = {
    "step": run,
    "forward": blocking(forward, state, tokens),
    "forward_backward": blocking(forward_backward, state, tokens),
    "update": blocking(update, state, grads),
    "attention_block": per_layer([b.attn for b in blocks], attention_block),
    "attention_core": blocking(attention_core, q),
    "mlp": per_layer([b.mlp for b in blocks], lambda m, x: m(x)),
    "layernorm": per_layer(norms, lambda m, x: m(x)),
    "embed_logits_loss": blocking(embed_logits_loss, embed_state, x, tokens),
  }
  return {k: median(v) for k, v in alternate(parts, rounds=rounds).items()}


def parts_rows(label: str, cfg: ModelConfig, *, batch: int, seq: int) -> list[Row]:
  parts = step_breakdown(cfg, batch=batch, seq=seq)
  step = parts.pop("step")
  return [
    row(
      "train",
      f"{label} step part: {part.replace('_', ' ').replace('forward backward', 'forward + backward')}",
      secs * 1e3,
      "ms",
      ratio=secs / step,
      vs=f"whole step {step * 1e3:.0f} ms (time)",
    )
    for part, secs in parts.items()
  ]


def train_rows(*, small: bool, compile_model: bool = True, parts: bool = True) -> list[Row]:
  """Both sizes against PyTorch and the matmul ceiling (``--quick``: smaller batches, 3 rounds, no
  torch.compile), then the step parts (``--quick``: D 512 only)."""
  rows = []
  for label, cfg, full, quick in SIZES:
    batch, seq = quick if small else full
    rows += compare_rows(
      label, cfg, batch=batch, seq=seq, rounds=3 if small else 5, compile_model=compile_model and not small
    )
  if parts:
    for label, cfg, full, quick in SIZES[:1] if small else SIZES:
      batch, seq = quick if small else full
      rows += parts_rows(label.split(",")[0], cfg, batch=batch, seq=seq)
  return rows


def growth_rows(*, small: bool) -> list[Row]:
  """Train-step time per token as T grows (D 128) and as D grows (T 256), relative to the first."""
  lengths = (128, 256) if small else (128, 256, 512, 1024)
  widths = (64, 128) if small else (64, 128, 256, 512)
  batch = 4 if small else 8
  rows = []
  cases = [(f"D 128, T {t}", f"T {lengths[0]}", ModelConfig(max_len=t), t) for t in lengths]
  cases += [
    (f"T 256, D {d}", f"D {widths[0]}", ModelConfig(d_model=d, num_heads=max(1, d // 32)), 256)
    for d in widths
  ]
  first: dict[str, float] = {}
  for name, base, cfg, seq in cases:
    run = trainer_step(cfg, batch=batch, seq=seq).run
    per_token = median(alternate({"step": run}, rounds=3)["step"]) / (batch * seq)
    first.setdefault(base, per_token)
    rows.append(
      row(
        "growth",
        f"step time per token, {name}",
        per_token * 1e6,
        "us/token",
        ratio=per_token / first[base],
        vs=base,
      )
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--small", action="store_true", help="smaller batches (quick check)")
  parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  parser.add_argument("--no-parts", action="store_true", help="skip the step parts")
  args = parser.parse_args()
  print(f"devices: {jax.devices()}, {cores()} cores")
  for r in train_rows(small=args.small, compile_model=not args.no_compile, parts=not args.no_parts):
    ratio = f"  {r['ratio']:.2f} vs {r['vs']}" if r.get("ratio") is not None else f"  ({r.get('vs', '')})"
    print(f"{r['name']}: {r['value']:.4g} {r['unit']}{ratio}", flush=True)


if __name__ == "__main__":
  main()
