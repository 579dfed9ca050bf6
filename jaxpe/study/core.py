"""Train short, test long: one small model per positional encoding, evaluated at 1x..8x its training length.

Every model is trained by ``jaxpe.trainer.train`` on the same data, seed, batch stream, budget and
architecture; only ``model.pos_encoding`` (and the emulation order) differ. The eval-time RoPE
scalings (linear interpolation, dynamic NTK, YaRN) reuse the plain ``rope`` model's weights and
change only ``rope_scaling`` at evaluation, as they are used in practice. Each model trains in its
own workdir ``<workdir>/models/<name>``, so the trainer's checkpoints make a killed study resume the
model it was training, and a finished model (``summary.json`` at ``num_steps``) is not trained again;
evaluations are cached next to the checkpoints (``eval_<name>.json``, keyed by everything they
depend on).

Evaluation (held-out bytes of ``jaxpe.data.load_corpus``): ``eval_windows`` windows W of
``M T + 1`` bytes (``jaxpe.data.eval_batches``; T the training length, M the largest multiple).
At multiple m each window is cut into ``M / m`` non-overlapping chunks of ``m T`` inputs (+ 1 target
byte), so every length scores exactly the same target bytes, each chunk starting from no context.
Per window, the mean next-byte cross-entropy over its ``M T`` targets is converted to bits/byte;
the table gives the mean over windows +- 1.96 standard errors (ddof 1) over the W windows. The
per-position curve at length ``m T`` is the mean loss (bits) at each position over all chunks.

Outputs in ``<workdir>``: ``study.md`` (table, settings, emulation check), ``study.json`` (every
number, per-window means and per-position curves), ``bits_per_byte.png`` (bits/byte against eval
length) and ``loss_vs_position.png``.

Sources: Press et al., "Train Short, Test Long" (ALiBi, arXiv 2108.12409); linear position
interpolation (Chen et al., arXiv 2306.15595); dynamic NTK (bloc97/emozilla 2023, HF
``_compute_dynamic_ntk_parameters``); YaRN (Peng et al., arXiv 2309.00071); xPos (arXiv 2212.10554).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
from flax import nnx

from jaxpe.bloom.convert import build_model, model_params
from jaxpe.emulation import core as emulation
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.model.encodings import emulation_theta
from jaxpe.ops.alibi import alibi_slopes_f64
from jaxpe.train import checkpoint, data, trainer
from jaxpe.train.config import TrainConfig, _merge, load_yaml_file, parse_overrides, with_data_path

__all__ = [
  "ENCODINGS",
  "Encoding",
  "StudyConfig",
  "StudyInterrupted",
  "eval_model_config",
  "evaluate",
  "load_study_config",
  "load_trained",
  "model_train_config",
  "run_study",
  "study_windows",
  "token_nll",
  "trained_params",
]


class StudyInterrupted(RuntimeError):
  """A model's training stopped before ``num_steps``; rerunning the study resumes it."""


@dataclass(frozen=True)
class Encoding:
  """One row of the study.

  ``model``: ModelConfig keys set for training (besides the shared architecture); ``base``: the
  encoding whose trained weights this row evaluates (itself when None); ``scaling``: the RoPE
  scaling applied only at evaluation (``linear``, ``dynamic`` or ``yarn``), at lengths above 1x.
  """

  label: str
  model: dict[str, Any] = field(default_factory=dict)
  base: str | None = None
  scaling: str | None = None


ENCODINGS: dict[str, Encoding] = {
  "none": Encoding("none (NoPE)", {"pos_encoding": "none"}),
  "learned": Encoding("learned", {"pos_encoding": "learned"}),
  "sinusoidal": Encoding("sinusoidal", {"pos_encoding": "sinusoidal"}),
  "rope": Encoding("rope", {"pos_encoding": "rope"}),
  "rope_linear": Encoding("rope + linear interpolation (eval)", base="rope", scaling="linear"),
  "rope_dynamic": Encoding("rope + dynamic NTK (eval)", base="rope", scaling="dynamic"),
  "rope_yarn": Encoding("rope + YaRN (eval)", base="rope", scaling="yarn"),
  "xpos": Encoding("xpos", {"pos_encoding": "xpos"}),
  "alibi": Encoding("alibi", {"pos_encoding": "alibi"}),
  "rope_alibi_k1": Encoding("rope_alibi k=1", {"pos_encoding": "rope_alibi", "rope_alibi_order": 1}),
  "rope_alibi_k2": Encoding("rope_alibi k=2", {"pos_encoding": "rope_alibi", "rope_alibi_order": 2}),
}
"""Study rows by name, in table order."""


class StudyConfig(pydantic.BaseModel):
  """A study: the shared training run (``train``), the encodings and the evaluation.

  ``train.workdir`` and ``train.model.pos_encoding`` are set per model (``<workdir>/models/<name>``);
  ``train.model.max_len`` is set to ``train.seq_len`` (the learned table covers the training length
  only) and ``rope_alibi_context`` to the longest eval length.
  """

  model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

  workdir: str = "runs/study"
  encodings: tuple[str, ...] = tuple(ENCODINGS)
  eval_multiples: tuple[int, ...] = (1, 2, 4, 8)
  eval_windows: int = pydantic.Field(32, gt=1, description="W held-out windows of the longest length")
  eval_batch_size: int = pydantic.Field(8, gt=0, description="chunks per evaluation forward pass")
  train: TrainConfig = TrainConfig()

  @pydantic.model_validator(mode="before")
  @classmethod
  def _lists_to_tuples(cls, raw: Any) -> Any:
    if isinstance(raw, dict):
      raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
      if isinstance(raw.get("train"), dict) and isinstance(raw["train"].get("mesh_shape"), list):
        raw["train"] = {**raw["train"], "mesh_shape": tuple(raw["train"]["mesh_shape"])}
    return raw

  @pydantic.model_validator(mode="after")
  def _check(self) -> StudyConfig:
    unknown = [e for e in self.encodings if e not in ENCODINGS]
    if unknown or not self.encodings or len(set(self.encodings)) != len(self.encodings):
      raise ValueError(f"encodings must be distinct names from {list(ENCODINGS)}, got {list(self.encodings)}")
    m = self.eval_multiples
    if not m or m[0] != 1 or any(b <= a or b % a for a, b in zip(m, m[1:])):
      raise ValueError(
        f"eval_multiples must start at 1, increase, and each divide the next (e.g. [1, 2, 4, 8]), got {list(m)}"
      )
    return self

  @property
  def longest(self) -> int:
    """Longest eval length in tokens (``max(eval_multiples) * train.seq_len``)."""
    return self.eval_multiples[-1] * self.train.seq_len


def load_study_config(
  path: str | Path, overrides: list[str] = (), *, data_path: str | None = None, unique_overrides: bool = False
) -> StudyConfig:
  """Reads a study YAML and applies ``key=value`` overrides (dotted keys, YAML values, e.g.
  ``train.num_steps=50`` or ``encodings=[rope,alibi]``) and ``data_path``.

  Args:
    path: the study YAML.
    overrides: ``key=value`` strings (``jaxpe.config.parse_overrides``), applied over the file.
    data_path: ``--data``: sets ``train.data.path`` verbatim (never YAML-parsed); cannot be combined
      with a ``train.data.path=`` override.
    unique_overrides: refuse a key given twice in ``overrides`` (the command line); else a later
      override replaces an earlier one.

  Raises:
    FileNotFoundError: ``path`` or ``data_path`` does not exist.
    ValueError: unknown keys, wrong types or values (pydantic's ``ValidationError``); a file that is
      not UTF-8, not valid YAML or gives a key twice (named with the line); a bad override.
  """
  raw = load_yaml_file(path, "study config")
  if isinstance(overrides, str):
    raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
  extra = parse_overrides(list(overrides), unique=unique_overrides)
  train_extra = extra.get("train") if isinstance(extra.get("train"), dict) else {}
  if data_path is not None and isinstance(train_extra.get("data"), dict) and "path" in train_extra["data"]:
    raise ValueError("--data and the override train.data.path= both set the data path; give one")
  raw = with_data_path(_merge(raw, extra), data_path, section=("train",))
  return StudyConfig.model_validate(raw)


def model_train_config(study: StudyConfig, name: str) -> TrainConfig:
  """The ``TrainConfig`` of encoding ``name`` (its base model for the eval-time scalings).

  Raises:
    KeyError: unknown name.
  """
  enc = ENCODINGS[name]
  name = enc.base or name
  raw = study.train.model_dump(mode="python")
  model = {**raw["model"], "max_len": study.train.seq_len, "rope_scaling": None, **ENCODINGS[name].model}
  if model["pos_encoding"] == "rope_alibi":
    model["rope_alibi_context"] = study.longest
  raw.update(model=model, workdir=str(Path(study.workdir) / "models" / name))
  return TrainConfig.model_validate(raw)


def eval_model_config(study: StudyConfig, name: str, multiple: int) -> ModelConfig | None:
  """The ``ModelConfig`` evaluating encoding ``name`` at ``multiple`` x the training length, or None
  where it cannot run (learned positions beyond their table).

  ``max_len`` becomes the eval length (it only sets xPos's offset, which cancels in q.k). Eval-time
  scalings at m > 1: ``linear`` factor m; ``dynamic`` factor 1 with the training length as
  ``original_max_position_embeddings`` (base x m^(R/(R-2)) at length m T); ``yarn`` factor m over the
  training length (HF defaults beta_fast 32, beta_slow 1, attention factor 0.1 ln m + 1). At 1x they
  are the plain rope model.
  """
  base = model_train_config(study, name).model
  length = multiple * study.train.seq_len
  if base.pos_encoding == "learned" and length > base.max_len:
    return None
  update: dict[str, Any] = {"max_len": max(length, base.max_len)}
  scaling = ENCODINGS[name].scaling
  if scaling is not None and multiple > 1:
    t = study.train.seq_len
    update["rope_scaling"] = {
      "linear": {"rope_type": "linear", "factor": float(multiple)},
      "dynamic": {"rope_type": "dynamic", "factor": 1.0, "original_max_position_embeddings": t},
      "yarn": {"rope_type": "yarn", "factor": float(multiple), "original_max_position_embeddings": t},
    }[scaling]
  return ModelConfig.model_validate({**base.model_dump(mode="python"), **update})


def trained_params(cfg: TrainConfig) -> dict[str, np.ndarray]:
  """The parameters (dotted path -> numpy array, as ``jaxpe.bloom.model_params``) of
  ``cfg.workdir``'s latest checkpoint; ``jaxpe.bloom.build_model(model_cfg, params)`` builds a model
  from them for any ``model_cfg`` with the same parameter shapes.

  Raises:
    FileNotFoundError: no checkpoint in ``cfg.workdir``.
  """
  tx = trainer.make_optimizer(cfg)

  def make():
    model = Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, state = nnx.split(nnx.eval_shape(make))  # shapes only: no initialisation, no compile
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)
  ckpt_dir = Path(cfg.workdir) / "checkpoints"
  if not ckpt_dir.is_dir():
    raise FileNotFoundError(f"no checkpoint in {cfg.workdir!r} (no directory {str(ckpt_dir)!r})")
  mngr = checkpoint.manager(ckpt_dir, read_only=True)  # reads only: a read-only directory works
  try:
    restored = checkpoint.restore_latest(mngr, target)
  finally:
    mngr.close()
  if restored is None:
    raise FileNotFoundError(f"no checkpoint in {cfg.workdir!r}")
  trained, _ = nnx.merge(graphdef, restored[0])
  return model_params(trained)


def load_trained(cfg: TrainConfig, model_cfg: ModelConfig | None = None) -> Decoder:
  """The ``Decoder`` of ``cfg.workdir``'s latest checkpoint built with ``model_cfg`` (default
  ``cfg.model``: same parameter shapes, e.g. another position encoding without parameters or another
  ``max_len`` for encodings without a table), with host-local weights.

  Raises:
    FileNotFoundError: no checkpoint in ``cfg.workdir``.
    jaxpe.bloom.CheckpointError: ``model_cfg`` has other parameters or shapes.
  """
  return build_model(model_cfg or cfg.model, trained_params(cfg))


def study_windows(study: StudyConfig) -> np.ndarray:
  """``[W, M T + 1]`` int32 held-out windows (W = ``eval_windows``, M T the longest eval length).

  Raises:
    ValueError: the held-out bytes hold fewer than W windows (``jaxpe.data.eval_batches``).
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


def evaluate(model: Decoder, windows: np.ndarray, length: int, batch_size: int) -> dict[str, Any]:
  """Bits/byte of ``model`` on ``windows [W, M T + 1]`` at eval length ``length``.

  Returns:
    ``{"bits_per_byte", "ci95", "per_window" [W], "per_position" [length]}``: the mean over windows,
    1.96 standard errors (ddof 1) of the per-window means, each window's mean over its targets, and
    the mean loss at each position over all chunks, all in bits/byte (Python floats).
  """
  fn = _jitted(model, token_nll)
  rows = chunks(windows, length)
  n = len(rows)
  padded = np.concatenate([rows, np.repeat(rows[:1], -n % batch_size, axis=0)])  # one batch shape
  nll = np.concatenate(
    [np.asarray(fn(jnp.asarray(padded[i : i + batch_size]))) for i in range(0, n, batch_size)]
  ).astype(np.float64)[:n]  # [W C, length]
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
      bound = emulation.emulation_error_bound(
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


def _key(*parts: Any) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _finished(cfg: TrainConfig) -> dict[str, Any] | None:
  """The run's ``summary.json`` when it reached ``num_steps``, else None."""
  path = Path(cfg.workdir) / "summary.json"
  summary = _read_json(path, "the model is resumed from its checkpoints, which rewrites it")
  if summary is None or not isinstance(summary.get("step"), int):
    return None
  length = summary.get("num_steps") or cfg.num_steps
  return summary if isinstance(length, int) and summary["step"] >= length else None


def _read_json(path: Path, then: str) -> dict[str, Any] | None:
  """The JSON object in ``path``; None when there is no file, or (with a warning naming the file, the
  reason and what happens ``then``) when it cannot be read or is not a JSON object."""
  if not path.is_file():
    return None
  try:
    value = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, ValueError) as e:
    print(
      f"[study] warning: cannot read {path} ({type(e).__name__}: {e}); {then}", file=sys.stderr, flush=True
    )
    return None
  if not isinstance(value, dict):
    print(f"[study] warning: {path} holds no JSON object; {then}", file=sys.stderr, flush=True)
    return None
  return value


def _write_atomic(path: Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def run_study(study: StudyConfig, *, progress: bool = True) -> dict[str, Any]:
  """Trains (or resumes) every model, evaluates every row and writes the outputs to ``study.workdir``.

  A model whose run reached ``train.num_steps`` is not trained again; an interrupted one resumes
  from its last checkpoint (``jaxpe.trainer.train``). Evaluations are cached per row in the model's
  workdir and recomputed only when the model, data, windows or eval lengths change.

  Returns:
    The ``study.json`` dict: ``results[name][str(multiple)]`` is an ``evaluate`` dict, or None where
    the row cannot run at that length; ``models[name]`` says whether it was trained in this process.

  Raises:
    StudyInterrupted: a model stopped before ``num_steps`` (``stop_at``, ``max_seconds``, a signal);
      nothing is evaluated or written, and a rerun resumes it.
    ValueError: held-out data too small for the windows, or any ``trainer.train`` error.
  """
  start = time.time()
  out = Path(study.workdir)
  out.mkdir(parents=True, exist_ok=True)
  windows = study_windows(study)
  results: dict[str, dict[str, Any]] = {}
  models: dict[str, dict[str, Any]] = {}
  for name in study.encodings:
    cfg = model_train_config(study, name)
    base = ENCODINGS[name].base or name
    if base not in models:
      summary = _finished(cfg)
      trained_now = summary is None
      if trained_now:
        print(f"[study] training {base} in {cfg.workdir}", flush=True)
        summary = trainer.train(cfg, progress=progress).__dict__
        length = summary.get("num_steps") or cfg.num_steps  # the schedule (fitted to max_seconds)
        if summary["step"] < length:
          raise StudyInterrupted(
            f"model {base!r} stopped at step {summary['step']} of {length}; rerun the same command to "
            f"resume it from {cfg.workdir}/checkpoints (stopped by stop_at, max_seconds or a signal)"
          )
      models[base] = {"trained_now": trained_now, **{k: v for k, v in summary.items() if k != "sample"}}
    cache_path = Path(cfg.workdir) / f"eval_{name}.json"
    key = _key(
      cfg.model_dump(mode="json"),
      models[base]["step"],
      hashlib.sha256(windows.tobytes()).hexdigest(),
      study.eval_multiples,
      ENCODINGS[name].scaling,
    )
    cached = _read_json(cache_path, "the row is evaluated again and the file rewritten") or {}
    if cached.get("key") == key and isinstance(cached.get("results"), dict):
      results[name] = cached["results"]
      continue
    row: dict[str, Any] = {}
    params = trained_params(cfg)
    for m in study.eval_multiples:
      mcfg = eval_model_config(study, name, m)
      if mcfg is None:
        row[str(m)] = None
        continue
      print(f"[study] evaluating {name} at {m}x ({m * study.train.seq_len} bytes)", flush=True)
      row[str(m)] = evaluate(
        build_model(mcfg, params), windows, m * study.train.seq_len, study.eval_batch_size
      )
    _write_atomic(cache_path, json.dumps({"key": key, "results": row}))
    results[name] = row
  emu = emulation_check(study, windows) if "alibi" in study.encodings else []
  ref = "rope" if "rope" in study.encodings else study.encodings[0]
  report = {
    "config": study.model_dump(mode="json"),
    "eval_lengths": [m * study.train.seq_len for m in study.eval_multiples],
    "models": models,
    "results": results,
    "paired_reference": ref,
    "paired": paired(results, ref),
    "emulation_check": emu,
    "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__} on "
    f"{jax.devices()[0].platform})",
    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    "wall_seconds_this_process": time.time() - start,
  }
  _write_atomic(out / "study.json", json.dumps(report, indent=1))
  _write_atomic(out / "study.md", markdown(study, report))
  plot_bits_per_byte(study, report, out / "bits_per_byte.png")
  plot_loss_vs_position(study, report, out / "loss_vs_position.png")
  return report


def cell(entry: dict[str, Any] | None, table_size: int | None = None, *, signed: bool = False) -> str:
  """A table cell: ``"mean ± ci95"`` (3 decimals; ``signed``: with a sign), or ``"n/a (table N)"``
  for a row that cannot run."""
  if entry is None:
    return f"n/a (table {table_size})" if table_size else "n/a"
  return f"{entry['bits_per_byte']:{'+' if signed else ''}.3f} ± {entry['ci95']:.3f}"


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
  steps = {b: r["step"] for b, r in report["models"].items()}
  data_desc = t.data.path or "the Python standard library sources"
  text = [
    "# Train short, test long",
    "",
    f"Held-out bits/byte (mean ± 1.96 standard errors over {study.eval_windows} held-out windows of "
    f"{study.longest} bytes; each length scores the same bytes, cut into chunks of that length, each chunk "
    f"starting without context). Trained on {data_desc} (max_bytes {t.data.max_bytes}) at length "
    f"{t.seq_len}: D {m.d_model}, {m.num_layers} layers, {m.num_heads} heads, batch {t.batch_size}, "
    f"{t.num_steps} steps, lr {t.learning_rate}, seed {t.seed}. The eval-time scalings reuse the rope "
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
      f"Paired difference from {ENCODINGS[ref].label} on the same windows (bits/byte, mean ± 1.96 standard "
      "errors of the per-window differences; negative is better). Pairing removes the variation in how "
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
