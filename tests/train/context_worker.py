"""One process of the two-process context-parallel run in ``context_parallel_test.py`` (a subprocess,
2 fake CPU devices each, gloo collectives on 127.0.0.1): the ``context`` axis spans both processes.

argv[1] is a JSON object: ``port``, ``process_id``, ``overrides`` (the run's config, its
``mesh_shape`` the two-process mesh), ``restore_from`` (a checkpoint directory written by one
process on another mesh) and ``dump`` (an .npz path). The process builds the run's initial state,
takes the trainer's steps on the trainer's batches (``steps.make_train_step`` with
``next_token_loss``, each process building its rows of every batch), restores ``restore_from`` onto
its mesh (checking the shardings), and process 0 writes the losses, the final state and the
restored state, gathered, to ``dump``.
"""

import json
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpe.train import checkpoint, data, sharding, steps, trainer
from jaxpe.train.config import load_config


def _flat(tree):
  gathered = multihost_utils.process_allgather(tree, tiled=True)
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
  sharding.initialize_distributed(cfg.distributed)
  assert jax.process_count() == 2 and jax.device_count() == 4
  mesh = sharding.make_mesh(cfg.mesh_shape)
  with jax.numpy_dtype_promotion("standard"):
    graphdef, state, shardings = trainer.create_state(cfg, mesh)
    batch_sharding = sharding.batch_sharding(mesh, cfg.logical_rules)
    step = steps.make_train_step(
      graphdef, mesh=mesh, rules=cfg.logical_rules, state_shardings=shardings, batch_sharding=batch_sharding
    )
    corpus = data.load_corpus(
      cfg.data.path, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction
    )
    losses = []
    for i in range(cfg.num_steps):
      batch = sharding.global_batch(
        lambda rows, i=i: data.train_batch(
          corpus.train, step=i, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=cfg.seq_len, rows=rows
        ),
        batch_sharding,
        (cfg.batch_size, cfg.seq_len + 1),
      )
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    _, abstract = trainer.abstract_state(cfg, mesh)
    mngr = checkpoint.manager(spec["restore_from"], read_only=True)
    restored, _ = checkpoint.restore_latest(mngr, abstract)
    mngr.close()
  for x, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert x.sharding.is_equivalent_to(a.sharding, x.ndim), (x.sharding, a.sharding)
  restored, own = _flat(restored), _flat(state)
  if jax.process_index() == 0:
    np.savez(
      spec["dump"],
      losses=np.asarray(losses),
      **{f"restored{k}": v for k, v in restored.items()},
      **{f"own{k}": v for k, v in own.items()},
    )


if __name__ == "__main__":
  main()
