"""The study's outputs: table cells, paired differences, ``study.md`` and the two plots.

matplotlib (in the ``train`` extra) is imported only inside the plotting functions, so the tables
do not need it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.study.config import ENCODINGS, StudyConfig

__all__ = ["cell", "markdown", "paired", "plot_bits_per_byte", "plot_loss_vs_position", "retrieval_markdown"]


def cell(entry: dict[str, Any] | None, table_size: int | None = None, *, signed: bool = False) -> str:
  """A table cell: ``"mean ± ci95"`` (3 decimals; ``signed``: with a sign), ``"mean ± ci95 / ci95_seeds"``
  where the entry has an interval across seeds (``jaxpe.study.seeds``), or ``"n/a (table N)"`` for a
  row that cannot run."""
  signed = _checks.check_bool("signed", signed)
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
  pi = (
    " Position interpolation fine-tuned (rope_pi_ft): the rope weights after the passkey format training "
    f"(below) run at length {study.longest} with linear factor {study.eval_multiples[-1]}, evaluated with "
    "that factor at every length (its cells are of those weights)."
    if "rope_pi_ft" in study.encodings
    else ""
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
    f"none at 1x).{pi} rope_alibi is tuned for {study.longest} tokens (max phase {m.rope_alibi_max_phase}). "
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
  text += retrieval_markdown(study, report)
  text += [
    "",
    "![bits/byte vs eval length](bits_per_byte.png)",
    "",
    "![loss vs position](loss_vs_position.png)",
  ]
  return "\n".join(text) + "\n"


def _pm(mean: float, ci: float | None, fmt: str) -> str:
  return f"{mean:{fmt}}" + ("" if ci is None else f" ± {ci:{fmt}}")


def retrieval_markdown(study: StudyConfig, report: dict[str, Any]) -> list[str]:
  """The retrieval section of ``study.md`` (empty without ``report["retrieval"]``): exact-match
  accuracy and key log-probability per encoding x length (mean over depths), accuracy per depth,
  and the emulation check on retrieval."""
  res = report.get("retrieval")
  if not res:
    return []
  t = study.train
  from jaxpe.study.retrieval import KEY_DIGITS, PLANT, PROMPT

  head = "| encoding | " + " | ".join(f"{k}x ({k * t.seq_len})" for k in study.eval_multiples) + " |"
  rule = "|---|" + "---|" * len(study.eval_multiples)
  seeds = study.seeds > 1
  text = [
    "",
    "## Retrieval (passkey)",
    "",
    f"A key of {KEY_DIGITS} random digits planted as `{PLANT.format(key='38201').strip()}` at depths "
    f"{list(study.passkey_depths)} of held-out text ({study.eval_windows} samples per depth and length, the "
    f"windows above as filler), asked for at the end with `{PROMPT.strip()}`. Before retrieval every model "
    f"(every seed) is format-trained for {study.passkey_steps} Adam steps (lr {study.passkey_learning_rate}) at "
    f"length {t.seq_len}, batch {t.batch_size}, {study.passkey_fraction:.0%} of each batch passkey samples "
    "(random depth and key, training text as filler), the rest training windows: the same for every "
    "encoding; the eval-time scalings use the format-trained rope weights. Exact match: greedy decoding "
    "reproduces the key. Key log-probability: bits, summed over the key's digits (0 is certain; "
    f"chance is {-KEY_DIGITS * math.log2(10):.1f} for a model that knows only that digits follow). "
    + (
      f"Intervals: 1.96 standard errors over the {study.seeds} seeds."
      if seeds
      else "Intervals on the log-probability: 1.96 standard errors over the samples (one seed)."
    ),
    "",
    "Exact-match accuracy (mean over depths):",
    "",
    head,
    rule,
  ]

  def row_cells(name, what, fmt, ci_key):
    out = []
    for k in study.eval_multiples:
      e = res[name][str(k)]
      out.append("n/a" if e is None else _pm(e[what], e.get(ci_key), fmt))
    return f"| {ENCODINGS[name].label} | " + " | ".join(out) + " |"

  text += [row_cells(n, "accuracy", ".2f", "accuracy_ci95_seeds") for n in study.encodings]
  text += ["", "Key log-probability (bits, mean over depths):", "", head, rule]
  ci_key = "key_bits_ci95_seeds" if seeds else "key_bits_ci95"
  text += [row_cells(n, "key_bits", ".2f", ci_key) for n in study.encodings]
  depths = [str(d) for d in study.passkey_depths]
  text += [
    "",
    "Exact-match accuracy by depth (columns: length, depth):",
    "",
    "| encoding | " + " | ".join(f"{k}x d={d}" for k in study.eval_multiples for d in depths) + " |",
    "|---|" + "---|" * (len(depths) * len(study.eval_multiples)),
  ]
  for name in study.encodings:
    cells = []
    for k in study.eval_multiples:
      e = res[name][str(k)]
      cells += ["n/a" if e is None else f"{e['by_depth'][d]['accuracy']:.2f}" for d in depths]
    text.append(f"| {ENCODINGS[name].label} | " + " | ".join(cells) + " |")
  emu = report.get("retrieval_emulation_check") or []
  if emu:
    text += [
      "",
      "Emulation check on retrieval: the format-trained alibi weights (seed 0) run as rope_alibi against "
      f"native ALiBi on {emu[0]['samples']} passkey samples per length (tolerance: |delta key bits| "
      "< 0.01 and no exact-match decision changed).",
      "",
      "| order | length | max abs delta key bits | exact-match decisions changed | within tolerance |",
      "|---|---|---|---|---|",
    ]
    for e in emu:
      ok = e["max_abs_delta_key_bits"] < 0.01 and e["exact_match_disagreements"] == 0
      text.append(
        f"| k={e['order']} | {e['length']} | {e['max_abs_delta_key_bits']:.3g} | "
        f"{e['exact_match_disagreements']} of {e['samples']} | {'yes' if ok else 'NO'} |"
      )
  return text


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
