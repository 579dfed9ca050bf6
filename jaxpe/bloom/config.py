"""BLOOM's ``config.json`` <-> jaxpe's ``ModelConfig``, and the check that a jaxpe model is a BLOOM.

BLOOM (BigScience, arXiv 2211.05100) is a pre-LayerNorm decoder with a LayerNorm on the word
embeddings, a fused per-head ``query_key_value`` projection, biases on every linear layer, GELU in its
tanh form, ALiBi (arXiv 2108.12409) with positions counted from the attention mask, and an output
head tied to the word embeddings. ``jaxpe.model.Decoder`` has all of these as options; this module
turns them on. The reference is HF transformers' ``BloomConfig`` (``models/bloom/configuration_bloom.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxpe.model.config import ModelConfig
from jaxpe.ops import checks as _checks

__all__ = ["BLOOM_CONTEXT", "check_bloom_compatible", "config_from_hf", "hf_config_from"]

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
ISSUE47_KEYS = (
  *("layer_types", "sliding_window_pattern", "sliding_window", "attention_chunk_size"),
  *("attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq", "attn_temperature_tuning"),
  *(
    "norm_type",
    "mlp_type",
    "hidden_act",
    "qk_norm",
    "sandwich_norm",
    "scale_embeddings",
    "query_pre_attn_scalar",
  ),
  *("num_local_experts", "num_experts_per_tok", "swiglu_limit", "attention_bias", "mlp_bias"),
)
"""The decoder keys of issue 47 (attention patterns, llama / gemma blocks): a BLOOM model has each at
its default (``check_bloom_compatible`` refuses another value by name)."""
BLOOM_CONTEXT = 2048  # sequence length BLOOM was trained with (arXiv 2211.05100, table 3)


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
    TypeError: ``hf_config`` neither a mapping nor a config object; ``layer_norm_epsilon`` or
      ``initializer_range`` not a number (a bool, a string).
  """
  raw = dict(_hf_config_dict(hf_config))  # a copy: sizes are normalised to ints below
  model_type = raw.get("model_type")
  if model_type != "bloom":
    raise ValueError(f"config model_type must be 'bloom', got {model_type!r}")
  for key in ("vocab_size", "hidden_size", "n_layer", "n_head"):
    value = raw[key]
    if not _checks.is_int(value) or value <= 0:
      raise ValueError(f"config {key} must be a positive integer, got {value!r}")
    raw[key] = int(value)  # a numpy integer too
  if raw["hidden_size"] % raw["n_head"]:
    raise ValueError(
      f"config hidden_size ({raw['hidden_size']}) must be divisible by n_head ({raw['n_head']})"
    )
  for key in ("apply_residual_connection_post_layernorm", "tie_word_embeddings"):
    _checks.check_bool(f"config {key}", raw[key])  # a JSON string "false" is not False
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
    layernorm_eps=_real(raw, "layer_norm_epsilon"),
    gelu_approximate=True,
    tie_embeddings=bool(raw["tie_word_embeddings"]),
    dtype=dtype,
    init_std=_real(raw, "initializer_range"),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def _real(raw: dict[str, Any], key: str) -> float:
  """``raw[key]`` as a float: a JSON number, not a bool (``float(True)`` is 1.0) or a string."""
  value = raw[key]
  if not (_checks.is_int(value) or isinstance(value, float | np.floating)):
    raise _checks.ArgTypeError(f"config {key} must be a number, got {value!r} ({type(value).__name__})")
  return float(value)


def check_bloom_compatible(cfg: ModelConfig) -> None:
  """Raises ValueError naming the first ``ModelConfig`` field that HF BLOOM cannot represent.

  BLOOM needs: ``pos_encoding='alibi'``, ``use_bias``, ``embed_layernorm``, ``gelu_approximate``,
  ``head_dim = d_model / num_heads``, ``num_kv_heads = num_heads``, ``mlp_dim = 4 d_model``, no
  ``attention_sinks``, and issue 47's keys (``ISSUE47_KEYS``) at their defaults.
  """
  wanted = {
    "pos_encoding": (cfg.pos_encoding, "alibi"),
    "use_bias": (cfg.use_bias, True),
    "embed_layernorm": (cfg.embed_layernorm, True),
    "gelu_approximate": (cfg.gelu_approximate, True),
    "head_dim": (cfg.head_size, cfg.d_model // cfg.num_heads),
    "num_kv_heads": (cfg.kv_heads, cfg.num_heads),
    "mlp_dim": (cfg.mlp_size, 4 * cfg.d_model),
    "attention_sinks": (cfg.attention_sinks, False),  # no sink logits in BLOOM's attention
    # issue 47's keys: BLOOM has none of them (its default values)
    **{k: (getattr(cfg, k), ModelConfig.model_fields[k].default) for k in ISSUE47_KEYS},
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
