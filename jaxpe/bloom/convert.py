"""BLOOM in jaxpe: import Hugging Face BLOOM weights, export them back, convert to RoPE-emulated ALiBi.

BLOOM (BigScience, arXiv 2211.05100) is a pre-LayerNorm decoder with a LayerNorm on the word
embeddings, a fused per-head ``query_key_value`` projection, biases on every linear layer, GELU in its
tanh form, ALiBi (arXiv 2108.12409) with positions counted from the attention mask, and an output
head tied to the word embeddings. ``jaxpe.model.Decoder`` has all of these as options; this module
maps the parameters both ways and builds the matching ``ModelConfig``. The reference is HF
transformers' ``models/bloom/modeling_bloom.py`` (``BloomForCausalLM``).

The mapping is declarative: ``weight_rules`` lists, for every HF key (``{i}`` = layer), the jaxpe
parameter paths it feeds and a pair of pure numpy transforms (HF -> jaxpe and back). Everything is
config-driven, so any BLOOM size (560m to 7b1, 176b) maps the same way.

Shapes (HF ``[out, in]`` linear weights; jaxpe einsum kernels), with D model dim, N heads, H head
dim (D / N), F = 4 D MLP dim, V vocab:

====================================================  ==============================================
HF key (``transformer.`` prefix optional)             jaxpe path
====================================================  ==============================================
``word_embeddings.weight [V, D]``                     ``embed.embedding [V, D]``
``word_embeddings_layernorm.{weight,bias} [D]``       ``embed_norm.{scale,bias}``
``h.{i}.input_layernorm.{weight,bias} [D]``           ``blocks.{i}.attn_norm.{scale,bias}``
``h.{i}.self_attention.query_key_value.weight``       ``blocks.{i}.attn.{q,k,v}.kernel [D, N, H]``
``  [3 D, D]``, rows ordered (head, q/k/v, dim)
``h.{i}.self_attention.query_key_value.bias [3 D]``   ``blocks.{i}.attn.{q,k,v}.bias [N, H]``
``h.{i}.self_attention.dense.weight [D, D]``, bias    ``blocks.{i}.attn.o.kernel [N, H, D]``, bias
``h.{i}.post_attention_layernorm.{weight,bias}``      ``blocks.{i}.mlp_norm.{scale,bias}``
``h.{i}.mlp.dense_h_to_4h.weight [F, D]``, bias       ``blocks.{i}.mlp.up.kernel [D, F]``, bias
``h.{i}.mlp.dense_4h_to_h.weight [D, F]``, bias       ``blocks.{i}.mlp.down.kernel [F, D]``, bias
``ln_f.{weight,bias} [D]``                            ``final_norm.{scale,bias}``
``lm_head.weight [V, D]`` (only when untied)          ``lm_head.kernel [D, V]`` (bias held at 0)
====================================================  ==============================================

torch, transformers and safetensors (the ``bloom`` extra) are imported inside the functions that
need them, so ``import jaxpe`` never does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpe.emulation import core as emulation
from jaxpe.errors import CheckpointError
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.model.generate import (
  generate,  # re-exported: greedy/sampled decoding with the KV cache, left padding
)
from jaxpe.ops import alibi
from jaxpe.ops import checks as _checks

# Defaults of transformers' ``BloomConfig`` for keys a config.json may leave out.
_HF_DEFAULTS: dict[str, Any] = {
  "vocab_size": 250880,
  "hidden_size": 64,
  "n_layer": 2,
  "n_head": 8,
  "layer_norm_epsilon": 1e-5,
  "initializer_range": 0.02,
  "tie_word_embeddings": True,
  "apply_residual_connection_post_layernorm": False,
}
_ALIASES = {"n_embed": "hidden_size", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}
BLOOM_CONTEXT = 2048  # sequence length BLOOM was trained with (arXiv 2211.05100, table 3)


# ----------------------------------------------------------------------------------------------
# Config


def _hf_config_dict(hf_config) -> dict[str, Any]:
  if hasattr(hf_config, "to_dict"):  # transformers' BloomConfig
    hf_config = hf_config.to_dict()
  if not isinstance(hf_config, Mapping):
    raise TypeError(
      f"hf_config must be a mapping (config.json) or a transformers BloomConfig, got {type(hf_config).__name__}"
    )
  raw = dict(hf_config)
  for alias, key in _ALIASES.items():
    if alias in raw and raw[alias] is not None:
      raw.setdefault(key, raw[alias])
  return {**_HF_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}


def config_from_hf(
  hf_config, *, dtype: str = "float32", max_len: int = BLOOM_CONTEXT, **overrides: Any
) -> ModelConfig:
  """The jaxpe ``ModelConfig`` of a BLOOM model.

  Args:
    hf_config: the checkpoint's ``config.json`` as a dict, or a transformers ``BloomConfig``.
      ``model_type`` must be ``"bloom"``; keys it leaves out take ``BloomConfig``'s defaults.
    dtype: compute dtype of the jaxpe model (parameters stay float32).
    max_len: context in tokens the model is meant for (only ``rope_alibi`` uses it, to tune the
      emulation). Default 2048, BLOOM's training context.
    **overrides: further ``ModelConfig`` fields.

  Returns:
    ``ModelConfig`` with ``pos_encoding='alibi'``, biases, embedding LayerNorm, tanh GELU, the
    config's LayerNorm eps, MLP dim 4 D and the config's embedding tie.

  Raises:
    ValueError: not a BLOOM config (``model_type``), non-positive or non-integer sizes,
      ``hidden_size`` not divisible by ``n_head``, or
      ``apply_residual_connection_post_layernorm=True`` (not supported by jaxpe's decoder).
    TypeError: ``hf_config`` neither a mapping nor a config object.
  """
  raw = _hf_config_dict(hf_config)
  model_type = raw.get("model_type")
  if model_type != "bloom":
    raise ValueError(f"config model_type must be 'bloom', got {model_type!r}")
  for key in ("vocab_size", "hidden_size", "n_layer", "n_head"):
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"config {key} must be a positive integer, got {value!r}")
  if raw["hidden_size"] % raw["n_head"]:
    raise ValueError(
      f"config hidden_size ({raw['hidden_size']}) must be divisible by n_head ({raw['n_head']})"
    )
  if raw["apply_residual_connection_post_layernorm"]:
    raise ValueError(
      "config apply_residual_connection_post_layernorm=True is not supported (jaxpe's decoder adds the "
      "residual before the LayerNorm, as every released BLOOM does)"
    )
  fields: dict[str, Any] = dict(
    vocab_size=raw["vocab_size"],
    d_model=raw["hidden_size"],
    num_layers=raw["n_layer"],
    num_heads=raw["n_head"],
    mlp_dim=4 * raw["hidden_size"],
    max_len=max_len,
    pos_encoding="alibi",
    use_bias=True,
    embed_layernorm=True,
    layernorm_eps=float(raw["layer_norm_epsilon"]),
    gelu_approximate=True,
    tie_embeddings=bool(raw["tie_word_embeddings"]),
    dtype=dtype,
    init_std=float(raw["initializer_range"]),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def check_bloom_compatible(cfg: ModelConfig) -> None:
  """Raises ValueError naming the first ``ModelConfig`` field that HF BLOOM cannot represent.

  BLOOM needs: ``pos_encoding='alibi'``, ``use_bias``, ``embed_layernorm``, ``gelu_approximate``,
  ``head_dim = d_model / num_heads``, ``num_kv_heads = num_heads``, ``mlp_dim = 4 d_model``.
  """
  wanted = {
    "pos_encoding": (cfg.pos_encoding, "alibi"),
    "use_bias": (cfg.use_bias, True),
    "embed_layernorm": (cfg.embed_layernorm, True),
    "gelu_approximate": (cfg.gelu_approximate, True),
    "head_dim": (cfg.head_size, cfg.d_model // cfg.num_heads),
    "num_kv_heads": (cfg.kv_heads, cfg.num_heads),
    "mlp_dim": (cfg.mlp_size, 4 * cfg.d_model),
  }
  if cfg.d_model % cfg.num_heads:
    raise ValueError(f"d_model ({cfg.d_model}) must be divisible by num_heads ({cfg.num_heads}) for BLOOM")
  for name, (got, want) in wanted.items():
    if got != want:
      raise ValueError(f"model config {name} must be {want!r} to be a BLOOM model, got {got!r}")


def hf_config_from(cfg: ModelConfig) -> dict[str, Any]:
  """The HF ``config.json`` dict (``model_type='bloom'``) of a BLOOM-compatible jaxpe config.

  Raises:
    ValueError: see ``check_bloom_compatible``.
  """
  check_bloom_compatible(cfg)
  return {
    "architectures": ["BloomForCausalLM"],
    "model_type": "bloom",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "n_layer": cfg.num_layers,
    "n_head": cfg.num_heads,
    "layer_norm_epsilon": cfg.layernorm_eps,
    "initializer_range": cfg.init_std,
    "tie_word_embeddings": cfg.tie_embeddings,
    "apply_residual_connection_post_layernorm": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "slow_but_exact": False,
    "use_cache": True,
    "dtype": "float32",
  }


# ----------------------------------------------------------------------------------------------
# The declarative name map


@dataclass(frozen=True)
class Dims:
  """Sizes the transforms need: D model dim, N heads, H head dim, F MLP dim, V vocab, L layers."""

  d: int
  n: int
  h: int
  f: int
  v: int
  layers: int

  @classmethod
  def of(cls, cfg: ModelConfig) -> Dims:
    return cls(cfg.d_model, cfg.num_heads, cfg.head_size, cfg.mlp_size, cfg.vocab_size, cfg.num_layers)


def _same(x, dims):
  return (x,)


def _same_back(x, dims):
  return x


def _linear(w, dims):  # HF [out, in] -> jaxpe [in, out]
  return (w.T,)


def _linear_back(k, dims):
  return k.T


def _qkv_weight(w, dims):
  # HF splits the fused output as view(N, 3, H): row r = n * 3H + j * H + h, j = 0 q, 1 k, 2 v.
  w = w.reshape(dims.n, 3, dims.h, dims.d)
  return tuple(np.ascontiguousarray(np.transpose(w[:, j], (2, 0, 1))) for j in range(3))  # [D, N, H]


def _qkv_weight_back(q, k, v, dims):
  stacked = np.stack([np.transpose(x, (1, 2, 0)) for x in (q, k, v)], axis=1)  # [N, 3, H, D]
  return stacked.reshape(3 * dims.d, dims.d)


def _qkv_bias(b, dims):
  b = b.reshape(dims.n, 3, dims.h)
  return tuple(np.ascontiguousarray(b[:, j]) for j in range(3))  # [N, H]


def _qkv_bias_back(q, k, v, dims):
  return np.stack([q, k, v], axis=1).reshape(3 * dims.d)


def _o_weight(w, dims):  # [D_out, N*H] -> [N, H, D]
  return (w.T.reshape(dims.n, dims.h, dims.d),)


def _o_weight_back(o, dims):
  return o.reshape(dims.n * dims.h, dims.d).T


def _lm_head(w, dims):  # BLOOM's untied head has no bias; jaxpe's (use_bias) is held at zero
  return w.T, np.zeros((dims.v,), w.dtype)


def _lm_head_back(kernel, bias, dims):
  if np.any(bias != 0):
    raise ValueError("lm_head.bias must be zero to export to BLOOM (its output head has no bias)")
  return kernel.T


@dataclass(frozen=True)
class Rule:
  """One HF key and the jaxpe parameters it maps to.

  Attributes:
    hf: HF key without the ``transformer.`` prefix; ``{i}`` is the layer index.
    jax: dotted jaxpe parameter paths (``{i}`` = layer) the key feeds, in the order ``to_jax``
      returns them.
    hf_shape: the HF tensor's shape from ``Dims``.
    to_jax: ``(hf_array, dims) -> tuple of jaxpe arrays``.
    to_hf: ``(*jaxpe_arrays, dims) -> hf_array``.
  """

  hf: str
  jax: tuple[str, ...]
  hf_shape: Callable[[Dims], tuple[int, ...]]
  to_jax: Callable[..., tuple[np.ndarray, ...]]
  to_hf: Callable[..., np.ndarray]


def _vec(name):
  return lambda d: (getattr(d, name),)


def _norm(hf: str, jax: str) -> list[Rule]:
  return [
    Rule(f"{hf}.weight", (f"{jax}.scale",), _vec("d"), _same, _same_back),
    Rule(f"{hf}.bias", (f"{jax}.bias",), _vec("d"), _same, _same_back),
  ]


def _attn_paths(kind: str) -> tuple[str, ...]:
  return tuple(f"blocks.{{i}}.attn.{p}.{kind}" for p in "qkv")


LAYER_RULES: tuple[Rule, ...] = (
  *_norm("h.{i}.input_layernorm", "blocks.{i}.attn_norm"),
  Rule(
    "h.{i}.self_attention.query_key_value.weight",
    _attn_paths("kernel"),
    lambda d: (3 * d.d, d.d),
    _qkv_weight,
    _qkv_weight_back,
  ),
  Rule(
    "h.{i}.self_attention.query_key_value.bias",
    _attn_paths("bias"),
    lambda d: (3 * d.d,),
    _qkv_bias,
    _qkv_bias_back,
  ),
  Rule(
    "h.{i}.self_attention.dense.weight",
    ("blocks.{i}.attn.o.kernel",),
    lambda d: (d.d, d.d),
    _o_weight,
    _o_weight_back,
  ),
  Rule("h.{i}.self_attention.dense.bias", ("blocks.{i}.attn.o.bias",), _vec("d"), _same, _same_back),
  *_norm("h.{i}.post_attention_layernorm", "blocks.{i}.mlp_norm"),
  Rule(
    "h.{i}.mlp.dense_h_to_4h.weight",
    ("blocks.{i}.mlp.up.kernel",),
    lambda d: (d.f, d.d),
    _linear,
    _linear_back,
  ),
  Rule("h.{i}.mlp.dense_h_to_4h.bias", ("blocks.{i}.mlp.up.bias",), _vec("f"), _same, _same_back),
  Rule(
    "h.{i}.mlp.dense_4h_to_h.weight",
    ("blocks.{i}.mlp.down.kernel",),
    lambda d: (d.d, d.f),
    _linear,
    _linear_back,
  ),
  Rule("h.{i}.mlp.dense_4h_to_h.bias", ("blocks.{i}.mlp.down.bias",), _vec("d"), _same, _same_back),
)
GLOBAL_RULES: tuple[Rule, ...] = (
  Rule("word_embeddings.weight", ("embed.embedding",), lambda d: (d.v, d.d), _same, _same_back),
  *_norm("word_embeddings_layernorm", "embed_norm"),
  *_norm("ln_f", "final_norm"),
)
LM_HEAD_RULE = Rule(
  "lm_head.weight", ("lm_head.kernel", "lm_head.bias"), lambda d: (d.v, d.d), _lm_head, _lm_head_back
)


def weight_rules(cfg: ModelConfig) -> list[Rule]:
  """The name map of ``cfg``'s model, expanded over its layers (``{i}`` filled in)."""
  dims = Dims.of(cfg)
  rules = list(GLOBAL_RULES)
  for i in range(dims.layers):
    rules += [
      Rule(r.hf.format(i=i), tuple(p.format(i=i) for p in r.jax), r.hf_shape, r.to_jax, r.to_hf)
      for r in LAYER_RULES
    ]
  if not cfg.tie_embeddings:
    rules.append(LM_HEAD_RULE)
  return rules


# ----------------------------------------------------------------------------------------------
# HF state dict -> jaxpe parameters -> Decoder


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


def _listing(keys: list[str], limit: int = 12) -> str:
  """``keys`` as a list, cut to ``limit`` entries with a count of the rest (huge models)."""
  if len(keys) <= limit:
    return str(keys)
  return f"{keys[:limit]} and {len(keys) - limit} more"


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
      f"missing keys {_listing(missing)}, unexpected keys {_listing(unexpected)}"
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


def _path_str(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def build_model(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> Decoder:
  """A ``Decoder`` of ``cfg`` holding ``params`` (dotted path -> array), without a random init.

  Raises:
    CheckpointError: a parameter of the model missing from ``params``, an extra entry, or a shape
      that differs from the model's.
  """
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = list(nnx.to_flat_state(state))
  paths = {_path_str(p) for p, _ in flat}
  missing, extra = sorted(paths - params.keys()), sorted(params.keys() - paths)
  if missing or extra:
    raise CheckpointError(
      f"parameters do not match the model: missing {_listing(missing)}, unexpected {_listing(extra)}"
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
  """Dotted path -> numpy array of every parameter of ``model``."""
  return {_path_str(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ----------------------------------------------------------------------------------------------
# Reading checkpoints


def _read_safetensors(path: Path, want: set[str] | None = None) -> dict[str, Any]:
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
) -> Decoder:
  """Imports a BLOOM model into a jaxpe ``Decoder`` (ALiBi, BLOOM options on).

  Args:
    source: a transformers ``BloomForCausalLM`` (or ``BloomModel``), a local checkpoint directory
      (``config.json`` plus ``model.safetensors``, sharded ``*.safetensors`` with
      ``model.safetensors.index.json``, or ``pytorch_model.bin``), or a state dict (key -> torch
      tensor or numpy array; then ``hf_config`` is required).
    hf_config: config dict or ``BloomConfig``; default the module's or the directory's config.
    dtype: compute dtype of the jaxpe model; parameters are stored in float32.
    max_len: context the model is meant for, in tokens (default 2048).

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
  cfg = config_from_hf(hf_config, dtype=dtype, max_len=max_len)
  return build_model(cfg, params_from_hf(state_dict, cfg))


# ----------------------------------------------------------------------------------------------
# Export


def to_hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
  """The ``BloomForCausalLM`` state dict (``transformer.``-prefixed keys, float32 numpy) of a
  BLOOM-compatible jaxpe model. ``lm_head.weight`` is left out when the embeddings are tied (HF
  ties it on load).

  Raises:
    ValueError: the model's config is not BLOOM-compatible (see ``check_bloom_compatible``), or an
      untied output head with a nonzero bias.
  """
  cfg = model.cfg
  check_bloom_compatible(cfg)
  dims = Dims.of(cfg)
  params = model_params(model)
  out = {}
  for rule in weight_rules(cfg):
    key = rule.hf if rule.hf == "lm_head.weight" else "transformer." + rule.hf
    out[key] = np.ascontiguousarray(rule.to_hf(*(params[p] for p in rule.jax), dims), np.float32)
  return out


EXPORT_FILES = ("config.json", "model.safetensors")
"""The files ``save_hf`` writes (and the only ones it ever replaces)."""


def save_hf(model: Decoder, path: str | Path, *, overwrite: bool = False, force: bool = False) -> Path:
  """Writes an HF checkpoint directory (``config.json`` + ``model.safetensors``) that
  ``transformers.BloomForCausalLM.from_pretrained(path)`` loads.

  Only those two files are ever written or replaced; nothing else in ``path`` is touched (an HF
  directory keeps its ``tokenizer.json`` and ``README.md``). A new directory is written under a
  temporary name and renamed into place; in an existing one each file is written to a temporary
  name and renamed over the old one, so an interrupted export never leaves a half-written file.
  Directories and files get the usual permissions (0777 / 0666 less the umask).

  Args:
    model: a BLOOM-compatible ``Decoder`` (see ``check_bloom_compatible``).
    path: the directory to create or write into; never the current directory or one of its parents.
    overwrite: replace the two files of an existing BLOOM export (a directory whose ``config.json``
      says ``model_type: bloom``).
    force: also write into a non-empty directory that is not a BLOOM export (its files are kept;
      one holding its own ``config.json`` or ``model.safetensors`` is refused even so).

  Returns:
    the directory.

  Raises:
    TypeError: ``model`` not a ``Decoder``; ``path`` not a non-empty str / PathLike; a non-bool
      ``overwrite`` or ``force``.
    ValueError: ``path`` is the current directory or one of its parents; ``path`` holds other
      weight files (``*.safetensors``, ``*.bin``, an index) that would shadow or mix with the new
      ones; see also ``to_hf_state_dict``.
    FileExistsError: ``path`` is a BLOOM export and ``overwrite`` is False, or a non-empty
      directory that is not one and ``force`` is False, or not a directory; or, whatever the flags,
      it holds a ``config.json`` or ``model.safetensors`` that is not a BLOOM export's (another
      model's HF directory).
  """
  import tempfile

  from safetensors.numpy import save_file

  if not isinstance(model, Decoder):
    raise TypeError(f"model must be a jaxpe.model.Decoder, got {type(model).__name__}")
  if not isinstance(path, str | os.PathLike) or str(path) == "":
    raise TypeError(f"path must be a non-empty str or os.PathLike directory, got {path!r}")
  for flag, value in (("overwrite", overwrite), ("force", force)):
    if not isinstance(value, bool):
      raise TypeError(f"{flag} must be True or False, got {value!r}")
  root = Path(path)
  _check_export_target(root, overwrite=overwrite, force=force)
  state = to_hf_state_dict(model)
  config_text = json.dumps(hf_config_from(model.cfg), indent=2) + "\n"
  umask = os.umask(0)
  os.umask(umask)
  fresh = not root.exists()
  root.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent if fresh else root))
  try:
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(config_text)
    for name in EXPORT_FILES:
      (tmp / name).chmod(0o666 & ~umask)
    if fresh:
      tmp.chmod(0o777 & ~umask)
      tmp.rename(root)
    else:
      for name in EXPORT_FILES:
        os.replace(tmp / name, root / name)
      tmp.rmdir()
  except BaseException:
    for name in EXPORT_FILES:
      (tmp / name).unlink(missing_ok=True)
    if tmp.exists():
      tmp.rmdir()
    raise
  return root


def _check_export_target(root: Path, *, overwrite: bool, force: bool) -> None:
  """Raises unless ``save_hf`` may write ``EXPORT_FILES`` into ``root`` (see there)."""
  resolved, cwd = root.resolve(), Path.cwd().resolve()
  if resolved == cwd or resolved in cwd.parents:
    raise ValueError(
      f"refusing to export into {str(root)!r}: it is the current directory or one of its parents; "
      "give a new subdirectory"
    )
  if not root.exists():
    return
  if not root.is_dir():
    raise FileExistsError(f"{str(root)!r} exists and is not a directory")
  others = sorted(p.name for p in root.iterdir() if p.name not in EXPORT_FILES)
  weights = [
    n for n in others if n.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
  ]
  if weights:
    raise ValueError(
      f"{str(root)!r} holds other weight files ({', '.join(weights)}) that would mix with the export; "
      "remove them or choose another directory"
    )
  try:
    is_export = json.loads((root / "config.json").read_text()).get("model_type") == "bloom"
  except (OSError, ValueError, AttributeError):
    is_export = False
  foreign = [n for n in EXPORT_FILES if (root / n).exists()] if not is_export else []
  if foreign:
    raise FileExistsError(
      f"{str(root)!r} holds {' and '.join(foreign)} not from a BLOOM export; the export would replace them "
      "(force=True keeps only other files): choose another directory"
    )
  if is_export and not overwrite:
    raise FileExistsError(
      f"{str(root)!r} already holds a BLOOM export; pass overwrite=True to replace its config.json and "
      "model.safetensors (other files are kept)"
    )
  if not is_export and any(root.iterdir()) and not force:
    listed = ", ".join(sorted(p.name for p in root.iterdir())[:5])
    raise FileExistsError(
      f"{str(root)!r} is not empty ({listed}) and not a BLOOM export; pass force=True to write "
      "config.json and model.safetensors into it (other files are kept), or choose another directory"
    )


def to_transformers(model: Decoder):
  """A transformers ``BloomForCausalLM`` (float32, eval mode) with the weights of ``model``.

  Raises:
    ValueError: see ``to_hf_state_dict``.
  """
  import torch
  from transformers import BloomConfig, BloomForCausalLM

  hf = BloomForCausalLM(BloomConfig(**hf_config_from(model.cfg)))
  state = {k: torch.tensor(v) for k, v in to_hf_state_dict(model).items()}
  hf.load_state_dict(state, strict=not model.cfg.tie_embeddings)
  if model.cfg.tie_embeddings:
    hf.tie_weights()
  return hf.eval()


# ----------------------------------------------------------------------------------------------
# Conversion to RoPE-emulated ALiBi


def emulation_parameters(
  cfg: ModelConfig,
  *,
  context: int | None = None,
  max_phase: float | None = None,
  target_error: float | None = None,
) -> emulation.EmulationPlan:
  """The emulation plan for converting an ALiBi model of ``cfg`` (``jaxpe.emulation.solve_emulation``).

  One theta shared by all heads (one RoPE frequency), rounded down to float32, and the solver's
  predicted worst-case deviation from ALiBi over ``context`` (``plan.bound``, logits).

  Args:
    cfg: the ALiBi model's config.
    context: longest sequence the converted model must serve, in tokens (default ``cfg.max_len``).
    max_phase: largest phase ``d theta`` over the context, radians in (0, pi/2); ``theta =
      max_phase / context`` (the published rule). Default ``cfg.rope_alibi_max_phase`` (0.1: relative
      bias error ``0.1^2 / 6 = 1.7e-3`` at the far end) unless ``target_error`` is given.
    target_error: instead of ``max_phase``, the worst deviation from ALiBi wanted, in logits; the
      solver picks the largest theta that meets it.

  Raises:
    ValueError: both ``max_phase`` and ``target_error``; ``context`` not a positive integer;
      ``max_phase`` outside (0, pi/2); a target below the float32 rounding floor.
  """
  context = cfg.max_len if context is None else _checks.check_positive_int("context", context)
  if max_phase is not None and target_error is not None:
    raise ValueError("give at most one of max_phase (radians) or target_error (logits)")
  if max_phase is None and target_error is None:
    max_phase = cfg.rope_alibi_max_phase
  return emulation.solve_emulation(
    num_heads=cfg.num_heads,
    head_dim=cfg.head_size,
    max_len=context,
    order=1,
    max_phase=max_phase,
    target_error=target_error,
    dtype="float32",
    shared_theta=True,
  )


def bias_error_bound(cfg: ModelConfig, distance, position=None) -> np.ndarray:
  """Predicted ``|emulated - ALiBi|`` score bias per head, in logits, of a converted model.

  ``jaxpe.emulation.emulation_error_bound`` at the model's theta: truncation ``(m/theta)(x - sin x)
  <= m theta^2 d^3 / 6`` (x = d theta) plus the float32 rounding model, which grows with the absolute
  position.

  Args:
    cfg: a ``rope_alibi`` config (theta = ``rope_alibi_max_phase / rope_alibi_context``, in float32).
    distance: ``[...]`` token distances ``d = i - j >= 0``.
    position: ``[...]`` query positions i (broadcastable with ``distance``); default ``distance``
      (key at position 0).

  Returns:
    ``[N, ...]`` float64 bounds.

  Raises:
    ValueError: negative distances or positions.
  """
  from jaxpe.model.encodings import emulation_theta

  theta = float(np.float32(emulation_theta(cfg)))  # the model rotates with the float32 value
  return emulation.emulation_error_bound(
    alibi.alibi_slopes_f64(cfg.num_heads),
    theta=theta,
    distance=distance,
    position=distance if position is None else position,
    order=1,
    dtype="float32",
  )


def to_emulated(
  model: Decoder,
  *,
  context: int | None = None,
  max_phase: float | None = None,
  target_error: float | None = None,
) -> Decoder:
  """Converts an ALiBi model to RoPE-emulated ALiBi with the extra dims in the q/k projections.

  Every q and k head gets two extra output dims with zero kernel columns; their biases carry the
  fixed vectors ``q_fixed = (-N_h, 0)``, ``k_fixed = (0, 1)``, ``N_h = m_h sqrt(H) / theta``; RoPE
  rotates only that pair, at frequency ``theta`` (``ModelConfig.rope_alibi_in_projection``). The
  score term is then ``-(m_h / theta) sin((i - j) theta) ~= -m_h (i - j)``: the ALiBi bias with the
  relative error ``((i - j) theta)^2 / 6``. All other parameters are copied; a model without biases
  gets zero biases elsewhere.

  Args:
    model: a ``Decoder`` with ``pos_encoding='alibi'`` and float32 dtype.
    context, max_phase, target_error: see ``emulation_parameters`` (the solver of
      ``jaxpe.emulation``); default ``max_phase`` 0.1 over ``cfg.max_len``.

  Returns:
    a new ``Decoder`` (``pos_encoding='rope_alibi'``, ``rope_alibi_in_projection=True``).

  Raises:
    ValueError: the model is not an ALiBi model or not float32; bad ``context``, ``max_phase`` or
      ``target_error``.

  Source: the construction of shared/DESIGN.md section 3 (RoPE arXiv 2104.09864, ALiBi arXiv
  2108.12409), with the extra dims realised through the projection as the published BLOOM
  conversion does.
  """
  cfg = model.cfg
  if cfg.pos_encoding != "alibi":
    raise ValueError(f"model pos_encoding must be 'alibi' to convert, got {cfg.pos_encoding!r}")
  if cfg.dtype != "float32":
    raise ValueError(f"model dtype must be 'float32' (the emulation needs float32), got {cfg.dtype!r}")
  plan = emulation_parameters(cfg, context=context, max_phase=max_phase, target_error=target_error)
  theta, context = float(plan.theta[0]), plan.max_len
  new_cfg = cfg.model_copy(
    update=dict(
      pos_encoding="rope_alibi",
      rope_alibi_in_projection=True,
      use_bias=True,
      rope_alibi_max_phase=theta * context,
      rope_alibi_context=context,
    )
  )
  new_cfg = ModelConfig.model_validate(new_cfg.model_dump())  # re-run the validators
  n, h = cfg.num_heads, cfg.head_size
  amp = plan.amplitudes
  old = model_params(model)
  new = {}
  template = nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: Decoder(new_cfg, rngs=nnx.Rngs(0)))))
  for path, var in template:
    name = _path_str(path)
    parts = name.split(".")
    if len(parts) >= 4 and parts[2] == "attn" and parts[3] in ("q", "k"):
      heads = var.shape[-2]
      if parts[4] == "kernel":
        value = np.zeros(var.shape, np.float32)
        value[..., :h] = old[name]
      else:
        value = np.zeros(var.shape, np.float64)
        value[:, :h] = old.get(name, np.zeros((heads, h)))
        value[:, h:] = np.stack([-amp, np.zeros(n)], -1) if parts[3] == "q" else [0.0, 1.0]
    else:
      value = old.get(name, np.zeros(var.shape, np.float32) if parts[-1] == "bias" else None)
      if value is None:
        raise ValueError(f"cannot convert: parameter {name!r} has no counterpart in the ALiBi model")
    new[name] = np.asarray(value, np.float32)
  return build_model(new_cfg, new)


__all__ = [
  "BLOOM_CONTEXT",
  "CheckpointError",
  "Dims",
  "Rule",
  "bias_error_bound",
  "build_model",
  "check_bloom_compatible",
  "config_from_hf",
  "emulation_parameters",
  "from_hf",
  "generate",
  "hf_config_from",
  "model_params",
  "params_from_hf",
  "read_checkpoint",
  "save_hf",
  "to_emulated",
  "to_hf_state_dict",
  "to_transformers",
  "weight_rules",
]
