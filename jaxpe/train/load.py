"""A trained jaxpe run loaded for evaluation: the parameters of its latest checkpoint, or a ``Decoder``
holding them (possibly under another ``ModelConfig`` with the same parameter shapes).

Reading never writes: the checkpoint directory is opened read-only (``checkpoint.manager(read_only=True)``),
so a read-only directory or filesystem loads. The weights come back host-local (one device), whatever
mesh the run trained on. ``jaxpe.study`` evaluates its models through these.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxpe.model import Decoder
from jaxpe.model.build import build_model, model_params
from jaxpe.model.config import ModelConfig
from jaxpe.train import checkpoint, trainer
from jaxpe.train.config import TrainConfig

__all__ = ["load_trained", "trained_params"]


def trained_params(cfg: TrainConfig) -> dict[str, np.ndarray]:
  """The parameters (dotted path -> numpy array, as ``jaxpe.model.build.model_params``) of
  ``cfg.workdir``'s latest checkpoint; ``jaxpe.model.build.build_model(model_cfg, params)`` builds a
  model from them for any ``model_cfg`` with the same parameter shapes.

  Args:
    cfg: the run's config: ``workdir`` holds ``checkpoints/``; ``model``, ``seed`` and the optimizer
      settings give the shapes of the saved state (model and optimizer).

  Raises:
    FileNotFoundError: no checkpoint in ``cfg.workdir``.
    CheckpointError: checkpoints exist but none is intact (``checkpoint.restore_latest``).
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
    jaxpe.errors.CheckpointError: ``model_cfg`` has other parameters or shapes; or no intact checkpoint.
  """
  return build_model(model_cfg or cfg.model, trained_params(cfg))
