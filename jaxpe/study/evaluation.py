"""Evaluation by position: held-out windows cut into chunks of each eval length, the bits/byte of a
model on them, and the emulation check (trained ALiBi weights run as RoPE-emulated ALiBi).

``eval_windows`` windows W of ``M T + 1`` bytes (``jaxpe.train.data.eval_batches``; T the training
length, M the largest multiple). At multiple m each window is cut into ``M / m`` non-overlapping
chunks of ``m T`` inputs (+ 1 target byte), so every length scores exactly the same target bytes,
each chunk starting from no context. A StreamingLLM row (``streaming``: ``(start_size,
recent_size)``) scores each chunk token by token through ``jaxpe.model.streaming``'s cache instead
(``token_scores``). Per window, the mean next-byte cross-entropy over its ``M T``
targets is converted to bits/byte; the table gives the mean over windows +- 1.96 standard errors
(ddof 1) over the W windows. The per-position curve at length ``m T`` is the mean loss (bits) at
each position over all chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpe.emulation import emulation_error_bound
from jaxpe.model import Decoder, emulation_theta
from jaxpe.model.build import build_model
from jaxpe.model.config import ModelConfig
from jaxpe.model.streaming import check_streaming, init_streaming_cache
from jaxpe.ops.alibi import alibi_slopes_f64
from jaxpe.study.config import StudyConfig, model_train_config
from jaxpe.train import data
from jaxpe.train.load import trained_params

__all__ = ["chunks", "emulation_check", "evaluate", "study_windows", "token_nll", "token_scores"]


def study_windows(study: StudyConfig) -> np.ndarray:
  """``[W, M T + 1]`` int32 held-out windows (W = ``eval_windows``, M T the longest eval length).

  Raises:
    ValueError: the held-out bytes hold fewer than W windows (``jaxpe.train.data.eval_batches``).
  """
  d = study.train.data
  corpus = data.load_corpus(d.path, max_bytes=d.max_bytes, eval_fraction=d.eval_fraction)
  return data.eval_batches(corpus.eval, batch_size=study.eval_windows, seq_len=study.longest, num_batches=1)[
    0
  ]


def chunks(windows: np.ndarray, length: int) -> np.ndarray:
  """``[W * C, length + 1]``: each window ``[W, C length + 1]`` cut into C chunks of ``length``
  inputs and the next target byte (chunk c of window w is row ``w C + c``)."""
  n = (windows.shape[1] - 1) // length
  return np.stack([windows[:, c * length : c * length + length + 1] for c in range(n)], axis=1).reshape(
    -1, length + 1
  )


def token_nll(model: Decoder, batch: jax.Array) -> jax.Array:
  """Next-token cross-entropy ``[B, T]`` float32 (nats) of ``batch [B, T + 1]`` int32 (inputs
  ``[:, :-1]``, targets ``[:, 1:]``)."""
  logits = model(batch[:, :-1])
  target = jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - target


def _jitted(model: Decoder, fn):
  """``batch -> fn(model, batch)`` jitted, with the model's weights as arguments (not constants)."""
  graphdef, state = nnx.split(model)
  call = jax.jit(lambda state, batch: fn(nnx.merge(graphdef, state), batch))
  return lambda batch: call(state, batch)


@functools.partial(jax.jit, static_argnums=0)
def _token_scores(graphdef: nnx.GraphDef, state: nnx.State, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
  model = nnx.merge(graphdef, state)
  logits = model(batch[:, :-1])
  target = jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - target, jnp.argmax(logits, axis=-1) == batch[:, 1:]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _streaming_scores(
  graphdef: nnx.GraphDef, state: nnx.State, batch: jax.Array, sizes: tuple[int, int]
) -> tuple[jax.Array, jax.Array]:
  """``_token_scores`` through a ``StreamingCache`` of ``sizes = (start_size, recent_size)``: the first
  ``min(T, C)`` inputs as one chunk (nothing evicted yet: a plain causal forward), then one token at
  a time (a ``lax.scan``), each predicted from the sinks and the recent window at their positions in
  the cache, as streaming-llm's ``eval_long_ppl.py`` (one token per step, ``StartRecentKVCache``)."""
  model = nnx.merge(graphdef, state)
  tokens, targets = batch[:, :-1], batch[:, 1:]
  rows, t_len = tokens.shape
  cache = init_streaming_cache(model.cfg, rows, *sizes)
  cache = dataclasses.replace(cache, end=np.zeros((), np.int32))  # concrete: the first chunk fits
  first = min(t_len, sum(sizes))

  def scores(logits, target):  # [B, t, V], [B, t] -> nll, hits [B, t]
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked, jnp.argmax(logits, axis=-1) == target

  logits, cache = model(tokens[:, :first], cache=cache)
  nll, hits = scores(logits, targets[:, :first])
  if t_len == first:
    return nll, hits

  def feed(cache, step):  # one token [B] and its target [B]
    token, target = step
    # a model made at this trace level (as generate's decode step: nnx.scan / remat in the blocks)
    logits, cache = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))(token[:, None], cache=cache)
    return cache, scores(logits, target[:, None])

  _, (rest_nll, rest_hits) = jax.lax.scan(feed, cache, (tokens[:, first:].T, targets[:, first:].T))
  return (
    jnp.concatenate([nll, rest_nll[..., 0].T], axis=1),
    jnp.concatenate([hits, rest_hits[..., 0].T], axis=1),
  )


def token_scores(
  model: Decoder, rows: np.ndarray, batch_size: int, streaming: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Next-token cross-entropy ``[R, T]`` float64 (nats) and greedy hits ``[R, T]`` bool (the argmax
  is the target) of ``rows [R, T + 1]`` int32, run ``batch_size`` rows at a time (the last batch
  padded with copies of row 0).

  ``streaming``: None (one causal forward per batch), or ``(start_size, recent_size)``: StreamingLLM
  (Xiao et al., arXiv 2309.17453, section 3.2; its perplexity evaluation, mit-han-lab/streaming-llm
  ``examples/eval_long_ppl.py``): the tokens are fed one at a time to ``jaxpe.model.streaming``'s
  cache of the first ``start_size`` tokens and the last ``recent_size`` ones; token g is predicted
  from the sinks and the recent window kept after it, rotated at their positions in the cache
  (``0 .. min(g + 1, C) - 1``, the query last), the keys and values of deeper layers those computed
  when their token was fed. While g < C nothing is evicted and the scores are the plain forward's.

  Raises:
    TypeError / ValueError: ``streaming`` not two ints (``start_size >= 0``, ``recent_size >= 1``) or
      a model the cache does not run (``jaxpe.model.streaming.check_streaming``, named).

  One compiled program per model structure and batch shape, shared by the perplexity and retrieval
  evaluations (the weights are arguments): a seed's or a fine-tuned model's weights reuse it,
  and with the study's persistent compilation cache so does a later process.
  """
  graphdef, state = nnx.split(model)
  rows = np.asarray(rows)
  n = len(rows)
  padded = np.concatenate([rows, np.repeat(rows[:1], -n % batch_size, axis=0)])
  if streaming is None:
    score = lambda batch: _token_scores(graphdef, state, batch)  # noqa: E731
  else:
    sizes = check_streaming(model.cfg, streaming)
    score = lambda batch: _streaming_scores(graphdef, state, batch, sizes)  # noqa: E731
  outs = [score(jnp.asarray(padded[i : i + batch_size], jnp.int32)) for i in range(0, n, batch_size)]
  nll = np.concatenate([np.asarray(a) for a, _ in outs]).astype(np.float64)[:n]
  hits = np.concatenate([np.asarray(b) for _, b in outs])[:n]
  return nll, hits


def evaluate(
  model: Decoder,
  windows: np.ndarray,
  length: int,
  batch_size: int,
  streaming: tuple[int, int] | None = None,
) -> dict[str, Any]:
  """Bits/byte of ``model`` on ``windows [W, M T + 1]`` at eval length ``length`` (``streaming``: as
  ``token_scores``).

  Returns:
    ``{"bits_per_byte", "ci95", "per_window" [W], "per_position" [length]}``: the mean over windows,
    1.96 standard errors (ddof 1) of the per-window means, each window's mean over its targets, and
    the mean loss at each position over all chunks, all in bits/byte (Python floats).
  """
  nll, _ = token_scores(model, chunks(windows, length), batch_size, streaming)  # [W C, length]
  bits = nll / math.log(2)
  per_window = bits.reshape(windows.shape[0], -1).mean(axis=1)
  se = per_window.std(ddof=1) / math.sqrt(per_window.size)
  return {
    "bits_per_byte": float(per_window.mean()),
    "ci95": float(1.96 * se),
    "per_window": per_window.tolist(),
    "per_position": bits.mean(axis=0).tolist(),
  }


def emulation_check(study: StudyConfig, windows: np.ndarray) -> list[dict[str, Any]]:
  """The trained ``alibi`` weights run as ``rope_alibi`` (orders 1 and 2, tuned for the longest eval
  length) against native ALiBi at each eval length, on the first ``eval_batch_size`` chunks: max
  |delta logit| over the output logits, |delta bits/byte|, and the predicted worst score-bias
  deviation (``emulation_error_bound`` at the farthest pair of that length: a bound on the attention
  scores, not on the output logits)."""
  cfg = model_train_config(study, "alibi")
  params = trained_params(cfg)
  out = []
  for m in study.eval_multiples:
    length = m * study.train.seq_len
    rows = jnp.asarray(chunks(windows, length)[: study.eval_batch_size])
    targets = np.asarray(rows[:, 1:])
    native_cfg = cfg.model.model_copy(update={"max_len": max(length, cfg.model.max_len)})
    native = _logits(build_model(native_cfg, params), rows[:, :-1])
    native_nll = _numpy_nll(native, targets)
    for order in (1, 2):
      emu_cfg = ModelConfig.model_validate(
        {
          **native_cfg.model_dump(mode="python"),
          "pos_encoding": "rope_alibi",
          "rope_alibi_order": order,
          "rope_alibi_context": study.longest,
        }
      )
      emu = _logits(build_model(emu_cfg, params), rows[:, :-1])
      bound = emulation_error_bound(
        alibi_slopes_f64(cfg.model.num_heads),
        theta=float(np.float32(emulation_theta(emu_cfg))),
        distance=length - 1,
        position=length - 1,
        order=order,
        dtype="float32",
      )
      out.append(
        {
          "order": order,
          "multiple": m,
          "length": length,
          "max_abs_delta_logit": float(np.abs(native - emu).max()),
          "abs_delta_bits_per_byte": abs(_numpy_nll(emu, targets) - native_nll) / math.log(2),
          "predicted_score_bias_bound": float(np.max(bound)),
        }
      )
  return out


def _logits(model: Decoder, tokens: jax.Array) -> np.ndarray:
  return np.asarray(_jitted(model, lambda mdl, t: mdl(t))(tokens), np.float64)


def _numpy_nll(logits: np.ndarray, targets: np.ndarray) -> float:
  """Mean next-token cross-entropy (nats) of ``logits [B, T, V]`` float64 for ``targets [B, T]``."""
  lse = np.logaddexp.reduce(logits, axis=-1)
  return float((lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean())
