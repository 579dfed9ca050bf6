"""A ``Decoder`` from a ``ModelConfig`` and a flat parameter tree, and back: no random init.

Parameters are named by their dotted path in the model (``blocks.0.attn.q.kernel``, ``embed.embedding``),
the names ``jaxpe.bloom``'s weight map and ``jaxpe.train.load`` (trained checkpoints) use. Shapes come
from ``nnx.eval_shape``, so building a large model allocates its weights once (the given arrays).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpe.errors import CheckpointError
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder

__all__ = ["build_model", "key_listing", "model_params", "param_shapes"]


def _path_str(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def _abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, list]:
  """``(graphdef, [(path, abstract variable)])`` of a ``Decoder(cfg)``: shapes only, nothing computed."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  return graphdef, list(nnx.to_flat_state(state))


def key_listing(keys: list[str], limit: int = 12) -> str:
  """``keys`` as a list, cut to ``limit`` entries with a count of the rest (huge models), for messages."""
  if len(keys) <= limit:
    return str(keys)
  return f"{keys[:limit]} and {len(keys) - limit} more"


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Dotted path -> shape of every variable of a ``Decoder`` of ``cfg`` (the keys ``build_model``
  needs), in the model's order, without initialising it."""
  return {_path_str(path): tuple(var.shape) for path, var in _abstract(cfg)[1]}


def build_model(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> Decoder:
  """A ``Decoder`` of ``cfg`` holding ``params`` (dotted path -> array), without a random init.

  Args:
    cfg: the model's config.
    params: dotted path -> array-like for every variable of the model (``param_shapes(cfg)``); each
      is cast to the variable's dtype (float32 parameters).

  Raises:
    CheckpointError: a parameter of the model missing from ``params``, an extra entry, or a shape
      that differs from the model's.
  """
  graphdef, flat = _abstract(cfg)
  paths = {_path_str(p) for p, _ in flat}
  missing, extra = sorted(paths - params.keys()), sorted(params.keys() - paths)
  if missing or extra:
    raise CheckpointError(
      f"parameters do not match the model: missing {key_listing(missing)}, unexpected {key_listing(extra)}"
    )
  leaves = []
  for path, var in flat:
    name = _path_str(path)
    value = np.asarray(params[name])
    if value.shape != var.shape:
      raise CheckpointError(f"parameter {name!r} has shape {value.shape}, the model expects {var.shape}")
    leaves.append((path, var.replace(value=jnp.asarray(value, var.dtype))))
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def model_params(model: Decoder) -> dict[str, np.ndarray]:
  """Dotted path -> numpy array of every parameter (``nnx.Param``) of ``model``, on the host."""
  return {_path_str(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
