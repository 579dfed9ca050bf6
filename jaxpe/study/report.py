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
from jaxpe.study.config import ENCODINGS, StudyConfig, streaming_sizes

__all__ = [
  "cell",
  "markdown",
  "paired",
  "plot_bits_per_byte",
  "plot_loss_vs_position",
  "plot_retrieval",
  "retrieval_markdown",
]


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
    f" Position interpolation fine-tuned (rope_pi_ft): the rope weights after {study.finetune_steps} Adam "
    f"steps (lr {study.finetune_learning_rate}) on training text at length {study.longest} with linear factor "
    f"{study.eval_multiples[-1]}, evaluated with that factor at every length."
    if "rope_pi_ft" in study.encodings
    else ""
  )
  sizes = {n: streaming_sizes(study, n) for n in study.encodings if ENCODINGS[n].streaming is not None}
  pi += "".join(
    f" {n}: the rope weights fed one token at a time to StreamingLLM's cache of the first {a} tokens and "
    f"the last {b} (positions inside the cache; arXiv 2309.17453)."
    for n, (a, b) in sizes.items()
  )
  patterns = [n for n in study.encodings if ENCODINGS[n].derived is not None]
  pi += "".join(
    f" {n}: "
    + ", ".join(
      f"{k} {v}"
      for k, v in {**ENCODINGS[n].model, **ENCODINGS[n].derived(t.seq_len, m.num_layers)}.items()
      if k != "pos_encoding"
    )
    + "."
    for n in patterns
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


def _pm(mean: float, ci: float | None, fmt: str, signed: bool = False) -> str:
  return f"{mean:{'+' if signed else ''}{fmt}}" + ("" if ci is None else f" ± {ci:{fmt}}")


def _task_cell(entry: dict[str, Any] | None, metric: str, fmt: str, signed: bool = False) -> str:
  """``mean ± samples / seeds`` of ``entry[metric]`` (``jaxpe.study.retrieval._stats``), or n/a."""
  if entry is None:
    return "n/a"
  e = entry[metric]
  text = _pm(e["mean"], e["ci95"], fmt, signed)
  return text + ("" if e.get("ci95_seeds") is None else f" / {e['ci95_seeds']:{fmt}}")


TASK_TEXT = {
  "mqar": "multi-query associative recall: L/spacing key-value pairs, then every key again (shuffled), each "
  "followed by its value (the answer)",
  "copy": "copying: a string of n distinct symbols (n uniform in [L/8, L/2]), a separator, the string "
  "again (the answers)",
  "flipflop": "flip-flop: write/read/ignore instructions with a bit each; the bit after a read is the "
  "answer (the last bit written)",
}


TASK_KEYS = {"mqar": ("num_keys", "num_values", "spacing"), "copy": ("num_symbols",), "flipflop": ("ignore",)}
"""The ``TaskConfig`` keys each task uses (the table's caption names them)."""


def retrieval_markdown(study: StudyConfig, report: dict[str, Any]) -> list[str]:
  """The retrieval section of ``study.md`` (empty without tasks): per task, per-token and per-sequence
  exact match and the answers' log2-probability per encoding x length, the paired accuracy
  difference from rope and of the rope_alibi rows from alibi, and the emulation check."""
  res = report.get("retrieval")
  if not res:
    return []
  from jaxpe.study.config import task_train_config
  from jaxpe.train import tasks as tasks_lib

  text = ["", "## Retrieval (synthetic tasks, trained short and tested long)"]
  across = f" / over the {study.seeds} seeds of the per-seed means" if study.seeds > 1 else " (one seed)"
  for task in study.tasks:
    cfg = task_train_config(study, task)
    t, mdl = cfg.seq_len, cfg.model
    head = "| encoding | " + " | ".join(f"{k}x ({k * t})" for k in study.eval_multiples) + " |"
    rule = "|---|" + "---|" * len(study.eval_multiples)
    r, ref = res[task.name], report["paired_reference"]
    text += [
      "",
      f"### {task.name}",
      "",
      f"{TASK_TEXT[task.name]}; {', '.join(f'{k} {getattr(task, k)}' for k in TASK_KEYS[task.name])}, "
      f"vocabulary {tasks_lib.vocab_size(task)}. "
      f"Trained by the ordinary trainer at length {t}: D {mdl.d_model}, {mdl.num_layers} layers, "
      f"{mdl.num_heads} heads, batch {cfg.batch_size}, {cfg.num_steps} steps, lr {cfg.learning_rate}, loss on "
      f"the answer tokens only"
      + (
        f", started from the {study.task_init[task.name]} models of the same encoding and seed (task_init; "
        f"model vocabulary {mdl.vocab_size})"
        if task.name in study.task_init
        else ""
      )
      + f". Scored on the same {study.task_samples} held-out samples per length "
      f"(mean ± 1.96 standard errors over the samples{across}); chance log-probability "
      f"{-tasks_lib.answer_bits(task):.2f} bits per answer.",
    ]
    for metric, what, fmt in (
      ("token_accuracy", "Exact match per answer token", ".3f"),
      ("exact", "Exact match per sequence (every answer right)", ".3f"),
      ("answer_bits", "Answer log2-probability (bits per answer, 0 is certain)", ".2f"),
    ):
      text += ["", f"{what}:", "", head, rule]
      for name in study.encodings:
        cells = [_task_cell(r[name][str(k)], metric, fmt) for k in study.eval_multiples]
        text.append(f"| {ENCODINGS[name].label} | " + " | ".join(cells) + " |")
    if len(study.encodings) > 1:
      text += [
        "",
        f"Paired difference in per-token exact match from {ENCODINGS[ref].label} (same samples and seeds):",
        "",
        head,
        rule,
      ]
      for name in study.encodings:
        if name != ref:
          p = report["retrieval_paired"][task.name][name]
          cells = [_task_cell(p[str(k)], "token_accuracy", ".3f", True) for k in study.eval_multiples]
          text.append(f"| {ENCODINGS[name].label} | " + " | ".join(cells) + " |")
    vs = report.get("retrieval_vs_alibi", {}).get(task.name) or {}
    if vs:
      text += [
        "",
        "Trained rope_alibi models against trained alibi models (per-token exact match, paired):",
        "",
        head,
        rule,
      ]
      for name, p in vs.items():
        cells = [_task_cell(p[str(k)], "token_accuracy", ".3f", True) for k in study.eval_multiples]
        text.append(f"| {ENCODINGS[name].label} - alibi | " + " | ".join(cells) + " |")
    emu = report.get("retrieval_emulation_check", {}).get(task.name) or []
    if emu:
      text += [
        "",
        f"Emulation check: the trained alibi weights (seed 0) run as rope_alibi (tuned for "
        f"{study.eval_multiples[-1] * t} tokens) against native ALiBi on the same samples.",
        "",
        "| order | length | native accuracy | accuracy difference | answers changed | max abs delta log2-prob |",
        "|---|---|---|---|---|---|",
      ]
      for e in emu:
        text.append(
          f"| k={e['order']} | {e['length']} | {e['token_accuracy_native']:.3f} | "
          f"{_pm(e['token_accuracy_delta'], e['token_accuracy_delta_ci95'], '.4f', True)} | "
          f"{e['answers_changed']} of {e['answers']} | {e['max_abs_delta_answer_bits']:.3g} |"
        )
  text += ["", "![retrieval accuracy vs eval length](retrieval.png)"]
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


def plot_retrieval(study: StudyConfig, report: dict[str, Any], path: Path) -> None:
  """Per-token exact match against eval length, one panel per task and one line per encoding (95%
  interval over the samples), to PNG ``path``."""
  from jaxpe.study.config import task_train_config

  plt = _pyplot()
  fig, axes = plt.subplots(1, len(study.tasks), figsize=(7 * len(study.tasks) + 3, 5.5), squeeze=False)
  n = len(study.encodings)
  for ax, task in zip(axes[0], study.tasks):
    t = task_train_config(study, task).seq_len
    for i, (name, style) in enumerate(zip(study.encodings, _styles(study))):
      shift = 2 ** (0.08 * (i - (n - 1) / 2) / max(n - 1, 1))
      row = report["retrieval"][task.name][name]
      pts = [
        (k * t * shift, e["token_accuracy"]["mean"], e["token_accuracy"]["ci95"] or 0.0)
        for k, e in ((k, row[str(k)]) for k in study.eval_multiples)
        if e is not None
      ]
      x, y, err = zip(*pts)
      ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=2, lw=1.2, label=ENCODINGS[name].label, **style)
    lengths = [k * t for k in study.eval_multiples]
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.minorticks_off()
    ax.axvline(t, ls=":", c="gray")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(task.name)
    ax.set_xlabel("eval length (tokens); training length dotted")
    ax.set_ylabel("exact match per answer token")
  axes[0][-1].legend(
    *axes[0][0].get_legend_handles_labels(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0)
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
