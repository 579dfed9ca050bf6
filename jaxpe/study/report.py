"""The study's outputs: table cells, paired differences, ``study.md`` and the two plots.

matplotlib (in the ``train`` extra) is imported only inside the plotting functions, so the tables
do not need it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxpe.study.config import ENCODINGS, StudyConfig

__all__ = ["cell", "markdown", "paired", "plot_bits_per_byte", "plot_loss_vs_position"]


def cell(entry: dict[str, Any] | None, table_size: int | None = None, *, signed: bool = False) -> str:
  """A table cell: ``"mean ± ci95"`` (3 decimals; ``signed``: with a sign), ``"mean ± ci95 / ci95_seeds"``
  where the entry has an interval across seeds (``jaxpe.study.seeds``), or ``"n/a (table N)"`` for a
  row that cannot run."""
  if entry is None:
    return f"n/a (table {table_size})" if table_size else "n/a"
  text = f"{entry['bits_per_byte']:{'+' if signed else ''}.3f} ± {entry['ci95']:.3f}"
  if entry.get("ci95_seeds") is not None:
    text += f" / {entry['ci95_seeds']:.3f}"
  return text


def paired(results: dict[str, dict[str, Any]], ref: str) -> dict[str, dict[str, Any]]:
  """Per row and length, the mean and 1.96 standard errors (ddof 1) of the per-window differences
  ``row - ref`` in bits/byte (None where either side cannot run)."""
  out: dict[str, dict[str, Any]] = {}
  for name, row in results.items():
    out[name] = {}
    for k, entry in row.items():
      base = results[ref][k]
      if entry is None or base is None:
        out[name][k] = None
        continue
      d = np.asarray(entry["per_window"]) - np.asarray(base["per_window"])
      out[name][k] = {
        "bits_per_byte": float(d.mean()),
        "ci95": float(1.96 * d.std(ddof=1) / math.sqrt(d.size)),
      }
  return out


def markdown(study: StudyConfig, report: dict[str, Any]) -> str:
  """``study.md``: the bits/byte table (encodings x eval lengths) with the settings that made it."""
  t = study.train
  m = t.model
  head = "| encoding | " + " | ".join(f"{k}x ({k * t.seq_len})" for k in study.eval_multiples) + " |"
  lines = [head, "|---|" + "---|" * len(study.eval_multiples)]
  for name in study.encodings:
    row = report["results"][name]
    cells = [cell(row[str(k)], t.seq_len) for k in study.eval_multiples]
    lines.append(f"| {ENCODINGS[name].label} | " + " | ".join(cells) + " |")
  steps: Any = {b: r["step"] for b, r in report["models"].items()}
  if len(set(steps.values())) == 1:
    steps = f"{next(iter(steps.values()))} for each of the {len(steps)} models"
  data_desc = t.data.path or "the Python standard library sources"
  seeds = (
    f"seed {t.seed}"
    if study.seeds == 1
    else f"{study.seeds} seeds ({t.seed}..{t.seed + study.seeds - 1}: init and batch order) per encoding"
  )
  across = (
    ""
    if study.seeds == 1
    else f" / 1.96 standard errors over the {study.seeds} seeds of the per-seed means; the mean and the "
    "window interval pool the seeds (per-window means over seeds)"
  )
  text = [
    "# Train short, test long",
    "",
    f"Held-out bits/byte (mean ± 1.96 standard errors over {study.eval_windows} held-out windows of "
    f"{study.longest} bytes{across}; each length scores the same bytes, cut into chunks of that length, each "
    f"chunk starting without context). Trained on {data_desc} (max_bytes {t.data.max_bytes}) at length "
    f"{t.seq_len}: D {m.d_model}, {m.num_layers} layers, {m.num_heads} heads, batch {t.batch_size}, "
    f"{t.num_steps} steps, lr {t.learning_rate}, {seeds}. The eval-time scalings reuse the rope "
    "model's weights (linear factor m, dynamic NTK factor 1, YaRN factor m over the training length; "
    f"none at 1x). rope_alibi is tuned for {study.longest} tokens (max phase {m.rope_alibi_max_phase}). "
    "Learned positions have a table of the training length.",
    "",
    *lines,
    "",
    f"Steps trained: {steps}. Machine: {report['machine']}; {report['date_utc']} UTC; this process "
    f"{report['wall_seconds_this_process']:.0f} s.",
  ]
  ref = report["paired_reference"]
  if len(study.encodings) > 1:
    text += [
      "",
      f"Paired difference from {ENCODINGS[ref].label} on the same windows and seeds (bits/byte, mean ± 1.96 "
      "standard errors of the per-window differences"
      + ("" if study.seeds == 1 else " (averaged over seeds) / of the per-seed mean differences")
      + "; negative is better). Pairing removes the variation in how "
      "hard each window's text is, which dominates the intervals above.",
      "",
      head,
      lines[1],
    ]
    for name in study.encodings:
      if name != ref:
        cells = [cell(report["paired"][name][str(k)], t.seq_len, signed=True) for k in study.eval_multiples]
        text.append(f"| {ENCODINGS[name].label} | " + " | ".join(cells) + " |")
  if report["emulation_check"]:
    text += [
      "",
      "Emulation check: the trained alibi weights run as rope_alibi (tuned for "
      f"{study.longest} tokens) against native ALiBi on {study.eval_batch_size} chunks per length. The "
      "bound is `emulation_error_bound` on the attention score bias at the farthest pair, not a bound "
      "on output logits.",
      "",
      "| order | length | max abs delta output logit | abs delta bits/byte | predicted score-bias bound |",
      "|---|---|---|---|---|",
    ]
    for e in report["emulation_check"]:
      text.append(
        f"| k={e['order']} | {e['length']} | {e['max_abs_delta_logit']:.3g} | "
        f"{e['abs_delta_bits_per_byte']:.3g} | {e['predicted_score_bias_bound']:.3g} |"
      )
  text += [
    "",
    "![bits/byte vs eval length](bits_per_byte.png)",
    "",
    "![loss vs position](loss_vs_position.png)",
  ]
  return "\n".join(text) + "\n"


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def _styles(study: StudyConfig) -> list[dict[str, Any]]:
  """A distinct color per row; dashed for eval-time scalings, dotted for rope_alibi."""
  import matplotlib

  colors = matplotlib.colormaps["tab20"].colors
  return [
    {
      "color": colors[(2 * i) % 20 + (i >= 10)],
      "ls": "--" if ENCODINGS[n].base else ":" if n.startswith("rope_alibi") else "-",
    }
    for i, n in enumerate(study.encodings)
  ]


def plot_bits_per_byte(study: StudyConfig, report: dict[str, Any], path: Path) -> None:
  """Bits/byte against eval length, one line per encoding, to PNG ``path``: left the values with their
  95% intervals, right the paired difference from ``report["paired_reference"]`` with its interval
  (points shifted slightly left/right per row so the bars do not overlap)."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
  n = len(study.encodings)
  ref = report["paired_reference"]
  for i, (name, style) in enumerate(zip(study.encodings, _styles(study))):
    shift = 2 ** (0.08 * (i - (n - 1) / 2) / max(n - 1, 1))
    for ax, table in zip(axes, (report["results"], report["paired"])):
      pts = [
        (k * study.train.seq_len * shift, e["bits_per_byte"], e["ci95"])
        for k, e in ((k, table[name][str(k)]) for k in study.eval_multiples)
        if e is not None
      ]
      if table is report["paired"] and name == ref:
        continue
      x, y, err = zip(*pts)
      ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=2, lw=1.2, label=ENCODINGS[name].label, **style)
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["eval_lengths"], [str(x) for x in report["eval_lengths"]])
    ax.minorticks_off()
    ax.axvline(study.train.seq_len, ls=":", c="gray")
    ax.set_xlabel("eval length (bytes); training length dotted")
  axes[0].set_ylabel("held-out bits per byte (95% interval over windows)")
  axes[1].axhline(0.0, c="gray", lw=0.8)
  axes[1].set_ylabel(f"paired difference from {ENCODINGS[ref].label} (bits/byte)")
  # the legend takes the left panel's lines: the right one has no line for the reference encoding
  axes[1].legend(
    *axes[0].get_legend_handles_labels(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0)
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_loss_vs_position(study: StudyConfig, report: dict[str, Any], path: Path) -> None:
  """Per-position loss (bits, mean over bins of T/8 positions) at the longest length each encoding
  can run, one line per encoding, to PNG ``path``."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(12, 5))
  width = max(1, study.train.seq_len // 8)
  for name, style in zip(study.encodings, _styles(study)):
    row = report["results"][name]
    k = max(k for k in study.eval_multiples if row[str(k)] is not None)
    curve = np.asarray(row[str(k)]["per_position"])
    binned = curve[: curve.size // width * width].reshape(-1, width).mean(axis=1)
    x = np.arange(binned.size) * width + (width - 1) / 2
    ax.plot(x, binned, lw=1.2, marker=".", label=f"{ENCODINGS[name].label} ({k}x)", **style)
  ax.axvline(study.train.seq_len, ls=":", c="gray")
  ax.set_xlabel(f"position (bytes), mean over bins of {width}; training length dotted")
  ax.set_ylabel("held-out loss (bits)")
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
