"""One process of the two-process grain run in ``input_pipeline_test.py`` (a subprocess, 2 fake CPU
devices, gloo collectives on 127.0.0.1).

argv[1] is a JSON object: ``port``, ``process_id``, ``overrides`` (the run's config) and ``dump`` (an
.npz path per process). The process trains the run with ``data.loader=grain``, then writes the rows
of the global batch its grain pipeline reads (``rows``: start, stop) and its rows of steps 0 and 1.
"""

import json
import sys

import jax
import numpy as np

from jaxpe.train import data, input_pipeline, sharding, trainer
from jaxpe.train.config import load_config


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
  corpus = data.load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction)
  make, _ = input_pipeline.batch_maker(cfg, corpus)
  batch_sharding = sharding.batch_sharding(sharding.make_mesh(cfg.mesh_shape), cfg.logical_rules)
  pipe = input_pipeline.for_run(cfg, make, batch_sharding, 0)
  rows = sharding.process_rows(batch_sharding, cfg.batch_size)
  np.savez(spec["dump"], rows=np.array([rows.start, rows.stop]), step0=pipe.next(0), step1=pipe.next(1))


if __name__ == "__main__":
  main()
