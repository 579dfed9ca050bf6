"""Retrieval scores on the synthetic tasks (``jaxpe.train.tasks``): exact match per answer token and
per sequence and the answers' log-probability from one teacher-forced pass, their combination over
samples and seeds, and the emulation check on retrieval.

A sample ``[2, L + 1]`` (tokens, answer mask) is scored on its answer targets (``mask[1:]``):
``token_accuracy``, the share of answers that are the argmax of the model's next-token distribution
(greedy decoding with the earlier answers given, as teacher forcing gives them); ``exact``, all of a
sample's answers right; ``answer_bits``, the mean log2-probability of an answer (0 is certain; chance
is ``-tasks.answer_bits``). Intervals: 1.96 standard errors (ddof 1) over the samples (of the
per-sample means over seeds) and over the seeds (of the per-seed means), as the perplexity table
(``jaxpe.study.seeds``).

Samples hold different numbers of answers (copy, flipflop), so the per-answer metrics
(``token_accuracy``, ``answer_bits``; ``ANSWER_METRICS``) are combined over samples weighted by their
answers: the mean is the share (or mean) over all answers, not a mean of per-sample means, and its
interval over samples is the ratio estimator's (equal to the plain one when every sample holds the
same number of answers). ``exact`` is per sample (weight 1 each).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxpe.model import Decoder
from jaxpe.model.build import build_model
from jaxpe.model.config import ModelConfig
from jaxpe.study.evaluation import token_scores
from jaxpe.study.seeds import paired

__all__ = ["ANSWER_METRICS", "METRICS", "combine_task", "paired_task", "score_task", "task_emulation"]

METRICS = ("token_accuracy", "exact", "answer_bits")
"""The per-sample retrieval metrics, in table order."""
ANSWER_METRICS = ("token_accuracy", "answer_bits")
"""The metrics that are means over a sample's answers: combined over samples weighted by ``answers``."""


def score_task(
  model: Decoder, samples: np.ndarray, batch_size: int, streaming: tuple[int, int] | None = None
) -> dict[str, list[float]]:
  """Per-sample scores of ``model`` on ``samples [N, 2, L + 1]`` int32 (``tasks.held_out``), run
  ``batch_size`` rows at a time (``token_scores``: the same compiled program as the perplexity;
  ``streaming``: StreamingLLM's cache, as there).

  Returns:
    ``{metric: [N] floats}`` for ``METRICS`` (exact as 0.0 / 1.0), and ``answers``: each sample's
    number of answers (the weight of its ``ANSWER_METRICS`` when samples are combined).

  Raises:
    ValueError: ``samples`` not ``[N, 2, L + 1]``, or a sample without answers.
  """
  samples = np.asarray(samples)
  if samples.ndim != 3 or samples.shape[1] != 2:
    raise ValueError(f"samples must be [N, 2, L + 1] (tokens, answer mask), got shape {samples.shape}")
  mask = samples[:, 1, 1:].astype(bool)  # [N, L]
  count = mask.sum(axis=1)
  if (count == 0).any():
    raise ValueError(f"samples {np.flatnonzero(count == 0).tolist()} have no answer tokens")
  nll, hits = token_scores(model, samples[:, 0], batch_size, streaming)
  return {
    "token_accuracy": ((hits & mask).sum(axis=1) / count).tolist(),
    "exact": (hits | ~mask).all(axis=1).astype(np.float64).tolist(),
    "answer_bits": (-(nll * mask).sum(axis=1) / count / math.log(2)).tolist(),
    "answers": count.astype(np.float64).tolist(),
  }


def _ci(values: np.ndarray, weights: np.ndarray | None = None) -> float | None:
  """1.96 standard errors of the (``weights``-weighted) mean of ``values [n]``; None for n = 1. With
  weights, the ratio estimator's: ``sqrt(n / (n - 1) sum(w_i^2 (x_i - mean)^2)) / sum(w_i)``, which is
  ``std(ddof=1) / sqrt(n)`` for equal weights."""
  if values.size < 2:
    return None
  if weights is None:
    return float(1.96 * values.std(ddof=1) / math.sqrt(values.size))
  mean = (weights * values).sum() / weights.sum()
  n = values.size
  return float(1.96 * math.sqrt(n / (n - 1) * ((weights * (values - mean)) ** 2).sum()) / weights.sum())


def _stats(b: np.ndarray, weights: np.ndarray | None = None) -> dict[str, Any]:
  """``b [S, N]`` (seeds x samples) -> mean, ``ci95`` over the samples of the seed means, ``ci95_seeds``
  over the seeds of the sample means (None for one), ``per_sample``, ``per_seed``; with ``weights``
  ``[N]`` (each sample's answers) every mean over samples is weighted by them."""
  w = np.ones(b.shape[1]) if weights is None else np.asarray(weights, np.float64)
  per_sample, per_seed = b.mean(axis=0), (b * w).sum(axis=1) / w.sum()
  return {
    "mean": float(per_seed.mean()),
    "ci95": _ci(per_sample, None if weights is None else w),
    "ci95_seeds": _ci(per_seed),
    "per_sample": per_sample.tolist(),
    "per_seed": per_seed.tolist(),
  }


def _answers(per_seed: list[dict[str, Any]]) -> np.ndarray | None:
  """The samples' answer counts shared by every seed's scores (None in scores without them: equal
  weights).

  Raises:
    ValueError: seeds scored on samples with different answer counts."""
  counts = [e.get("answers") for e in per_seed]
  if all(c is None for c in counts):
    return None
  if any(c is None or list(c) != list(counts[0]) for c in counts):
    raise ValueError("per_seed entries must be scores of the same samples (their answer counts differ)")
  return np.asarray(counts[0], np.float64)


def _metric_stats(values: np.ndarray, metric: str, answers: np.ndarray | None) -> dict[str, Any]:
  return _stats(values, answers if metric in ANSWER_METRICS else None)


def combine_task(per_seed: list[dict[str, list[float]] | None]) -> dict[str, Any] | None:
  """One row's entry at one length from its per-seed ``score_task`` dicts (all None where the row
  cannot run there): ``{metric: _stats}`` for ``METRICS``, or None.

  Raises:
    ValueError: an empty list, None mixed with scores, or different sample counts.
  """
  if not per_seed:
    raise ValueError("per_seed must hold at least one seed's scores, got an empty list")
  if all(e is None for e in per_seed):
    return None
  if any(e is None for e in per_seed) or len({len(e["exact"]) for e in per_seed}) != 1:
    raise ValueError("per_seed entries must all be None or all hold the same number of samples")
  answers = _answers(per_seed)
  return {k: _metric_stats(np.asarray([e[k] for e in per_seed], np.float64), k, answers) for k in METRICS}


def paired_task(
  by_seed: dict[str, list[dict[str, Any]]], ref: str
) -> dict[str, dict[str, dict[str, Any] | None]]:
  """Per row and length, ``row - ref`` of the same seed and sample for every metric (``_stats`` of the
  differences), None where either side cannot run; ``by_seed[name][s][str(multiple)]`` are
  ``score_task`` dicts."""

  def differences(pairs):
    answers = _answers([a for a, _ in pairs] + [b for _, b in pairs])
    return {
      m: _metric_stats(np.asarray([np.subtract(a[m], b[m]) for a, b in pairs], np.float64), m, answers)
      for m in METRICS
    }

  return paired(by_seed, ref, differences)


def task_emulation(
  cfg: ModelConfig,
  params: dict[str, np.ndarray],
  samples_at: dict[int, np.ndarray],
  batch_size: int,
  context: int,
) -> list[dict[str, Any]]:
  """Alibi weights ``params`` (``cfg``: the alibi model) run as ``rope_alibi`` (orders 1 and 2, tuned
  for ``context`` tokens) against native ALiBi on ``samples_at[length]`` (``[N, 2, length + 1]``) at each
  length: the token accuracy (share of all answers) and its difference (emulated - native) with 1.96
  standard errors over the samples (weighted by their answers), the answers whose greedy hit changed
  (of all answers), and max |delta log2-prob| over the answers."""
  out = []
  for length, samples in samples_at.items():
    mask = np.asarray(samples)[:, 1, 1:].astype(bool)
    native_cfg = cfg.model_copy(update={"max_len": max(length, cfg.max_len)})
    nll_n, hits_n = token_scores(build_model(native_cfg, params), samples[:, 0], batch_size)
    for order in (1, 2):
      emu_cfg = ModelConfig.model_validate(
        {
          **native_cfg.model_dump(mode="python"),
          "pos_encoding": "rope_alibi",
          "rope_alibi_order": order,
          "rope_alibi_context": context,
        }
      )
      nll_e, hits_e = token_scores(build_model(emu_cfg, params), samples[:, 0], batch_size)
      count = mask.sum(axis=1).astype(np.float64)
      acc_n, acc_e = ((h & mask).sum(axis=1) / count for h in (hits_n, hits_e))
      d = acc_e - acc_n
      out.append(
        {
          "order": order,
          "length": length,
          "token_accuracy_native": float((hits_n & mask).sum() / count.sum()),
          "token_accuracy_delta": float((d * count).sum() / count.sum()),
          "token_accuracy_delta_ci95": _ci(d, count),
          "answers_changed": int(((hits_n != hits_e) & mask).sum()),
          "answers": int(mask.sum()),
          "max_abs_delta_answer_bits": float(np.abs(nll_e - nll_n)[mask].max() / math.log(2)),
          "samples": len(d),
        }
      )
  return out
