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
  """A CheckpointManager over ``directory`` (created if missing), keeping the newest checkpoints."""
  return ocp.CheckpointManager(
    Path(directory).absolute(),
    options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
  )


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict[str, Any]) -> None:
  """Saves ``state`` (a pytree of arrays) and JSON ``meta`` at ``step`` and waits for completion."""
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
  mngr.wait_until_finished()


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any) -> tuple[Any, dict[str, Any]] | None:
  """Restores the newest checkpoint into the shapes, dtypes and shardings of ``abstract_state``.

  Args:
    abstract_state: pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set.

  Returns:
    ``(state, meta)``, or None when the directory holds no checkpoint.
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
  """ShapeDtypeStructs of ``state`` carrying ``shardings`` (restore targets)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
