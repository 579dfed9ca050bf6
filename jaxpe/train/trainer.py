"""The training loop: config -> data -> sharded model and optimizer -> steps -> eval ->
checkpoints -> loss curve and sample. One readable path; ``train/train.py`` only parses arguments.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydantic
from flax import nnx
from jax.experimental import multihost_utils

from jaxpe.model import decoder as model_lib
from jaxpe.model.decoder import Decoder
from jaxpe.model.generate import generate
from jaxpe.train import checkpoint, data, pacing, run_guard, sharding, steps
from jaxpe.train.config import TrainConfig
from jaxpe.train.steps import decay_mask, next_token_loss

__all__ = [
  "TrainResult",
  "abstract_state",
  "create_state",
  "decay_mask",
  "make_optimizer",
  "next_token_loss",
  "train",
]

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
  """What a run reports at the end (also written to ``<workdir>/summary.json``).

  ``step``: optimizer steps done; ``train_loss``: last training loss (nats/token);
  ``eval_bits_per_byte`` and ``unigram_bits_per_byte``: held-out cross-entropy and the held-out
  unigram entropy (bits/byte); ``tokens_per_second``: training throughput of the last process that
  timed steps (first step of each process excluded); ``wall_seconds``: this process's wall time;
  ``sample``: prompt + generated text; ``num_steps``: the schedule's length (``cfg.num_steps``, or
  fewer when fitted to ``max_seconds``: see ``jaxpe.pacing``), the run is complete at that step.
  """

  step: int
  train_loss: float
  eval_bits_per_byte: float
  unigram_bits_per_byte: float
  tokens_per_second: float
  wall_seconds: float
  sample: str
  num_steps: int = 0


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """``jaxpe.steps.make_optimizer`` with the run's optimizer settings (``learning_rate``,
  ``num_steps``, ``warmup_steps``, ``min_lr_ratio``, ``weight_decay``, ``b1``, ``b2``, ``grad_clip``)."""
  return steps.make_optimizer(
    cfg.learning_rate,
    num_steps=cfg.num_steps,
    warmup_steps=cfg.warmup_steps,
    min_lr_ratio=cfg.min_lr_ratio,
    weight_decay=cfg.weight_decay,
    b1=cfg.b1,
    b2=cfg.b2,
    grad_clip=cfg.grad_clip,
  )


def _make(cfg: TrainConfig):
  model = Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
  return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)


def create_state(cfg: TrainConfig, mesh: jax.sharding.Mesh):
  """Builds model and optimizer directly into their shardings on ``mesh`` (``cfg.logical_rules``).

  Returns:
    ``(graphdef, state, shardings)``: the ``nnx.split`` of ``(Decoder, nnx.Optimizer)`` and the
    ``NamedSharding`` pytree of ``state`` (from the parameters' logical axis names).
  """
  model, optimizer = sharding.create_sharded(functools.partial(_make, cfg), mesh, cfg.logical_rules)
  graphdef, state = nnx.split((model, optimizer))
  return graphdef, state, sharding.state_shardings(state, mesh, cfg.logical_rules)


def abstract_state(cfg: TrainConfig, mesh: jax.sharding.Mesh):
  """``(graphdef, abstract_state)`` of ``create_state`` without computing anything: the leaves are
  ``jax.ShapeDtypeStruct`` with their ``NamedSharding`` on ``mesh`` (restore targets)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(functools.partial(_make, cfg)))
  shardings = sharding.state_shardings(abstract, mesh, cfg.logical_rules)
  return graphdef, checkpoint.abstract_with_shardings(abstract, shardings)


RUN_DEFINING_KEYS = ("model", "data", "seed", "seq_len", "batch_size")
"""Top-level config keys (and sections) that fix a run's parameters or batch stream: a resume must
not change them, except ``RESUME_CHANGEABLE`` (how the layers run: a checkpoint of the other
``scan_layers`` layout is converted on restore). Others (``num_steps``, ``max_seconds``, ``stop_at``, ``eval_every``,
``checkpoint_every``, ``sample_*``, the optimizer and ``mesh_shape``) may change."""
RESUME_CHANGEABLE = ("model.scan_layers", "model.remat", "data.allow_changed")
"""Keys under ``RUN_DEFINING_KEYS`` that a resume may change: how the layers are run (not their
parameters), and the permission to continue on changed data (``check_resume_data``)."""

PROCESS_LOCAL_KEYS = (
  "distributed.process_id",
  "distributed.coordinator_address",
  "distributed.enabled",
  "workdir",
  "data.path",
)
"""Config keys the processes of one run may hold differently: their own id, how each reaches the
coordinator, and paths (another host may mount the shared workdir or the data elsewhere; the
workdir is checked by a file, the data by its fingerprint)."""


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def check_resume_config(
  saved: str | dict[str, Any], cfg: TrainConfig, *, source: str = "config.json"
) -> None:
  """Compares a run's saved config (``config.json`` text or the dict a checkpoint's metadata
  carries) with ``cfg`` before resuming it.

  Raises:
    ValueError: a key under ``RUN_DEFINING_KEYS`` differs; the message names the dotted keys with
      both values, where the saved values come from (``source``) and suggests a new workdir; or
      the saved config is not a mapping.
  """
  try:
    text = saved if isinstance(saved, str) else json.dumps(saved)  # JSON mode: lists validate as tuples
    saved = TrainConfig.model_validate_json(text).model_dump(mode="json")
  except pydantic.ValidationError:  # written by another version of the schema: compare as saved
    saved = json.loads(saved) if isinstance(saved, str) else saved
    if not isinstance(saved, dict):
      raise ValueError(
        f"the config saved in {source} is not a mapping (got {type(saved).__name__}); it cannot be "
        "checked against this run: use a new workdir"
      ) from None
  old, new = _flatten(saved), _flatten(cfg.model_dump(mode="json"))
  differing = sorted(
    k
    for k in old.keys() | new.keys()
    if k.split(".")[0] in RUN_DEFINING_KEYS and k not in RESUME_CHANGEABLE and old.get(k) != new.get(k)
  )
  if differing:
    detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differing)
    raise ValueError(
      f"cannot resume {cfg.workdir!r} with a different model, data or batch stream ({detail}, saved in "
      f"{source}); these keys are fixed for a run: use a new workdir (or the saved values)"
    )


def check_resume_data(meta: dict[str, Any], fingerprint: dict[str, Any], cfg: TrainConfig) -> None:
  """Compares the data fingerprint a checkpoint's metadata carries (``data.fingerprint`` of the
  run that wrote it) with this run's, before resuming.

  A checkpoint without one (written before fingerprints) is not checked.

  Raises:
    ValueError: the fingerprints differ (the data's bytes or file list changed) and
      ``cfg.data.allow_changed`` is false; one line naming the data, both fingerprints and sizes,
      and the override.
  """
  saved = meta.get("data_fingerprint")
  if not isinstance(saved, dict) or saved.get("sha256") == fingerprint["sha256"]:
    return
  where = cfg.data.path or "the Python standard library"

  def describe(fp):
    return (
      f"{fp.get('train_bytes', '?')} training + {fp.get('eval_bytes', '?')} held-out bytes from "
      f"{fp.get('files', '?')} file(s), fingerprint {str(fp.get('sha256'))[:12]}"
    )

  detail = f"data {where!r} now gives {describe(fingerprint)}; the checkpoint of step {meta.get('step')} was trained on {describe(saved)}"
  if not cfg.data.allow_changed:
    raise ValueError(
      f"cannot resume {cfg.workdir!r} on changed data: {detail}. Restore that data, or set "
      "data.allow_changed=true to continue on the new data (the later batches then differ from the saved run's)"
    )
  log.warning("resuming on changed data (data.allow_changed=true): %s", detail)


def _config_hash(value: Any) -> np.int32:
  text = json.dumps(value, sort_keys=True)
  return np.int32(int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little", signed=True))


def check_processes_agree(cfg: TrainConfig, fingerprint: dict[str, Any]) -> None:
  """In a multi-process run, checks that every process holds the same config (all keys but
  ``PROCESS_LOCAL_KEYS``) and the same data (``fingerprint``'s ``sha256``): each process gathers a
  hash of each key's value from all processes (``multihost_utils.process_allgather``). Every
  process makes the same comparison, so all refuse together. A no-op with one process.

  Raises:
    ValueError: one line naming the differing keys, with this process's values.
  """
  if jax.process_count() == 1:
    return
  flat = {k: v for k, v in _flatten(cfg.model_dump(mode="json")).items() if k not in PROCESS_LOCAL_KEYS}
  flat["data fingerprint"] = fingerprint["sha256"]
  keys = sorted(flat)
  me, n = jax.process_index(), jax.process_count()
  schemas = multihost_utils.process_allgather(np.array([_config_hash(keys)], np.int32))
  if not np.all(schemas == schemas[0]):
    raise ValueError(
      f"the {n} processes of this run have different config keys (another jaxpe version on some host); "
      "run the same version everywhere"
    )
  hashes = multihost_utils.process_allgather(np.array([_config_hash(flat[k]) for k in keys], np.int32))
  differing = [k for i, k in enumerate(keys) if not np.all(hashes[:, i] == hashes[0, i])]
  if differing:
    here = ", ".join(
      f"{k}={flat[k]!r}"
      if k != "data fingerprint"
      else f"data {cfg.data.path or 'stdlib'!r} with fingerprint "
      f"{flat[k][:12]} ({fingerprint['train_bytes']} training + {fingerprint['eval_bytes']} held-out bytes)"
      for k in differing
    )
    others = sorted(
      {p for k in differing for p in range(n) if hashes[p, keys.index(k)] != hashes[me, keys.index(k)]}
    )
    raise ValueError(
      f"the processes of this run disagree on {', '.join(differing)} (process {me} has {here}; processes "
      f"{others} differ): start every process with the same config (only distributed.process_id differs)"
    )


SHARED_CHECK_FILE = ".jaxpe-shared-check"
"""The file process 0 writes into the workdir for the others to read (``check_shared_workdir``)."""


RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png")
"""The files a run writes at the top of its workdir (besides ``checkpoints/``), replacing them."""


def check_workdir_is_ours(workdir: Path) -> None:
  """Refuses a ``workdir`` that a run would damage: a path that exists and is not a directory, or a
  directory holding files a run writes (``RUN_FILES``) but no run of jaxpe (neither a
  ``checkpoints/`` folder nor a ``config.json`` holding a jaxpe config): the user's own files there
  would be overwritten. Any other existing directory is used as it is (its other files are kept).

  Raises:
    ValueError: naming ``workdir``, the files at risk and what to do.
  """
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"workdir {str(workdir)!r} exists and is not a directory: choose a directory")
  for parent in workdir.absolute().parents:
    if parent.exists() and not parent.is_dir():
      raise ValueError(f"workdir {str(workdir)!r}: its parent {str(parent)!r} is a file, not a directory")
  if not workdir.is_dir() or (workdir / "checkpoints").is_dir():
    return
  present = [name for name in RUN_FILES if (workdir / name).exists()]
  if not present:
    return
  saved = _read_saved_config(workdir / "config.json") if "config.json" in present else None
  if saved is not None and {"model", "seed", "seq_len"} <= set(json.loads(saved)):
    return  # a run that stopped before its first checkpoint
  raise ValueError(
    f"workdir {str(workdir)!r} holds {', '.join(present)} but no jaxpe run (no checkpoints/, no jaxpe "
    "config.json): a run would overwrite them; choose another workdir or move those files"
  )


def check_shared_workdir(workdir: Path) -> None:
  """In a multi-process run, checks that every process sees the same workdir: process 0 writes a
  random token to ``<workdir>/.jaxpe-shared-check``, broadcasts it, every process reads the file
  back, and all gather the results. A no-op with one process.

  Raises:
    ValueError: naming the workdir and the processes that do not see process 0's file.
  """
  if jax.process_count() == 1:
    return
  path = workdir / SHARED_CHECK_FILE
  token = secrets.randbelow(2**31 - 1) + 1
  if jax.process_index() == 0:
    _write_atomic(path, str(token))
  token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))  # after process 0 wrote it
  try:
    seen = path.read_text().strip() == str(token)
  except (OSError, UnicodeDecodeError):
    seen = False
  seen_by = multihost_utils.process_allgather(np.bool_(seen))
  if jax.process_index() == 0:
    path.unlink(missing_ok=True)
  if not np.all(seen_by):
    missing = [int(p) for p in np.flatnonzero(~np.asarray(seen_by, bool))]
    raise ValueError(
      f"workdir {str(workdir)!r} is not shared: process(es) {missing} do not see the file process 0 wrote "
      f"there ({SHARED_CHECK_FILE}); every process of a run needs the same workdir (on a disk all hosts see)"
    )


def _read_saved_config(path: Path) -> str | None:
  """``config.json``'s text, or None (with a warning) when it is missing or is not a JSON object
  (bytes that are not UTF-8, a syntax error, a list...): the checkpoints' metadata carries the same
  keys, so a damaged file never blocks a resume."""
  if not path.is_file():
    return None
  try:
    text = path.read_bytes().decode()
    if not isinstance(json.loads(text), dict):
      raise ValueError("not a JSON object")
  except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
    log.warning(
      "ignoring %s: it is not a valid JSON object (%s); the run is checked against its checkpoint instead",
      path,
      e,
    )
    return None
  return text


def _write_atomic(path: Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def _read_metrics(path: Path) -> list[dict[str, Any]]:
  """The records of ``metrics.jsonl``; lines that do not parse as a record with a step (a torn
  write, an edit) are skipped with a warning naming the file and line."""
  if not path.is_file():
    return []
  records = []
  for number, line in enumerate(_read_lines(path), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if _is_metrics_record(record):
        records.append(record)
        continue
    except json.JSONDecodeError:
      pass
    log.warning("%s line %d is not a metrics record; skipped: %.80r", path, number, line)
  return records


def _read_lines(path: Path) -> list[str]:
  """The lines of a text file the trainer wrote; bytes that are not UTF-8 (damage) become U+FFFD."""
  return path.read_bytes().decode(errors="replace").splitlines()


def _is_number(x: Any) -> bool:
  return isinstance(x, int | float) and not isinstance(x, bool)


def _is_metrics_record(record: Any) -> bool:
  """A dict with an integer ``step``, a numeric ``loss``, and numbers for the other keys read back
  (``eval_bits_per_byte``, ``tokens_per_second``) where present."""
  return (
    isinstance(record, dict)
    and isinstance(record.get("step"), int)
    and not isinstance(record["step"], bool)
    and _is_number(record.get("loss"))
    and all(_is_number(record[k]) for k in ("eval_bits_per_byte", "tokens_per_second") if k in record)
  )


def _truncate_metrics(path: Path, step: int) -> list[dict[str, Any]]:
  """Drops records after ``step`` (written after the last checkpoint by a crashed process) and lines
  that do not parse."""
  lines = _read_lines(path) if path.is_file() else []
  records = _read_metrics(path)
  kept = [r for r in records if r["step"] <= step]
  if len(kept) != len([line for line in lines if line.strip()]) or not path.is_file():
    _write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
  return kept


def _nonfinite_reason(state: Any) -> str | None:
  """Restore check: a reason when ``state`` holds a NaN or infinity (written by an older version).

  Checked on the host, shard by shard (each process its own shards, then the processes agree), with
  no XLA computation: eager per-leaf reductions on sharded arrays dispatch one small SPMD program
  with an all-reduce per leaf, and on the CPU runtime such a queue of asynchronous collective
  programs deadlocked (one device's launch waited on the in-flight limit while the other devices
  waited in the all-reduce; XLA aborted after 40 s)."""
  finite = True
  for x in jax.tree.leaves(state):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    shards = [s.data for s in x.addressable_shards] if isinstance(x, jax.Array) else [x]
    finite = finite and all(bool(np.isfinite(np.asarray(d)).all()) for d in shards)
  if jax.process_count() > 1:  # every process decides alike (the same step is used or moved aside)
    finite = bool(np.all(multihost_utils.process_allgather(np.bool_(finite))))
  return None if finite else "it holds non-finite values"


def train(cfg: TrainConfig, *, progress: bool = True) -> TrainResult:
  """Trains (or resumes) the run described by ``cfg`` in ``cfg.workdir``.

  Rerunning with the same workdir resumes from the newest intact checkpoint with the same batches;
  a run at or past ``stop_at`` (or ``num_steps``) does no steps and only reports. ``metrics.jsonl``
  keeps one record per step (records after the restored step are dropped). Tokens/s exclude each
  process's first step (compilation). What a run guarantees (locking, signals, non-finite steps,
  damaged files) is described in docs/training.md.

  Raises:
    ValueError: resuming with changed run-defining keys (``check_resume_config``, against
      ``config.json`` and the checkpoint's metadata) or on changed data (``check_resume_data``,
      unless ``data.allow_changed``), data too small for ``seq_len``/``batch_size``, sizes that do
      not divide the mesh; distributed settings that cannot form a job
      (``sharding.initialize_distributed``); processes that disagree on the config or the data
      (``check_processes_agree``) or do not share the workdir (``check_shared_workdir``).
    ConnectionError: JAX could not initialise the multi-process runtime.
    FileNotFoundError: ``cfg.data.path`` does not exist.
    run_guard.WorkdirInUseError: another live trainer holds the workdir.
    run_guard.NonFiniteError: a step's loss, gradient norm or update was non-finite more than
      ``cfg.skip_nonfinite`` times; nothing non-finite was applied or saved.
    run_guard.TrainingInterrupted: SIGTERM/SIGINT (to any process of a multi-process run: all
      stop after the same step); a checkpoint of the current step was written.
    checkpoint.CheckpointError: checkpoints cannot be written, or none of the saved ones is intact.
  """
  start = time.time()
  sharding.initialize_distributed(cfg.distributed)  # a no-op for single-process runs
  check_workdir_is_ours(Path(cfg.workdir))  # before any data is read or anything written
  corpus = data.load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction)
  if progress and jax.process_index() == 0:
    print(corpus.describe(), flush=True)  # which files (and bytes) went to each side, what was skipped
  fingerprint = data.fingerprint(corpus)
  check_processes_agree(cfg, fingerprint)  # before any process writes anything
  workdir = Path(cfg.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  check_shared_workdir(workdir)
  # The processes of a multi-process run share the workdir: process 0 holds its lock.
  lock = run_guard.workdir_lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  with lock, run_guard.stop_signals() as stop:
    saved_config = _read_saved_config(workdir / "config.json")
    ckpt_dir = workdir / "checkpoints"
    if saved_config is not None and ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
      check_resume_config(saved_config, cfg, source=str(workdir / "config.json"))  # before anything is loaded
    # Closing the manager waits for a pending asynchronous save, whichever way the run ends.
    with checkpoint.manager(
      ckpt_dir, max_to_keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoints
    ) as mngr:
      return _train(
        cfg, workdir, mngr, stop, saved_config, corpus, fingerprint, progress=progress, start=start
      )


def _saved_layout(meta: dict[str, Any], saved_config: str | None, cfg: TrainConfig) -> bool:
  """``model.scan_layers`` of the run that wrote a checkpoint: from its metadata, else from the
  saved ``config.json``, else the current config's."""
  if isinstance(meta.get("config"), dict):
    return bool(meta["config"].get("model", {}).get("scan_layers", False))
  if saved_config is not None:
    return bool(json.loads(saved_config).get("model", {}).get("scan_layers", False))
  return cfg.model.scan_layers


def _agree_on_stop(stop: run_guard.StopRequest) -> bool:
  """True when any process received SIGTERM/SIGINT, so that all processes of a multi-process run
  stop after the same step. The decision rests only on the gathered values (all processes decide
  alike); a signal that arrives during the gather is seen at the next call. A process keeps its
  own signal (its exit status); one that received none takes the first other process's
  (``stop.from_process`` names it)."""
  if jax.process_count() == 1:
    return stop.signum is not None
  signums = np.asarray(multihost_utils.process_allgather(np.int32(stop.signum or 0))).ravel()
  senders = np.flatnonzero(signums)
  if senders.size == 0:
    return False
  if stop.signum is None:  # never overwrite this process's own signal
    stop.signum, stop.from_process = int(signums[senders[0]]), int(senders[0])
  return True


def _train(
  cfg,
  workdir: Path,
  mngr,
  stop: run_guard.StopRequest,
  saved_config: str | None,
  corpus: data.Corpus,
  fingerprint: dict[str, Any],
  *,
  progress: bool,
  start: float,
) -> TrainResult:
  """The body of ``train`` once the workdir is locked and the checkpoint manager open."""
  config_path, ckpt_dir = workdir / "config.json", workdir / "checkpoints"
  primary = jax.process_index() == 0  # writes config.json, metrics, plot, summary; prints
  progress = progress and primary

  eval_set = data.eval_batches(
    corpus.eval, batch_size=cfg.batch_size, seq_len=cfg.seq_len, num_batches=cfg.eval_batches
  )
  unigram = data.unigram_bits_per_byte(np.concatenate([b[:, 1:].ravel() for b in eval_set]))

  mesh = sharding.make_mesh(cfg.mesh_shape)
  micro_batch = cfg.batch_size // cfg.grad_accum_steps
  sharding.check_divisible(cfg.model, mesh, micro_batch, seq_len=cfg.seq_len, rules=cfg.logical_rules)
  batch_sharding = sharding.batch_sharding(mesh, cfg.logical_rules)
  graphdef, state, state_shardings = create_state(cfg, mesh)

  def check_meta(meta):
    if "config" in meta:
      check_resume_config(meta["config"], cfg, source=f"the checkpoint of step {meta['step']}")
    check_resume_data(meta, fingerprint, cfg)

  def restore_target(meta):  # in the layer layout the checkpoint was written in
    saved_scan = _saved_layout(meta, saved_config, cfg)
    if saved_scan == cfg.model.scan_layers:
      return checkpoint.abstract_with_shardings(state, state_shardings)
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"scan_layers": saved_scan})})
    return abstract_state(other, mesh)[1]

  step, skipped = 0, 0
  schedule_steps, fitted = cfg.num_steps, False  # the schedule's length; fitted to max_seconds once
  restored = checkpoint.restore_latest(
    mngr, restore_target, check_meta=check_meta, check_state=_nonfinite_reason
  )
  if restored is not None:
    saved, meta = restored
    if _saved_layout(meta, saved_config, cfg) != cfg.model.scan_layers:  # loop <-> scanned layers
      convert = model_lib.to_scan_layout if cfg.model.scan_layers else model_lib.to_loop_layout
      # One jitted program into the target shardings (not eager per-leaf stacking on sharded arrays).
      convert = jax.jit(convert, out_shardings=nnx.to_pure_dict(state_shardings))
      nnx.replace_by_pure_dict(state, convert(nnx.to_pure_dict(saved)))
      saved = state
    state = saved
    step, skipped = int(meta["data_position"]), int(meta.get("skipped_steps", 0))
    schedule_steps, fitted = _resumed_schedule(meta, cfg)
    if primary:
      print(f"resumed from {ckpt_dir} at step {step} (schedule of {schedule_steps} steps)")
  if schedule_steps != cfg.num_steps:
    graphdef = _with_schedule(graphdef, state, cfg, schedule_steps)
  if jax.process_count() > 1:  # every process has read the saved config before process 0 rewrites it
    multihost_utils.sync_global_devices("jaxpe: restored")
  metrics_path = workdir / "metrics.jsonl"
  previous = []
  if primary:
    _write_atomic(config_path, cfg.model_dump_json(indent=2))  # only once the restore succeeded
    previous = _truncate_metrics(metrics_path, step)

  placement = dict(
    mesh=mesh, rules=cfg.logical_rules, state_shardings=state_shardings, batch_sharding=batch_sharding
  )

  def make_train_step(graphdef):  # again when the schedule is fitted (the optimizer is in graphdef)
    # A non-finite step is not applied: the state stays the last finite one (never saved otherwise).
    return steps.make_train_step(
      graphdef, grad_accum_steps=cfg.grad_accum_steps, loss_fn=next_token_loss, **placement
    )

  train_step = make_train_step(graphdef)
  eval_step = steps.make_eval_step(graphdef, loss_fn=next_token_loss, **placement)

  def evaluate(state) -> float:
    # One program in flight at a time (each loss is fetched before the next batch is dispatched).
    losses = [
      float(eval_step(state, sharding.global_batch(b.__getitem__, batch_sharding, b.shape))) for b in eval_set
    ]
    return data.bits_per_byte(float(np.mean(losses)))

  def save(state, step):
    meta = {
      "step": step,
      "data_position": step,
      "skipped_steps": skipped,
      "config": cfg.model_dump(mode="json"),
      "schedule_steps": schedule_steps,
      "schedule_fitted": fitted,
      "data_fingerprint": fingerprint,
    }
    checkpoint.save(mngr, step, state, meta)

  target = schedule_steps if cfg.stop_at is None else min(schedule_steps, cfg.stop_at)
  tokens_per_step = cfg.batch_size * cfg.seq_len
  loss = previous[-1]["loss"] if previous else float("nan")
  eval_bpb, timed_tokens, timed_seconds, process_steps = float("nan"), 0, 0.0, 0
  first_dt, compiled = 0.0, False
  bar = pacing.Progress(schedule_steps, step, enabled=progress)
  metrics_file = metrics_path.open("a") if primary else open(os.devnull, "w")
  with bar, metrics_file:  # the bar ends its line before any error
    stopped = False
    while step < target:
      if _agree_on_stop(stop):
        stopped = True
        break
      batch = sharding.global_batch(  # each process builds only its rows of the global batch
        lambda rows, step=step: data.train_batch(
          corpus.train, step=step, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=cfg.seq_len, rows=rows
        ),
        batch_sharding,
        (cfg.batch_size, cfg.seq_len + 1),
      )
      t0 = time.time()
      state, out = train_step(state, batch)
      loss = float(out["loss"])  # waits for the step
      dt = time.time() - t0
      step += 1
      process_steps += 1
      if compiled:  # the first step of every process (and the first after a fit) includes compilation
        timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + dt
      else:
        first_dt, compiled = first_dt or dt, True
      tok_s = timed_tokens / timed_seconds if timed_seconds else 0.0
      record = {"step": step, "loss": loss, "grad_norm": float(out["grad_norm"]), "tokens_per_second": tok_s}
      if not fitted and cfg.max_seconds is not None and process_steps == FIT_AFTER_STEPS + 1:
        fitted, step_s = True, timed_seconds / FIT_AFTER_STEPS
        new_steps = _fit_schedule(cfg, step, schedule_steps, start, step_s, first_dt)
        if jax.process_count() > 1:  # the processes' timings differ: all run process 0's schedule
          new_steps = int(multihost_utils.broadcast_one_to_all(np.int32(new_steps)))
        if new_steps < schedule_steps:
          bar.write(
            f"step {step}: {step_s:.2f} s/step leaves room for {new_steps} of the {schedule_steps} steps in "
            f"max_seconds={cfg.max_seconds:g}: the schedule (warmup {cfg.warmup_steps}, cosine decay) now "
            f"ends at step {new_steps}"
            + ("" if step <= cfg.warmup_steps else " (fitted after the warmup: the decay so far differs)")
          )
          schedule_steps = new_steps
          graphdef = _with_schedule(graphdef, state, cfg, schedule_steps)
          train_step, compiled = make_train_step(graphdef), False
          target = schedule_steps if cfg.stop_at is None else min(schedule_steps, cfg.stop_at)
          bar.set_total(schedule_steps)
        record["schedule_steps"] = schedule_steps
      if not bool(out["finite"]):
        skipped += 1
        record.update(skipped=True, param_norm=float(out["param_norm"]))
        if skipped > cfg.skip_nonfinite:
          metrics_file.write(json.dumps(record) + "\n")
          raise run_guard.NonFiniteError(_nonfinite_message(record, skipped, cfg, mngr))
        bar.write(f"step {step}: non-finite step, update skipped ({skipped} of {cfg.skip_nonfinite})")
      out_of_time = cfg.max_seconds is not None and time.time() - start > cfg.max_seconds
      if cfg.max_seconds is not None and jax.process_count() > 1:  # all stop at the same step
        out_of_time = bool(np.any(multihost_utils.process_allgather(np.bool_(out_of_time))))
      last = step == target or out_of_time
      if step % cfg.eval_every == 0 or last:
        eval_bpb = evaluate(state)
        record["eval_bits_per_byte"] = eval_bpb
        bar.write(f"step {step}: held-out {eval_bpb:.3f} bits/byte (unigram {unigram:.3f})")
      if primary:
        run_guard.check_workdir_intact(workdir, metrics_file, step)  # deleted or moved: stop, saving nothing
      metrics_file.write(json.dumps(record) + "\n")
      metrics_file.flush()
      bar.update(step, loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
      if step % cfg.checkpoint_every == 0 or last:
        save(state, step)
      if out_of_time:
        break
  if stopped or _agree_on_stop(stop):  # all processes reach this check at the same step
    if mngr.latest_step() != step:
      save(state, step)
    checkpoint.finish(mngr)  # the asynchronous save is on disk before the process exits
    raise run_guard.TrainingInterrupted(
      f"stopped by {stop.name}{stop.origin} at step {step}; checkpoint saved in {ckpt_dir}: rerun the same command to resume",
      signum=stop.signum,
      step=step,
    )
  checkpoint.finish(mngr)  # the last (asynchronous) save is complete before the run reports
  if step < schedule_steps and primary:
    print(f"stopped at step {step} of {schedule_steps}; rerun with the same workdir to resume")

  sample = ""
  if cfg.sample_len:  # generated on process 0 from a host copy of the (gathered) state
    # Host copies: generation runs eagerly, and eager ops on sharded arrays dispatch collective programs.
    local = (
      jax.device_get(state)
      if jax.process_count() == 1
      else multihost_utils.process_allgather(state, tiled=True)
    )
    if primary:
      model, _ = nnx.merge(graphdef, local)
      sample = sample_text(model, cfg.sample_prompt, cfg.sample_len, seed=cfg.seed)
  final_eval = eval_bpb if not math.isnan(eval_bpb) else evaluate(state)
  if not primary:
    return TrainResult(step, loss, final_eval, unigram, 0.0, time.time() - start, sample, schedule_steps)
  plot_loss_curve(metrics_path, workdir / "loss.png", unigram)
  if timed_seconds:
    tokens_per_second = timed_tokens / timed_seconds
  else:  # this process timed no step (none, or only the compiling one): keep the run's last figure
    records = reversed(_read_metrics(metrics_path))
    tokens_per_second = next((r["tokens_per_second"] for r in records if r.get("tokens_per_second")), 0.0)
  result = TrainResult(
    step=step,
    train_loss=loss,
    eval_bits_per_byte=final_eval,
    unigram_bits_per_byte=unigram,
    tokens_per_second=tokens_per_second,
    wall_seconds=time.time() - start,
    sample=sample,
    num_steps=schedule_steps,
  )
  _write_atomic(workdir / "summary.json", json.dumps(result.__dict__, indent=2))
  return result


FIT_AFTER_STEPS = 5
"""Timed steps (after each process's compiling first step) before the schedule is fitted to
``max_seconds``; within the default warmup, where the schedule does not depend on its length."""


def _fit_schedule(
  cfg: TrainConfig, step: int, schedule_steps: int, start: float, step_s: float, first_dt: float
) -> int:
  """The schedule length that ends within ``cfg.max_seconds`` of ``start`` (``pacing.fit_num_steps``
  with this run's measured step time and estimates of evaluation, checkpoint, compile and sample)."""
  compile_s = max(first_dt - step_s, 0.0)
  costs = pacing.StepCosts(step=step_s, compile=compile_s, eval=cfg.eval_batches * step_s / 3, save=1.0)
  return pacing.fit_num_steps(
    step=step,
    num_steps=schedule_steps,
    warmup_steps=cfg.warmup_steps,
    seconds_left=cfg.max_seconds - (time.time() - start),
    costs=costs,
    eval_every=cfg.eval_every,
    checkpoint_every=cfg.checkpoint_every,
    fixed_seconds=1.5 * compile_s if cfg.sample_len else 0.5 * compile_s,  # eval compile, sample
  )


def _with_schedule(graphdef, state, cfg: TrainConfig, num_steps: int):
  """``graphdef`` whose optimizer runs the schedule of ``num_steps`` steps (same state layout)."""
  model, optimizer = nnx.merge(graphdef, state)
  optimizer.tx = make_optimizer(cfg.model_copy(update={"num_steps": num_steps}))
  return nnx.graphdef((model, optimizer))


def _resumed_schedule(meta: dict[str, Any], cfg: TrainConfig) -> tuple[int, bool]:
  """(schedule length, already fitted) to continue a checkpoint with: the saved schedule unless the
  configured ``num_steps`` changed since (then ``cfg.num_steps``, to be fitted again)."""
  saved_num_steps = meta.get("config", {}).get("num_steps")
  if "schedule_steps" in meta and saved_num_steps == cfg.num_steps:
    return int(meta["schedule_steps"]), bool(meta.get("schedule_fitted", False))
  return cfg.num_steps, False


def _nonfinite_message(record: dict[str, Any], skipped: int, cfg: TrainConfig, mngr) -> str:
  last = mngr.latest_step()
  good = (
    f"the last good checkpoint is step {last} in {mngr.directory}"
    if last is not None
    else "no checkpoint yet"
  )
  allowed = (
    f" ({skipped} non-finite steps, skip_nonfinite={cfg.skip_nonfinite})" if cfg.skip_nonfinite else ""
  )
  return (
    f"non-finite training step {record['step']}{allowed}: loss {record['loss']}, gradient norm "
    f"{record['grad_norm']}, parameter norm after the update {record['param_norm']}; the update was not "
    f"applied and nothing was saved; {good}. Lower "
    "learning_rate (or set skip_nonfinite=N to skip such batches) and rerun with the same workdir to resume"
  )


def sample_text(model: Decoder, prompt: str, length: int, *, seed: int, temperature: float = 0.8) -> str:
  """``prompt`` followed by up to ``length`` generated bytes (sampled at ``temperature``, top-k 40),
  decoded as UTF-8 with replacement characters. Any model configuration (loop or ``scan_layers``,
  any ``remat``) samples: ``jaxpe.generate.generate`` runs them all.

  With learned positions (``max_len``) and ``rope_alibi`` (``rope_alibi_context``, default
  ``max_len``) the sample is clipped so prompt + sample fit the context the model can serve.

  Raises:
    ValueError: an empty prompt, or a prompt that fills that context.
  """
  tokens = list(prompt.encode())
  if not tokens:
    raise ValueError("sample_prompt must hold at least one byte")
  cfg = model.cfg
  limits = {
    "learned": ("max_len", cfg.max_len),
    "rope_alibi": ("rope_alibi_context", cfg.rope_alibi_context or cfg.max_len),
  }
  if cfg.pos_encoding in limits:
    name, limit = limits[cfg.pos_encoding]
    length = min(length, limit - len(tokens))
    if length <= 0:
      raise ValueError(
        f"sample_prompt is {len(tokens)} bytes; pos_encoding={cfg.pos_encoding!r} leaves no room in {name} "
        f"({limit}) for a sample"
      )
  out = generate(
    model,
    jnp.asarray([tokens], jnp.int32),
    max_new_tokens=length,
    temperature=temperature,
    top_k=min(40, cfg.vocab_size),
    rng=jax.random.key(seed),
  )
  return prompt + bytes(np.asarray(out[0], np.uint8)).decode("utf-8", errors="replace")


def plot_loss_curve(metrics_path: Path, out_path: Path, unigram: float) -> None:
  """Plots training and held-out bits/byte (from ``metrics.jsonl`` at ``metrics_path``) against
  step, with the unigram entropy ``unigram`` (bits/byte) for reference, to the PNG ``out_path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = _read_metrics(metrics_path)
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
