"""A trained jaxpe run loaded for evaluation: the parameters of its latest checkpoint, or a ``Decoder``
holding them (possibly under another ``ModelConfig`` with the same parameter shapes).

Reading never writes: the checkpoint directory is opened read-only (``checkpoint.manager(read_only=True)``),
so a read-only directory or filesystem loads. The weights come back host-local (one device), whatever
mesh the run trained on. ``jaxpe.study`` evaluates its models through these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pydantic
from flax import nnx

from jaxpe.errors import CheckpointError
from jaxpe.model import Decoder
from jaxpe.model.build import build_model, model_params
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import to_loop_layout, to_scan_layout
from jaxpe.train import checkpoint, run_files
from jaxpe.train.config import TrainConfig
from jaxpe.train.optimizer import make_optimizer

__all__ = ["init_source", "load_trained", "trained_params"]


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
  return model_params(_restored(cfg)[0])


def _restored(cfg: TrainConfig) -> tuple[Decoder, int]:
  """The ``Decoder`` of ``cfg.workdir``'s latest intact checkpoint (host-local) and its step."""
  tx = make_optimizer(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def abstract(scan_layers: bool):
    model_cfg = cfg.model.model_copy(update={"scan_layers": scan_layers})

    def make():
      model = Decoder(model_cfg, rngs=nnx.Rngs(cfg.seed))
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(make))  # shapes only: no initialisation, no compile
    return graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)

  def target(meta):  # the layer layout the checkpoint was written in (its metadata's config), else cfg's
    return abstract(_saved_scan(meta, cfg))[1]

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
  state, meta = restored
  graphdef, target_state = abstract(cfg.model.scan_layers)
  if _saved_scan(meta, cfg) != cfg.model.scan_layers:  # loop <-> scanned layers: into cfg.model's layout
    convert = to_scan_layout if cfg.model.scan_layers else to_loop_layout
    nnx.replace_by_pure_dict(target_state, convert(nnx.to_pure_dict(state)))
    state = target_state
  trained, _ = nnx.merge(graphdef, state)
  return trained, int(meta.get("step", -1))


def _saved_scan(meta: dict[str, Any], cfg: TrainConfig) -> bool:
  """``model.scan_layers`` of the run that wrote a checkpoint (its metadata's config), else ``cfg``'s."""
  config = meta.get("config")
  model = config.get("model") if isinstance(config, dict) else None
  if isinstance(model, dict) and isinstance(model.get("scan_layers"), bool):
    return model["scan_layers"]
  return cfg.model.scan_layers


def init_source(cfg: TrainConfig) -> tuple[dict[str, Any], int]:
  """The model parameters ``cfg.init_from`` starts ``cfg``'s run with: the pure dict
  (``nnx.to_pure_dict``) of the ``nnx.Param`` state of the latest intact checkpoint of the run in
  ``cfg.init_from`` (its own ``config.json`` gives its ``TrainConfig``), converted to ``cfg.model``'s
  layer layout (``scan_layers``), host-local numpy arrays, and the checkpoint's step.

  Raises:
    ValueError: ``cfg.init_from`` is None, or ``config.json`` there is not a jaxpe ``TrainConfig``.
    FileNotFoundError: ``cfg.init_from`` is not a directory, holds no ``config.json`` or no checkpoint.
    CheckpointError: checkpoints exist there but none is intact.
  """
  if cfg.init_from is None:
    raise ValueError("init_source: cfg.init_from is None (nothing to start from)")
  where = f"init_from {cfg.init_from!r}"
  src = Path(cfg.init_from)
  if not src.is_dir():
    raise FileNotFoundError(f"{where}: no such directory (give the workdir of a finished run)")
  text = run_files.read_saved_config(src / "config.json")
  if text is None:
    raise FileNotFoundError(
      f"{where}: no config.json of a jaxpe run in it (give the workdir of a finished run)"
    )
  try:
    src_cfg = TrainConfig.model_validate_json(text).model_copy(update={"workdir": str(src)})
  except pydantic.ValidationError as e:
    raise ValueError(f"{where}: its config.json is not a TrainConfig of this version: {e}") from None
  try:
    model, step = _restored(src_cfg)
  except FileNotFoundError:
    raise FileNotFoundError(f"{where}: no checkpoint in {str(src / 'checkpoints')!r}") from None
  except CheckpointError as e:
    raise CheckpointError(f"{where}: no intact checkpoint to start from: {e}") from None
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  if src_cfg.model.scan_layers != cfg.model.scan_layers:
    params = (to_scan_layout if cfg.model.scan_layers else to_loop_layout)(params)
  return jax.tree.map(np.asarray, params), step


def load_trained(cfg: TrainConfig, model_cfg: ModelConfig | None = None) -> Decoder:
  """The ``Decoder`` of ``cfg.workdir``'s latest checkpoint built with ``model_cfg`` (default
  ``cfg.model``: same parameter shapes, e.g. another position encoding without parameters or another
  ``max_len`` for encodings without a table), with host-local weights.

  Raises:
    FileNotFoundError: no checkpoint in ``cfg.workdir``.
    jaxpe.errors.CheckpointError: ``model_cfg`` has other parameters or shapes; or no intact checkpoint.
  """
  return build_model(model_cfg or cfg.model, trained_params(cfg))
