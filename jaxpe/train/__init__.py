"""Training: the run configuration, the trainer (``trainer.train``) and its parts (``optimizer``,
``steps``, ``state``, ``loop``, ``evaluation``, ``run_checks``, ``run_files``, ``run_log``, ``events``), mesh
sharding, checkpoints, data, pacing and the run guard. Import the modules (``from jaxpe.train import
trainer``); this package imports nothing itself, so ``jaxpe.train.data`` does not load Flax.
Needs the ``train`` extra: without it, importing any of them fails naming it
(``jaxpe.errors.MissingExtraError``; checked without importing Flax)."""

from jaxpe.errors import require_extra

require_extra("train", "jaxpe.train")
