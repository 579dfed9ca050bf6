"""Several seeds per encoding: a row's per-seed evaluations combined, and the paired differences from
the reference row reported across windows (pooled over seeds) and across seeds.

With S seeds and W held-out windows, a row at one length has S x W per-window bits/byte values
``b[s, w]`` (the same windows for every seed and row). Across windows: ``per_window[w] = mean_s
b[s, w]``, the mean and 1.96 standard errors (ddof 1) over the W values (with S = 1 exactly the first
edition's interval). Across seeds: ``per_seed[s] = mean_w b[s, w]``, the mean and 1.96 standard errors
(ddof 1) over the S values (None for S = 1). Paired differences subtract the reference row's
``b[s, w]`` of the same seed and window first, then reduce the same two ways.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["combine_seeds", "paired_seeds"]


def _ci(values: np.ndarray) -> float | None:
  """1.96 standard errors (ddof 1) of the mean of ``values`` [n]; None for n = 1."""
  return None if values.size < 2 else float(1.96 * values.std(ddof=1) / math.sqrt(values.size))


def _stats(b: np.ndarray) -> dict[str, Any]:
  """The table entry of ``b [S, W]`` per-window values of S seeds."""
  per_window, per_seed = b.mean(axis=0), b.mean(axis=1)
  return {
    "bits_per_byte": float(b.mean()),
    "ci95": _ci(per_window),
    "ci95_seeds": _ci(per_seed),
    "per_window": per_window.tolist(),
    "per_seed": per_seed.tolist(),
  }


def combine_seeds(per_seed: list[dict[str, Any] | None]) -> dict[str, Any] | None:
  """One row's entry at one length from its per-seed ``evaluate`` dicts (None where the row cannot
  run at that length: then every seed's entry is None).

  Returns:
    ``{"bits_per_byte", "ci95" (across windows), "ci95_seeds" (across seeds; None for one seed),
    "per_window" [W] (mean over seeds), "per_seed" [S] (mean over windows), "per_position" [length]
    (mean over seeds)}``, or None.

  Raises:
    ValueError: ``per_seed`` is empty, mixes None with entries, or its entries have different window
      counts.
  """
  if not per_seed:
    raise ValueError("per_seed must hold at least one seed's evaluation, got an empty list")
  if all(e is None for e in per_seed):
    return None
  if any(e is None for e in per_seed) or len({len(e["per_window"]) for e in per_seed}) != 1:
    raise ValueError("per_seed entries must all be None or all hold the same number of windows")
  out = _stats(np.asarray([e["per_window"] for e in per_seed], np.float64))
  out["per_position"] = np.mean([e["per_position"] for e in per_seed], axis=0).tolist()
  return out


def paired_seeds(
  by_seed: dict[str, list[dict[str, Any]]], ref: str
) -> dict[str, dict[str, dict[str, Any] | None]]:
  """Per row and length, the differences ``row - ref`` of the same seed and window (bits/byte).

  Args:
    by_seed: ``by_seed[name][s][str(multiple)]``: seed s's ``evaluate`` dict (or None).
    ref: the reference row's name.

  Returns:
    ``out[name][str(multiple)]``: ``{"bits_per_byte", "ci95" (across windows of the seed-mean
    differences), "ci95_seeds" (across seeds of the window-mean differences; None for one seed),
    "per_window", "per_seed"}``, or None where either side cannot run.
  """
  return paired(
    by_seed,
    ref,
    lambda pairs: _stats(
      np.asarray([np.subtract(a["per_window"], b["per_window"]) for a, b in pairs], np.float64)
    ),
  )


def paired(
  by_seed: dict[str, list[dict[str, Any]]], ref: str, differences: Callable[[list[tuple[Any, Any]]], Any]
) -> dict[str, dict[str, Any | None]]:
  """``out[name][key] = differences([(row's seed-s entry, ref's seed-s entry) for each seed s])`` for
  every row and key of ``by_seed[name][s][key]`` (paired by seed), None where either side of a pair is
  None (cannot run). Shared by the perplexity (``paired_seeds``) and retrieval (``paired_task``) tables."""
  out: dict[str, dict[str, Any | None]] = {}
  for name, seeds in by_seed.items():
    out[name] = {}
    for k in seeds[0]:
      pairs = [(row[k], base[k]) for row, base in zip(seeds, by_seed[ref])]
      out[name][k] = None if any(a is None or b is None for a, b in pairs) else differences(pairs)
  return out
