"""Retrieval: a synthetic passkey task on the study's byte-level models (Mohtashami & Jaggi,
"Landmark Attention", arXiv 2305.16300, the passkey format, shortened to fit 64-byte contexts), the short format training every
encoding gets, and the emulation check on retrieval.

A sample of eval length L is ``L + 1`` bytes: held-out text with ``PLANT`` (a key of ``KEY_DIGITS``
random digits) inserted at depth d (the plant starts at ``round(d * n)`` bytes into the n filler
bytes), then ``PROMPT`` and the key as the last ``KEY_DIGITS`` bytes. The model reads the first L
bytes (one forward pass, teacher-forced) and is scored on the key's bytes: the key log-probability in
bits (sum over its digits of log2 p(digit | everything before)) and exact match of greedy decoding,
which equals "every key digit is the argmax given the digits before it" (greedy decoding follows the
teacher-forced path until its first wrong digit), so one pass decides it.

Byte-level models trained on code never saw the template: before retrieval, each trained model is
fine-tuned for ``passkey_steps`` AdamW steps at the training length on batches of which a
``passkey_fraction`` of the rows are passkey samples (random depth in [0, 1], random key, training
text as filler) and the rest ordinary training windows, loss on every byte; the same steps, batches,
learning rate and seed for every encoding.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpe.model import Decoder
from jaxpe.model.build import build_model, model_params
from jaxpe.model.config import ModelConfig
from jaxpe.study.evaluation import token_nll, token_scores
from jaxpe.study.passkey import KEY_DIGITS, PLANT, PROMPT, _template_len, plant_offset

__all__ = [
  "KEY_DIGITS",
  "PLANT",
  "PROMPT",
  "evaluate_passkey",
  "finetune_batch",
  "finetune_passkey",
  "passkey_batch",
  "passkey_scores",
  "plant_offset",
  "random_keys",
  "retrieval_emulation",
]


def random_keys(n: int, seed: int) -> list[str]:
  """``n`` keys of ``KEY_DIGITS`` decimal digits from ``numpy.random.default_rng(seed)``."""
  digits = np.random.default_rng(seed).integers(0, 10, size=(n, KEY_DIGITS))
  return ["".join(map(str, row)) for row in digits]


def passkey_batch(filler: np.ndarray, length: int, depth: float, keys: list[str]) -> np.ndarray:
  """``[B, length + 1]`` int32 passkey samples.

  Args:
    filler: ``[B, >= length + 1]`` byte values (the text around the plant; row b for sample b).
    length: L, the eval length (the model's input is the first L bytes).
    depth: where the plant starts, as a fraction of the filler bytes (``plant_offset``).
    keys: B strings of ``KEY_DIGITS`` ASCII digits ``0-9``.

  Raises:
    ValueError: keys not B strings of ``KEY_DIGITS`` digits, filler rows shorter than ``length + 1``,
      or ``plant_offset``'s errors.
  """
  filler = np.asarray(filler)
  start = plant_offset(length, depth)
  if filler.ndim != 2 or filler.shape[1] < length + 1:
    raise ValueError(f"filler must be [B, >= {length + 1}] (length + 1), got shape {filler.shape}")
  digits = lambda k: isinstance(k, str) and len(k) == KEY_DIGITS and all("0" <= c <= "9" for c in k)  # noqa: E731
  if len(keys) != filler.shape[0] or not all(digits(k) for k in keys):  # ASCII (isdigit takes Arabic-Indic)
    raise ValueError(f"keys must be {filler.shape[0]} strings of {KEY_DIGITS} digits, got {keys!r}")
  n = length + 1 - _template_len()
  rows = []
  for row, key in zip(filler, keys):
    text = np.asarray(row[:n], np.int32)
    plant = np.frombuffer(PLANT.format(key=key).encode(), np.uint8)
    tail = np.frombuffer((PROMPT + key).encode(), np.uint8)
    rows.append(np.concatenate([text[:start], plant, text[start:], tail]).astype(np.int32))
  return np.stack(rows)


def passkey_scores(logits: jax.Array, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Key log-probability (bits) ``[B]`` float32 and greedy exact match ``[B]`` bool of ``logits
  [B, L, V]`` (the model on ``batch[:, :-1]``) for passkey samples ``batch [B, L + 1]`` int32 whose
  last ``KEY_DIGITS`` bytes are the key."""
  logits = logits[:, -KEY_DIGITS:].astype(jnp.float32)
  key = batch[:, -KEY_DIGITS:]
  logp = jax.nn.log_softmax(logits, axis=-1)
  bits = jnp.take_along_axis(logp, key[..., None], axis=-1)[..., 0].sum(-1) / math.log(2)
  exact = (jnp.argmax(logits, axis=-1) == key).all(-1)
  return bits, exact


def evaluate_passkey(
  model: Decoder, filler: np.ndarray, length: int, depths: tuple[float, ...], keys: list[str], batch_size: int
) -> dict[str, Any]:
  """Passkey scores of ``model`` at eval length ``length``, one sample per filler row and depth.

  Returns:
    ``{"accuracy", "key_bits", "by_depth": {str(depth): {"accuracy", "key_bits", "per_sample_bits" [B],
    "per_sample_exact" [B]}}}``: exact-match fraction and mean key log-probability (bits; 0 is
    certain), over samples, and over depths at the top level (Python floats).
  """
  by_depth = {}
  for d in depths:
    nll, hits = token_scores(model, passkey_batch(filler, length, d, keys), batch_size)
    bits = -nll[:, -KEY_DIGITS:].sum(axis=1) / math.log(2)  # [B] key log-probability
    exact = hits[:, -KEY_DIGITS:].all(axis=1)  # [B] greedy decoding reproduces the key
    by_depth[str(d)] = {
      "accuracy": float(exact.mean()),
      "key_bits": float(bits.mean()),
      "per_sample_bits": bits.tolist(),
      "per_sample_exact": exact.tolist(),
    }
  return {
    "accuracy": float(np.mean([v["accuracy"] for v in by_depth.values()])),
    "key_bits": float(np.mean([v["key_bits"] for v in by_depth.values()])),
    "by_depth": by_depth,
  }


def finetune_batch(
  tokens: np.ndarray, *, step: int, seed: int, batch_size: int, seq_len: int, fraction: float
) -> np.ndarray:
  """``[B, seq_len + 1]`` int32 format-training batch of step ``step``: the first
  ``round(fraction * B)`` rows passkey samples (filler from ``tokens``, depth uniform in [0, 1],
  random keys), the rest training windows; deterministic in ``(seed, step)``."""
  rng = np.random.default_rng([seed, step, 7])
  starts = rng.integers(0, tokens.size - seq_len, size=batch_size)
  rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
  k = round(fraction * batch_size)
  keys = ["".join(map(str, r)) for r in rng.integers(0, 10, size=(k, KEY_DIGITS))]
  for i, (key, depth) in enumerate(zip(keys, rng.uniform(0.0, 1.0, size=k))):
    rows[i] = passkey_batch(rows[i : i + 1], seq_len, float(depth), [key])[0]
  return rows


def finetune_passkey(
  cfg: ModelConfig,
  params: dict[str, np.ndarray],
  tokens: np.ndarray,
  *,
  steps: int,
  batch_size: int,
  seq_len: int,
  fraction: float,
  learning_rate: float,
  seed: int,
) -> dict[str, np.ndarray]:
  """The format training: ``params`` (``jaxpe.model.build.model_params`` layout) after ``steps``
  AdamW steps (constant ``learning_rate``, global-norm clip 1, no weight decay) of mean next-byte
  cross-entropy on ``finetune_batch`` batches of the training ``tokens`` [n] uint8.

  Raises:
    ValueError: ``steps`` < 0 or ``fraction`` outside [0, 1].
  """
  if steps < 0 or not 0.0 <= fraction <= 1.0:
    raise ValueError(f"steps must be >= 0 and fraction in [0, 1], got steps={steps}, fraction={fraction}")
  model = build_model(cfg, params)
  graphdef, weights, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate, b2=0.95))
  opt_state = tx.init(weights)

  @jax.jit
  def step(weights, opt_state, batch):
    loss_fn = lambda w: token_nll(nnx.merge(graphdef, w, rest), batch).mean()  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(weights)
    updates, opt_state = tx.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state, loss

  for i in range(steps):
    batch = finetune_batch(
      tokens, step=i, seed=seed, batch_size=batch_size, seq_len=seq_len, fraction=fraction
    )
    weights, opt_state, _ = step(weights, opt_state, jnp.asarray(batch))
  return model_params(nnx.merge(graphdef, weights, rest))


def retrieval_emulation(
  cfg: ModelConfig,
  params: dict[str, np.ndarray],
  filler: np.ndarray,
  lengths: list[int],
  depths: tuple[float, ...],
  keys: list[str],
  batch_size: int,
  context: int,
) -> list[dict[str, Any]]:
  """Alibi weights ``params`` (``cfg``: the alibi model) run as ``rope_alibi`` (orders 1 and 2, tuned
  for ``context`` tokens) against native ALiBi on the passkey samples at each length: max |delta key
  bits| over samples and depths, and how many exact-match decisions differ."""
  out = []
  for length in lengths:
    native_cfg = cfg.model_copy(update={"max_len": max(length, cfg.max_len)})
    native = evaluate_passkey(build_model(native_cfg, params), filler, length, depths, keys, batch_size)
    for order in (1, 2):
      emu_cfg = ModelConfig.model_validate(
        {
          **native_cfg.model_dump(mode="python"),
          "pos_encoding": "rope_alibi",
          "rope_alibi_order": order,
          "rope_alibi_context": context,
        }
      )
      emu = evaluate_passkey(build_model(emu_cfg, params), filler, length, depths, keys, batch_size)
      pairs = [(native["by_depth"][str(d)], emu["by_depth"][str(d)]) for d in depths]
      out.append(
        {
          "order": order,
          "length": length,
          "max_abs_delta_key_bits": max(
            float(np.abs(np.subtract(a["per_sample_bits"], b["per_sample_bits"])).max()) for a, b in pairs
          ),
          "exact_match_disagreements": sum(
            int(np.sum(np.not_equal(a["per_sample_exact"], b["per_sample_exact"]))) for a, b in pairs
          ),
          "samples": sum(len(a["per_sample_exact"]) for a, _ in pairs),
        }
      )
  return out
