"""Hugging Face BLOOM -> jaxpe: read a checkpoint directory, map its state dict through the name map,
build the ``Decoder``. A chain of small steps (read, check, convert, build), as gemma loads weights.

torch and safetensors (the ``bloom`` extra) are imported inside the functions that need them, so
``import jaxpe`` never does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxpe.bloom.config import BLOOM_CONTEXT, config_from_hf
from jaxpe.bloom.names import Dims, weight_rules
from jaxpe.errors import CheckpointError, require_extra
from jaxpe.model import Decoder
from jaxpe.model.build import build_model, key_listing
from jaxpe.model.config import ModelConfig

__all__ = ["WEIGHT_FILES", "from_hf", "params_from_hf", "read_checkpoint"]


def _to_numpy(name: str, value) -> np.ndarray:
  if hasattr(value, "detach"):  # torch tensor (any float dtype, bf16 included)
    import torch

    if not value.is_floating_point():
      raise CheckpointError(f"checkpoint key {name!r} must be a float tensor, got {value.dtype}")
    arr = value.detach().to(device="cpu", dtype=torch.float32).numpy()
  else:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.floating):
      raise CheckpointError(f"checkpoint key {name!r} must be a float array, got {arr.dtype}")
    arr = arr.astype(np.float32)
  if not np.isfinite(arr).all():
    bad = int(arr.size - np.isfinite(arr).sum())
    raise CheckpointError(
      f"checkpoint key {name!r} holds {bad} non-finite value(s) (NaN or inf) of {arr.size}"
    )
  return arr


def _strip_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in state_dict.items():
    short = key.removeprefix("transformer.")
    if short in out:
      raise CheckpointError(f"checkpoint holds {short!r} twice (with and without the 'transformer.' prefix)")
    out[short] = value
  return out


def params_from_hf(state_dict: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Maps a BLOOM state dict onto jaxpe parameter paths, checking every key and shape first.

  Args:
    state_dict: HF key -> tensor (torch tensor of any float dtype, or numpy array). Keys may carry
      the ``transformer.`` prefix (``BloomForCausalLM``) or not (``BloomModel``). With tied
      embeddings a ``lm_head.weight`` is allowed and ignored (HF ties it to the embeddings too).
    cfg: the model config (``config_from_hf``).

  Returns:
    dotted jaxpe path -> float32 numpy array.

  Raises:
    CheckpointError: missing keys, unexpected keys, wrong shapes, non-float tensors (all missing
      and unexpected keys are listed).
  """
  dims = Dims.of(cfg)
  sd = _strip_prefix(state_dict)
  rules = weight_rules(cfg)
  expected = {r.hf for r in rules}
  ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
  missing = sorted(expected - sd.keys())
  unexpected = sorted(sd.keys() - expected - ignorable)
  if missing or unexpected:
    raise CheckpointError(
      f"checkpoint does not match a {dims.layers}-layer BLOOM (D={dims.d}, N={dims.n}, V={dims.v}): "
      f"missing keys {key_listing(missing)}, unexpected keys {key_listing(unexpected)}"
    )
  for key in (*(r.hf for r in rules), *(ignorable & sd.keys())):
    want = (
      (dims.v, dims.d) if key == "lm_head.weight" else next(r for r in rules if r.hf == key).hf_shape(dims)
    )
    got = tuple(sd[key].shape)
    if got != want:
      raise CheckpointError(f"checkpoint key {key!r} has shape {got}, expected {want}")
  params: dict[str, np.ndarray] = {}
  for rule in rules:
    for path, value in zip(rule.jax, rule.to_jax(_to_numpy(rule.hf, sd[rule.hf]), dims), strict=True):
      params[path] = value
  return params


def _read_safetensors(path: Path, want: set[str] | None = None) -> dict[str, Any]:
  require_extra("bloom", "reading a BLOOM safetensors checkpoint", ("safetensors",))
  from safetensors import safe_open

  try:
    out = {}
    with safe_open(str(path), framework="pt") as f:
      for key in f.keys():
        if want is None or key in want:
          out[key] = f.get_tensor(key)
    return out
  except Exception as e:  # safetensors raises SafetensorError/OSError for truncated or corrupt files
    raise CheckpointError(f"cannot read safetensors file {str(path)!r}: {e}") from e


def _read_torch_bin(path: Path) -> dict[str, Any]:
  require_extra("bloom", "reading a BLOOM pytorch_model.bin checkpoint", ("torch",))
  import torch

  try:
    out = torch.load(str(path), map_location="cpu", weights_only=True)
  except Exception as e:
    raise CheckpointError(f"cannot read PyTorch checkpoint {str(path)!r}: {e}") from e
  if not isinstance(out, Mapping):
    raise CheckpointError(
      f"PyTorch checkpoint {str(path)!r} must hold a state dict, got {type(out).__name__}"
    )
  return dict(out)


def _read_index(path: Path, reader) -> dict[str, Any]:
  try:
    weight_map = json.loads(path.read_text())["weight_map"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"cannot read checkpoint index {str(path)!r} (needs a 'weight_map'): {e}") from e
  state: dict[str, Any] = {}
  by_shard: dict[str, set[str]] = {}
  for key, shard in weight_map.items():
    by_shard.setdefault(shard, set()).add(key)
  for shard, keys in sorted(by_shard.items()):
    shard_path = path.parent / shard
    if not shard_path.is_file():
      raise CheckpointError(f"shard {str(shard_path)!r} named in {str(path)!r} does not exist")
    tensors = reader(shard_path)
    absent = sorted(keys - tensors.keys())
    if absent:
      raise CheckpointError(f"shard {str(shard_path)!r} lacks keys {absent} that {path.name} assigns to it")
    state.update({k: tensors[k] for k in keys})
  return state


WEIGHT_FILES = (
  "model.safetensors",
  "model.safetensors.index.json",
  "pytorch_model.bin",
  "pytorch_model.bin.index.json",
)


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
  """Reads an HF checkpoint directory: ``(config.json dict, state dict of torch tensors)``.

  Weights are looked for in this order: ``model.safetensors``, ``model.safetensors.index.json``
  (sharded), ``pytorch_model.bin``, ``pytorch_model.bin.index.json``.

  Raises:
    FileNotFoundError: the directory, its ``config.json`` or all weight files are missing.
    CheckpointError: ``config.json`` is not valid JSON; a weight file is truncated or corrupt; an
      index names a missing shard or key.
  """
  root = Path(path)
  if not root.is_dir():
    raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
  config_path = root / "config.json"
  if not config_path.is_file():
    raise FileNotFoundError(f"checkpoint directory {str(root)!r} has no config.json")
  try:
    hf_config = json.loads(config_path.read_text())
  except ValueError as e:
    raise CheckpointError(f"cannot parse {str(config_path)!r}: {e}") from e
  if not isinstance(hf_config, dict):
    raise CheckpointError(f"{str(config_path)!r} must hold a JSON object")
  for name in WEIGHT_FILES:
    weights = root / name
    if not weights.is_file():
      continue
    if name == "model.safetensors":
      return hf_config, _read_safetensors(weights)
    if name == "model.safetensors.index.json":
      return hf_config, _read_index(weights, _read_safetensors)
    if name == "pytorch_model.bin":
      return hf_config, _read_torch_bin(weights)
    return hf_config, _read_index(weights, _read_torch_bin)
  raise FileNotFoundError(
    f"checkpoint directory {str(root)!r} has none of the weight files {list(WEIGHT_FILES)}"
  )


def from_hf(
  source,
  *,
  hf_config=None,
  dtype: str = "float32",
  max_len: int = BLOOM_CONTEXT,
  param_dtype: str = "float32",
) -> Decoder:
  """Imports a BLOOM model into a jaxpe ``Decoder`` (ALiBi, BLOOM options on).

  Args:
    source: a transformers ``BloomForCausalLM`` (or ``BloomModel``), a local checkpoint directory
      (``config.json`` plus ``model.safetensors``, sharded ``*.safetensors`` with
      ``model.safetensors.index.json``, or ``pytorch_model.bin``), or a state dict (key -> torch
      tensor or numpy array; then ``hf_config`` is required).
    hf_config: config dict or ``BloomConfig``; default the module's or the directory's config.
    dtype: compute dtype of the jaxpe model.
    max_len: context the model is meant for, in tokens (default 2048).
    param_dtype: the parameters' dtype (``ModelConfig.param_dtype``): float32 (default) or bfloat16
      (the checkpoint's weights rounded to nearest; a bfloat16 checkpoint's are exact).

  Returns:
    ``Decoder``; call it as ``model(tokens [B, T], attention_mask=mask [B, T]) -> [B, T, V]``
    float32 logits. Positions follow the mask (left padding), as in BLOOM.

  Raises:
    FileNotFoundError, CheckpointError: see ``read_checkpoint`` and ``params_from_hf``.
    ValueError: a non-BLOOM config (see ``config_from_hf``); a state dict without ``hf_config``.
    TypeError: a ``source`` of another kind.
  """
  if isinstance(source, str | Path):
    file_config, state_dict = read_checkpoint(source)
    hf_config = file_config if hf_config is None else hf_config
  elif hasattr(source, "state_dict") and hasattr(source, "config"):
    hf_config = source.config if hf_config is None else hf_config
    state_dict = source.state_dict()
  elif isinstance(source, Mapping):
    if hf_config is None:
      raise ValueError("hf_config is required when source is a state dict")
    state_dict = source
  else:
    raise TypeError(
      "source must be a BloomForCausalLM, a checkpoint directory or a state dict, "
      f"got {type(source).__name__}"
    )
  cfg = config_from_hf(hf_config, dtype=dtype, max_len=max_len, param_dtype=param_dtype)
  return build_model(cfg, params_from_hf(state_dict, cfg))
