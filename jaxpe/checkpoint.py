"""Checkpoints with orbax ``CheckpointManager``: model + optimizer state, step and data position.

Orbax writes each step to a temporary directory and renames it when complete, so an interrupted
save never replaces a good checkpoint. Restores are sharded: each leaf is read straight into the
sharding of the target (``jax.ShapeDtypeStruct(..., sharding=...)``), which also moves a state
saved on one mesh shape onto another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def manager(directory: str | Path, *, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """A CheckpointManager over ``directory`` (created if missing), keeping the newest
  ``max_to_keep`` (> 0) checkpoints; each step is a subdirectory named by the step number."""
  return ocp.CheckpointManager(
    Path(directory).absolute(),
    options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
  )


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
  """Saves ``state`` (a pytree of arrays, any shapes, dtypes and shardings) and the JSON-serialisable
  dict ``meta`` at ``step`` (an optimizer step, >= 0) and waits for completion.

  Raises:
    ValueError: orbax's error when ``step`` is already saved.
  """
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
  mngr.wait_until_finished()


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any) -> tuple[Any, dict[str, Any]] | None:
  """Restores the newest checkpoint into the shapes, dtypes and shardings of ``abstract_state``.

  Args:
    abstract_state: pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set.

  Returns:
    ``(state, meta)``, or None when the directory holds no checkpoint.

  Raises:
    ValueError: orbax's error when the saved tree or shapes do not match ``abstract_state`` (the
      trainer refuses changed model configs before this, naming the keys).
  """
  step = mngr.latest_step()
  if step is None:
    return None
  restored = mngr.restore(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
  )
  return restored["state"], dict(restored["meta"])


def abstract_with_shardings(state: Any, shardings: Any) -> Any:
  """Restore targets: a pytree like ``state`` of ``jax.ShapeDtypeStruct`` with each leaf's shape and
  dtype and the matching ``NamedSharding`` from ``shardings`` (same tree structure)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
