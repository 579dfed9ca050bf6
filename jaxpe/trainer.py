"""The training loop: config -> data -> sharded model and optimizer -> steps -> eval ->
checkpoints -> loss curve and sample. One readable path; ``train/train.py`` only parses arguments.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jaxpe import checkpoint, data, sharding
from jaxpe.config import TrainConfig
from jaxpe.generate import generate
from jaxpe.model import Decoder


@dataclass
class TrainResult:
  """What a run reports at the end (also written to ``<workdir>/summary.json``)."""

  step: int
  train_loss: float
  eval_bits_per_byte: float
  unigram_bits_per_byte: float
  tokens_per_second: float
  wall_seconds: float
  sample: str


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup, cosine decay to ``min_lr_ratio * lr``, global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=cfg.warmup_steps,
    decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1),  # includes the warmup
    end_value=cfg.learning_rate * cfg.min_lr_ratio,
  )
  return optax.chain(
    optax.clip_by_global_norm(cfg.grad_clip),
    optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
  )


def next_token_loss(model: Decoder, batch: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) of ``batch [B, T + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
  logits = model(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def create_state(cfg: TrainConfig, mesh: jax.sharding.Mesh):
  """Builds model and optimizer directly into their shardings; returns ``(graphdef, state, shardings)``."""
  tx = make_optimizer(cfg)

  def make():
    model = Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  model, optimizer = sharding.create_sharded(make, mesh)
  graphdef, state = nnx.split((model, optimizer))
  return graphdef, state, sharding.state_shardings(state, mesh)


def train(cfg: TrainConfig, *, progress: bool = True) -> TrainResult:
  """Trains (or resumes) the run described by ``cfg`` in ``cfg.workdir``.

  Raises:
    ValueError, FileNotFoundError: bad data path or sizes that do not fit the mesh.
  """
  start = time.time()
  workdir = Path(cfg.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(cfg.model_dump_json(indent=2))

  corpus = data.load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction)
  eval_set = data.eval_batches(
    corpus.eval, batch_size=cfg.batch_size, seq_len=cfg.seq_len, num_batches=cfg.eval_batches
  )
  unigram = data.unigram_bits_per_byte(np.concatenate([b[:, 1:].ravel() for b in eval_set]))

  mesh = sharding.make_mesh(cfg.mesh_shape)
  sharding.check_divisible(cfg.model, mesh, cfg.batch_size)
  batch_sharding = sharding.batch_sharding(mesh)
  graphdef, state, state_shardings = create_state(cfg, mesh)

  mngr = checkpoint.manager(workdir / "checkpoints", max_to_keep=cfg.keep_checkpoints)
  step = 0
  restored = checkpoint.restore_latest(mngr, checkpoint.abstract_with_shardings(state, state_shardings))
  if restored is not None:
    state, meta = restored
    step = int(meta["data_position"])
    print(f"resumed from {workdir / 'checkpoints'} at step {step}")

  @functools.partial(
    jax.jit,
    in_shardings=(state_shardings, batch_sharding),
    out_shardings=(state_shardings, None),
    donate_argnums=0,
  )
  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(next_token_loss)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  @functools.partial(jax.jit, in_shardings=(state_shardings, batch_sharding))
  def eval_step(state, batch):
    model, _ = nnx.merge(graphdef, state)
    return next_token_loss(model, batch)

  def evaluate(state) -> float:
    losses = [eval_step(state, jax.device_put(b, batch_sharding)) for b in eval_set]
    return data.bits_per_byte(float(np.mean(jax.device_get(losses))))

  def save(state, step):
    checkpoint.save(mngr, step, state, {"step": step, "data_position": step})

  metrics_path = workdir / "metrics.jsonl"
  tokens_per_step = cfg.batch_size * cfg.seq_len
  loss, eval_bpb, timed_tokens, timed_seconds = float("nan"), float("nan"), 0, 0.0
  bar = tqdm(total=cfg.num_steps, initial=step, disable=not progress, unit="step", dynamic_ncols=True)
  with metrics_path.open("a") as metrics_file:
    while step < cfg.num_steps:
      batch = data.train_batch(
        corpus.train, step=step, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=cfg.seq_len
      )
      t0 = time.time()
      state, out = train_step(state, jax.device_put(batch, batch_sharding))
      loss = float(out["loss"])  # waits for the step
      dt = time.time() - t0
      step += 1
      if step > 1 or restored is not None:  # the first step of a process includes compilation
        timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + dt
      tok_s = timed_tokens / timed_seconds if timed_seconds else 0.0
      record = {"step": step, "loss": loss, "grad_norm": float(out["grad_norm"]), "tokens_per_second": tok_s}
      out_of_time = cfg.max_seconds is not None and time.time() - start > cfg.max_seconds
      stopping = out_of_time or step == cfg.stop_at
      last = step == cfg.num_steps or stopping
      if step % cfg.eval_every == 0 or last:
        eval_bpb = evaluate(state)
        record["eval_bits_per_byte"] = eval_bpb
        bar.write(f"step {step}: held-out {eval_bpb:.3f} bits/byte (unigram {unigram:.3f})")
      metrics_file.write(json.dumps(record) + "\n")
      metrics_file.flush()
      bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
      bar.update(1)
      if step % cfg.checkpoint_every == 0 or last:
        save(state, step)
      if stopping:
        bar.write(f"stopping at step {step} of {cfg.num_steps}; rerun with the same workdir to resume")
        break
  bar.close()
  mngr.close()

  model, _ = nnx.merge(graphdef, state)
  sample = sample_text(model, cfg.sample_prompt, cfg.sample_len, seed=cfg.seed) if cfg.sample_len else ""
  plot_loss_curve(metrics_path, workdir / "loss.png", unigram)
  result = TrainResult(
    step=step,
    train_loss=loss,
    eval_bits_per_byte=eval_bpb if not math.isnan(eval_bpb) else evaluate(state),
    unigram_bits_per_byte=unigram,
    tokens_per_second=timed_tokens / timed_seconds if timed_seconds else 0.0,
    wall_seconds=time.time() - start,
    sample=sample,
  )
  (workdir / "summary.json").write_text(json.dumps(result.__dict__, indent=2))
  return result


def sample_text(model: Decoder, prompt: str, length: int, *, seed: int, temperature: float = 0.8) -> str:
  """Generates ``length`` bytes after ``prompt`` (sampled at ``temperature``, top-k 40)."""
  tokens = jnp.asarray([list(prompt.encode())], jnp.int32)
  out = generate(
    model, tokens, max_new_tokens=length, temperature=temperature, top_k=40, rng=jax.random.key(seed)
  )
  return prompt + bytes(np.asarray(out[0], np.uint8)).decode("utf-8", errors="replace")


def plot_loss_curve(metrics_path: Path, out_path: Path, unigram: float) -> None:
  """Training loss and held-out bits/byte against step, with the unigram entropy for reference."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
  steps = [r["step"] for r in records]
  train_bpb = [data.bits_per_byte(r["loss"]) for r in records]
  evals = [(r["step"], r["eval_bits_per_byte"]) for r in records if "eval_bits_per_byte" in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, train_bpb, lw=0.8, label="train")
  if evals:
    ax.plot(*zip(*evals), "o-", label="held-out")
  ax.axhline(unigram, ls="--", c="gray", label=f"unigram entropy {unigram:.2f}")
  ax.set_xlabel("step")
  ax.set_ylabel("bits per byte")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)
