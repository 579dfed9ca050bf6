"""Training: the run configuration, trainer, train/eval steps, mesh sharding, checkpoints, data,
pacing and the run guard. Import the modules (``from jaxpe.train import trainer``); this package
imports nothing itself, so ``jaxpe.train.data`` does not load Flax."""
