"""The study's retrieval step: format-train each (encoding, seed) model, score the passkey task at
every eval length, combine the seeds, and re-check the emulation guarantee on retrieval.

The fine-tuned weights are cached next to the checkpoints (``passkey_finetuned.npz``) and the scores
per row (``passkey_<name>.json``), both keyed by everything they depend on, so a rerun reuses them.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxpe.model.build import build_model
from jaxpe.ops import checks as _checks
from jaxpe.study.config import (
  ENCODINGS,
  StudyConfig,
  cache_key,
  eval_model_config,
  model_dir,
  model_train_config,
)
from jaxpe.study.retrieval import evaluate_passkey, finetune_passkey, random_keys, retrieval_emulation
from jaxpe.train import data, run_files
from jaxpe.train.load import trained_params

__all__ = ["combine_retrieval", "finetuned_params", "run_retrieval", "tuned_name"]

KEY_SEED = 20260  # the eval keys (the same for every row, seed and length)


def _ci(values: np.ndarray) -> float | None:
  return None if values.size < 2 else float(1.96 * values.std(ddof=1) / math.sqrt(values.size))


def combine_retrieval(per_seed: list[dict[str, Any] | None]) -> dict[str, Any] | None:
  """One row's retrieval entry at one length from its per-seed ``evaluate_passkey`` dicts (all None
  where the row cannot run at that length).

  Returns:
    ``{"accuracy", "key_bits"}`` (means over seeds, depths and samples), ``"accuracy_ci95_seeds"``,
    ``"key_bits_ci95_seeds"`` (1.96 standard errors, ddof 1, of the per-seed means; None for one
    seed), ``"key_bits_ci95"`` (over samples x depths of the per-sample means over seeds), and
    ``"by_depth"``: ``{str(depth): {"accuracy", "key_bits", "accuracy_ci95_seeds",
    "key_bits_ci95_seeds"}}``; or None.
  """
  if all(e is None for e in per_seed):
    return None
  if any(e is None for e in per_seed):
    raise ValueError("per_seed entries must all be None or all be evaluate_passkey dicts")
  depths = list(per_seed[0]["by_depth"])
  out: dict[str, Any] = {"by_depth": {}}
  for what in ("accuracy", "key_bits"):
    per = np.asarray([e[what] for e in per_seed], np.float64)
    out[what], out[f"{what}_ci95_seeds"] = float(per.mean()), _ci(per)
  samples = np.asarray(
    [[e["by_depth"][d]["per_sample_bits"] for d in depths] for e in per_seed], np.float64
  )  # [S, depths, B]
  out["key_bits_ci95"] = _ci(samples.mean(axis=0).reshape(-1))
  for d in depths:
    entry = {}
    for what in ("accuracy", "key_bits"):
      per = np.asarray([e["by_depth"][d][what] for e in per_seed], np.float64)
      entry[what], entry[f"{what}_ci95_seeds"] = float(per.mean()), _ci(per)
    out["by_depth"][d] = entry
  return out


def tuned_name(name: str) -> str:
  """The model whose format-trained weights row ``name`` evaluates: its own for a ``finetuned`` row,
  else its base's (itself for a trained row)."""
  enc = ENCODINGS[name]
  return name if enc.finetuned else (enc.base or name)


def finetuned_params(
  study: StudyConfig, name: str, seed: int, tokens: np.ndarray, progress: bool = True
) -> dict[str, np.ndarray]:
  """The format-trained weights of row ``tuned_name(name)`` and seed index ``seed`` (cached in the
  base model's workdir as ``passkey_finetuned.npz``, or ``passkey_finetuned_<name>.npz`` for a
  ``finetuned`` row).

  A trained row: ``study.passkey_steps`` steps at ``train.seq_len`` and ``train.batch_size``. A
  ``finetuned`` row (position interpolation): the same steps, learning rate and passkey fraction, from
  its base's trained weights, with its scaling at factor M = max(eval_multiples) (``eval_model_config``)
  at length M T and batch max(1, B // M), so each step sees about as many tokens.
  """
  progress = _checks.check_bool("progress", progress)
  name = tuned_name(name)
  base = ENCODINGS[name].base or name
  cfg = model_train_config(study, name, seed)
  t = study.train
  model_cfg, seq_len, batch_size, fname = cfg.model, t.seq_len, t.batch_size, "passkey_finetuned.npz"
  if ENCODINGS[name].finetuned:
    m = study.eval_multiples[-1]
    model_cfg = eval_model_config(study, name, m)
    seq_len, batch_size, fname = m * t.seq_len, max(1, t.batch_size // m), f"passkey_finetuned_{name}.npz"
  key = cache_key(
    cfg.model_dump(mode="json"),
    model_cfg.model_dump(mode="json"),
    seq_len,
    batch_size,
    study.passkey_steps,
    study.passkey_fraction,
    study.passkey_learning_rate,
  )
  path = Path(cfg.workdir) / fname
  if path.is_file():
    try:
      with np.load(path) as f:
        if str(f["__key__"]) == key:
          return {k: f[k] for k in f.files if k != "__key__"}
    except (OSError, ValueError, KeyError):
      pass  # a damaged or old cache: fine-tune again and rewrite it
  if progress:
    print(
      f"[study] passkey format training {model_dir(name, seed)} ({study.passkey_steps} steps at length "
      f"{seq_len}{', from ' + base if base != name else ''})",
      flush=True,
    )
  params = finetune_passkey(
    model_cfg,
    trained_params(cfg),
    tokens,
    steps=study.passkey_steps,
    batch_size=batch_size,
    seq_len=seq_len,
    fraction=study.passkey_fraction,
    learning_rate=study.passkey_learning_rate,
    seed=cfg.seed,
  )
  tmp = path.with_name(fname.replace(".npz", ".tmp.npz"))
  np.savez(tmp, __key__=np.asarray(key), **params)
  tmp.replace(path)
  return params


def run_retrieval(study: StudyConfig, windows: np.ndarray, *, progress: bool = True) -> dict[str, Any]:
  """Retrieval for every row and seed on the held-out ``windows [W, M T + 1]`` (the filler: one
  sample per window, depth and length, keys from ``KEY_SEED``).

  Returns:
    ``{"retrieval": {name: {str(multiple): combine_retrieval entry or None}}, "retrieval_by_seed":
    {name: [per seed {str(multiple): evaluate_passkey dict or None}]}, "retrieval_emulation_check":
    [retrieval_emulation rows] (empty without alibi)}``.
  """
  progress = _checks.check_bool("progress", progress)
  d = study.train.data
  tokens = data.load_corpus(d.path, max_bytes=d.max_bytes, eval_fraction=d.eval_fraction).train
  keys = random_keys(windows.shape[0], KEY_SEED)
  depths = study.passkey_depths
  by_seed: dict[str, list[dict[str, Any]]] = {name: [] for name in study.encodings}
  win = hashlib.sha256(windows.tobytes()).hexdigest()
  for seed in range(study.seeds):
    tuned: dict[str, dict[str, np.ndarray]] = {}
    for name in study.encodings:
      base = tuned_name(name)
      cfg = model_train_config(study, name, seed)
      cache = Path(cfg.workdir) / f"passkey_{name}.json"
      key = cache_key(
        cfg.model_dump(mode="json"),
        study.passkey_steps,
        study.passkey_fraction,
        study.passkey_learning_rate,
        depths,
        win,
        study.eval_multiples,
        ENCODINGS[name].scaling,
      )
      try:
        cached = json.loads(cache.read_text()) if cache.is_file() else {}
      except (OSError, ValueError):
        cached = {}
      if isinstance(cached, dict) and cached.get("key") == key:  # null numbers (json_text) are NaN
        by_seed[name].append(
          {m: None if e is None else run_files.nan_for_null(e) for m, e in cached["results"].items()}
        )
        continue
      if base not in tuned:
        tuned[base] = finetuned_params(study, base, seed, tokens, progress)
      row: dict[str, Any] = {}
      if progress:
        print(f"[study] retrieval {model_dir(name, seed)} at {list(study.eval_multiples)}x", flush=True)
      for m in study.eval_multiples:
        mcfg = eval_model_config(study, name, m)
        length = m * study.train.seq_len
        row[str(m)] = (
          None
          if mcfg is None
          else evaluate_passkey(
            build_model(mcfg, tuned[base]), windows, length, depths, keys, study.eval_batch_size
          )
        )
      run_files.write_atomic(cache, run_files.json_text({"key": key, "results": row}))
      by_seed[name].append(row)
  results = {n: {k: combine_retrieval([r[k] for r in rows]) for k in rows[0]} for n, rows in by_seed.items()}
  emu = []
  if "alibi" in study.encodings:
    cfg = model_train_config(study, "alibi")
    emu = retrieval_emulation(
      cfg.model,
      finetuned_params(study, "alibi", 0, tokens, progress),
      windows[: study.eval_batch_size],
      [m * study.train.seq_len for m in study.eval_multiples],
      depths,
      keys[: study.eval_batch_size],
      study.eval_batch_size,
      study.longest,
    )
  return {"retrieval": results, "retrieval_by_seed": by_seed, "retrieval_emulation_check": emu}
