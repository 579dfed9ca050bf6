"""Checks before a run starts or resumes: the workdir is a jaxpe run's (or new), a resume keeps the
run-defining config and data, and the processes of a multi-process run agree on the config and the
data and share the workdir. Each check raises one ``ValueError`` line naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pydantic
from jax.experimental import multihost_utils

from jaxpe.train import run_files, run_guard
from jaxpe.train.config import TrainConfig

__all__ = [
  "PATH_KEYS",
  "PROCESS_LOCAL_KEYS",
  "RESUME_CHANGEABLE",
  "RUN_DEFINING_KEYS",
  "SHARED_CHECK_FILE",
  "check_processes_agree",
  "check_resume_config",
  "check_resume_data",
  "check_shared_workdir",
  "check_workdir_is_ours",
  "config_differences",
  "unapplied_settings",
]

log = logging.getLogger(__name__)


RUN_DEFINING_KEYS = ("model", "data", "seed", "seq_len", "batch_size", "init_from")
"""Top-level config keys (and sections) that fix a run's parameters or batch stream (``init_from``: the
run its parameters started from; a config saved without it read as None): a resume must
not change them, except ``RESUME_CHANGEABLE`` (how the layers run: a checkpoint of the other
``scan_layers`` layout is converted on restore). Others (``num_steps``, ``max_seconds``, ``stop_at``, ``eval_every``,
``checkpoint_every``, ``sample_*``, the optimizer and ``mesh_shape``) may change."""
PATH_KEYS = ("init_from", "data.path", "data.tokens", "data.tokenizer")
"""Keys under ``RUN_DEFINING_KEYS`` that hold paths: a resume compares them as the file or directory
they name (``os.path.realpath``), not as strings (the data's bytes are checked by its fingerprint)."""

RESUME_CHANGEABLE = (
  "model.scan_layers",
  "model.remat",
  "model.context_attention",
  "data.allow_changed",
  "data.loader",
  "data.grain_workers",
)
"""Keys under ``RUN_DEFINING_KEYS`` that a resume may change: how the layers are run (loop or
scanned, rematerialised, attention across the context axis by all-gather or ring: not their
parameters), the permission to continue on changed data (``check_resume_data``), and the loader
(numpy or grain: the same batches)."""

PROCESS_LOCAL_KEYS = (
  "distributed.process_id",
  "distributed.coordinator_address",
  "distributed.enabled",
  "workdir",
  "data.path",
  "data.tokens",
  "data.tokenizer",
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


def _compared(
  saved: str | dict[str, Any], cfg: TrainConfig, source: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, bool]]:
  """The saved config and ``cfg`` flattened to dotted keys, and whether each key is the same (paths
  compared as the file they name).

  Raises:
    ValueError: the saved config is not a mapping.
  """
  try:
    text = saved if isinstance(saved, str) else run_files.json_text(saved)  # JSON mode: lists as tuples
    saved = TrainConfig.model_validate_json(text).model_dump(mode="json")
  except pydantic.ValidationError:  # written by another version of the schema: compare as saved
    saved = json.loads(saved) if isinstance(saved, str) else saved
    if not isinstance(saved, dict):
      raise ValueError(
        f"the config saved in {source} is not a mapping (got {type(saved).__name__}); it cannot be "
        "checked against this run: use a new workdir"
      ) from None
  old, new = _flatten(saved), _flatten(cfg.model_dump(mode="json"))
  same = {k: old.get(k) == new.get(k) for k in old.keys() | new.keys()}
  for key in PATH_KEYS + ("workdir",):  # the same file or directory however written (./, /, a symlink)
    if isinstance(old.get(key), str) and isinstance(new.get(key), str):
      same[key] = _same_path(old[key], new[key])
  return old, new, same


def config_differences(
  saved: str | dict[str, Any] | None, cfg: TrainConfig, *, ignore: tuple[str, ...] = ()
) -> str:
  """The keys in which ``cfg`` differs from a run's saved config (``config.json`` text or a
  checkpoint's metadata dict), as ``"key: saved -> given"`` joined by ``", "``; ``""`` when none
  differ, when ``saved`` is None or is not a mapping. ``workdir`` and ``data.path`` compare as the
  directory they name; keys in ``ignore`` (dotted, or a section such as ``distributed``) are left out."""
  if saved is None:
    return ""
  try:
    old, new, same = _compared(saved, cfg, "the run")
  except (ValueError, TypeError):
    return ""
  keys = sorted(
    k for k, s in same.items() if not s and not any(k == i or k.startswith(i + ".") for i in ignore)
  )
  return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def unapplied_settings(saved: dict[str, Any] | None, cfg: TrainConfig, step: int) -> str:
  """The line a rerun of a finished run prints when ``cfg`` differs from the config of its checkpoint
  of ``step`` (``saved``): the differing keys, not applied; ``""`` when none differ."""
  differing = config_differences(saved, cfg)
  if not differing:
    return ""
  return (
    f"these settings differ from the run's (its checkpoint of step {step}) and were not applied "
    f"(config.json keeps the run's): {differing}\n"
  )


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
  old, new, same = _compared(saved, cfg, source)
  differing = sorted(
    k for k in same if k.split(".")[0] in RUN_DEFINING_KEYS and k not in RESUME_CHANGEABLE and not same[k]
  )
  if differing:
    detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differing)
    raise ValueError(
      f"cannot resume {cfg.workdir!r} with a different model, data or batch stream ({detail}, saved in "
      f"{source}); these keys are fixed for a run: use a new workdir (or the saved values)"
    )


def _same_path(a: str, b: str) -> bool:
  """Whether paths ``a`` and ``b`` name the same file or directory (``os.path.realpath``, relative to
  the working directory; one that no longer exists compares by its resolved spelling)."""
  return os.path.realpath(a) == os.path.realpath(b)


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
  where = cfg.data.tokens or cfg.data.path or "the Python standard library"

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
  text = json.dumps(value, sort_keys=True, allow_nan=False)  # config values: finite (StrictConfig)
  return np.int32(int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little", signed=True))


def check_processes_agree(cfg: TrainConfig, fingerprint: dict[str, Any]) -> None:
  """In a multi-process run, checks that every process holds the same config (all keys but
  ``PROCESS_LOCAL_KEYS``) and the same data (``fingerprint``'s ``sha256``): each process gathers a
  hash of each key's value from all processes (``multihost_utils.process_allgather``). Every
  process makes the same comparison, so all refuse together. A no-op with one process.

  Raises:
    run_guard.JobRefused: (a ValueError) one line naming the differing keys, with this process's values.
  """
  if jax.process_count() == 1:
    return
  flat = {k: v for k, v in _flatten(cfg.model_dump(mode="json")).items() if k not in PROCESS_LOCAL_KEYS}
  flat["data fingerprint"] = fingerprint["sha256"]
  keys = sorted(flat)
  me, n = jax.process_index(), jax.process_count()
  schemas = multihost_utils.process_allgather(np.array([_config_hash(keys)], np.int32))
  if not np.all(schemas == schemas[0]):
    raise run_guard.JobRefused(
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
    raise run_guard.JobRefused(
      f"the processes of this run disagree on {', '.join(differing)} (process {me} has {here}; processes "
      f"{others} differ): start every process with the same config (only distributed.process_id differs)"
    )


SHARED_CHECK_FILE = ".jaxpe-shared-check"
"""The file process 0 writes into the workdir for the others to read (``check_shared_workdir``)."""


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
  present = [name for name in run_files.RUN_FILES if (workdir / name).exists()]
  if not present:
    return
  saved = run_files.read_saved_config(workdir / "config.json") if "config.json" in present else None
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
    run_guard.JobRefused: (a ValueError) naming the workdir and the processes that do not see process 0's file.
  """
  if jax.process_count() == 1:
    return
  path = workdir / SHARED_CHECK_FILE
  token = secrets.randbelow(2**31 - 1) + 1
  if jax.process_index() == 0:
    run_files.write_atomic(path, str(token))
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
    raise run_guard.JobRefused(
      f"workdir {str(workdir)!r} is not shared: process(es) {missing} do not see the file process 0 wrote "
      f"there ({SHARED_CHECK_FILE}); every process of a run needs the same workdir (on a disk all hosts see)"
    )


def nonfinite_message(record: dict[str, Any], skipped: int, cfg: TrainConfig, mngr) -> str:
  """The NonFiniteError message of a non-finite training step: what was (not) applied, the last good
  checkpoint, and what to change."""
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
