"""One process of the two-process run in ``scale_test.py`` (started as a subprocess, 2 fake CPU
devices each, gloo collectives on 127.0.0.1).

argv[1] is a JSON object: ``port``, ``process_id``, ``overrides`` (the run's config), ``restore_from``
(a checkpoint directory written by one process) and ``dump`` (an .npz path). The process trains
the run, then restores ``restore_from`` and its own run's checkpoint onto the two-process mesh,
checks the shardings, and process 0 writes the gathered values to ``dump``.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpe.train import checkpoint, sharding, trainer
from jaxpe.train.config import load_config


def _restore(directory, abstract):
  mngr = checkpoint.manager(directory)
  restored, _ = checkpoint.restore_latest(mngr, abstract)
  mngr.close()
  for x, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert x.sharding.is_equivalent_to(a.sharding, x.ndim), (x.sharding, a.sharding)
  gathered = multihost_utils.process_allgather(restored, tiled=True)
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(gathered)}


def main() -> None:
  spec = json.loads(sys.argv[1])
  cfg = load_config(
    None,
    [
      *spec["overrides"],
      f"distributed.coordinator_address=127.0.0.1:{spec['port']}",
      "distributed.num_processes=2",
      f"distributed.process_id={spec['process_id']}",
    ],
  )
  with jax.numpy_dtype_promotion("standard"):
    trainer.train(cfg, progress=False)
    assert jax.process_count() == 2 and jax.device_count() == 4
    _, abstract = trainer.abstract_state(cfg, sharding.make_mesh(cfg.mesh_shape))
    one = _restore(spec["restore_from"], abstract)
    own = _restore(Path(cfg.workdir) / "checkpoints", abstract)
  if jax.process_index() == 0:
    np.savez(spec["dump"], **{f"one{k}": v for k, v in one.items()}, **{f"own{k}": v for k, v in own.items()})


if __name__ == "__main__":
  main()
