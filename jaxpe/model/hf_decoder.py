"""Hugging Face decoder configs -> ``ModelConfig`` keys (issue 47): ``pattern_from_hf_config`` (the
attention pattern: layer types, window, chunk, soft-caps, per-layer RoPE, NoPE layers and Llama 4's
temperature) for Mistral, Qwen3, Gemma 2, Gemma 3 (text), gpt-oss and Llama 4 (text), and
``config_dict_from_hf`` (every key of a ``ModelConfig``) for the families jaxpe's decoder can build
whole: ``mistral``, ``qwen3``, ``gemma2``, ``gemma3_text`` (``ModelConfig.from_hf_config`` validates
it; ``jaxpe.model.hf_weights`` maps the weights).

Read as transformers 5.x writes the configs (``PretrainedConfig.to_dict()`` or a ``config.json``
dict): ``layer_types``, ``sliding_window``, ``attention_chunk_size``, ``attn_logit_softcapping``,
``final_logit_softcapping``, ``rope_parameters`` (per layer type for Gemma 3: the
``sliding_attention`` entry's ``rope_theta`` is ``rope_local_base_freq``), ``no_rope_layers``,
``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``, ``query_pre_attn_scalar``.

Families refused by ``config_dict_from_hf`` name the piece the decoder lacks: gpt-oss and Llama 4
have mixture-of-experts MLPs (and Llama 4 an unweighted L2 q/k norm after RoPE).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxpe.ops import hf_config, hf_families

PATTERN_FAMILIES = ("mistral", "qwen3", "gemma2", "gemma3_text", "gpt_oss", "llama4_text")
"""``model_type`` values ``pattern_from_hf_config`` reads."""
DECODER_FAMILIES = ("mistral", "qwen3", "gemma2", "gemma3_text")
"""``model_type`` values ``config_dict_from_hf`` builds whole."""
_MISSING = {
  "gpt_oss": "a mixture-of-experts MLP (num_local_experts, with gpt-oss's clamped SwiGLU)",
  "llama4_text": "a mixture-of-experts MLP and Llama 4's unweighted L2 q/k norm after RoPE (use_qk_norm)",
}


def _model_type(cfg: Mapping[str, Any]) -> str:
  kind = cfg.get("model_type")
  if kind == "gemma3":  # a composite config's text part
    kind = "gemma3_text"
  if kind not in PATTERN_FAMILIES:
    raise ValueError(f"config's model_type must be one of {list(PATTERN_FAMILIES)}, got {kind!r}")
  return kind


def _rope(cfg: Mapping[str, Any], kind: str) -> dict[str, Any]:
  """``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq`` from ``rope_parameters`` (or the
  v4 keys ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``)."""
  params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  local = None
  if isinstance(params.get("full_attention"), Mapping):  # per layer type (Gemma 3)
    local = params.get("sliding_attention")
    params = params["full_attention"]
  params = dict(params)
  theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
  kind_ = params.get("rope_type", params.get("type", "default"))
  # the pair layout the family's modeling code rotates: Llama 4 adjacent pairs (view_as_complex)
  layout = hf_families.pair_layout(kind, cfg, trailing=False)
  out: dict[str, Any] = {"rope_theta": float(theta), "rope_layout": layout}
  if kind_ != "default" or params.get("partial_rotary_factor") is not None:
    out["rope_scaling"] = {k: v for k, v in params.items() if v is not None}
  if local is not None:
    if local.get("rope_type", "default") != "default":
      raise ValueError(f"{kind}: sliding_attention layers' rope_type must be 'default', got {local!r}")
    out["rope_local_base_freq"] = float(local["rope_theta"])
  elif cfg.get("rope_local_base_freq") is not None:
    out["rope_local_base_freq"] = float(cfg["rope_local_base_freq"])
  return out


# The soft-cap keys each family's transformers modeling code applies: Gemma3Attention keeps
# attn_logit_softcapping in its config but never passes it to the attention (Gemma 3 replaced the
# cap with qk-norm), so a Gemma 3 config's value is not read; the other families have no caps.
SOFT_CAP_KEYS = {
  "gemma2": ("attn_logit_softcapping", "final_logit_softcapping"),
  "gemma3_text": ("final_logit_softcapping",),
}


def pattern_from_hf_config(config: Any) -> dict[str, Any]:
  """The attention-pattern keys of ``ModelConfig`` from an HF config of ``PATTERN_FAMILIES``.

  Args:
    config: a transformers ``PretrainedConfig`` (``Gemma2Config``, ``Gemma3TextConfig``,
      ``MistralConfig``, ``GptOssConfig``, ``Llama4TextConfig``, ``Qwen3Config``; a composite
      config's text part is read) or its ``config.json`` dict.

  Returns:
    a dict of ``ModelConfig`` keys: ``layer_types`` (tuple, when not all full), ``sliding_window``,
    ``attention_chunk_size``, ``attn_logit_softcapping``, ``final_logit_softcapping``, the RoPE keys
    (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``, ``rope_layout``: ``'interleaved'`` for Llama 4, ``'half'`` for the others),
    ``no_rope_layers`` and ``attn_temperature_tuning`` / ``floor_scale`` / ``attn_scale``
    (Llama 4), each only when the config uses it.

  Raises:
    TypeError: ``config`` neither a dict nor a ``PretrainedConfig``.
    ValueError: another ``model_type``; a per-layer-type RoPE entry for sliding layers that scales.
  """
  cfg = hf_config.text_config(hf_config.as_dict(config))
  kind = _model_type(cfg)
  layers = int(cfg["num_hidden_layers"])
  types = tuple(cfg.get("layer_types") or ())
  if not types:  # Mistral: sliding everywhere when the config has a window
    types = ("sliding_attention" if cfg.get("sliding_window") else "full_attention",) * layers
  out: dict[str, Any] = _rope(cfg, kind)
  if set(types) != {"full_attention"}:
    out["layer_types"] = types
  if "sliding_attention" in types:
    out["sliding_window"] = int(cfg["sliding_window"])
  if "chunked_attention" in types:
    out["attention_chunk_size"] = int(cfg["attention_chunk_size"])
  for key in SOFT_CAP_KEYS.get(kind, ()):  # the keys transformers' modeling code applies
    if cfg.get(key) is not None:
      out[key] = float(cfg[key])
  if kind == "llama4_text":
    flags = tuple(int(f) for f in cfg.get("no_rope_layers") or ())
    if flags and not all(flags):
      out["no_rope_layers"] = flags
      if cfg.get("attn_temperature_tuning"):
        out.update(attn_temperature_tuning=True, floor_scale=float(cfg["floor_scale"]))
        out["attn_scale"] = float(cfg["attn_scale"])
  if "rope_local_base_freq" in out and "sliding_attention" not in types:
    del out["rope_local_base_freq"]
  return out


def config_dict_from_hf(config: Any, **overrides: Any) -> dict[str, Any]:
  """Every ``ModelConfig`` key of an HF config of ``DECODER_FAMILIES`` (``overrides`` last: e.g.
  ``max_len``, ``dtype``, ``attn_implementation``).

  Architecture: ``norm_type`` rmsnorm (Mistral, Qwen3) or gemma_rmsnorm (Gemma 2/3) with
  ``layernorm_eps = rms_norm_eps``, ``mlp_type='gated'`` with ``hidden_act`` (``hidden_activation``
  for Gemma), ``qk_norm`` (Qwen3, Gemma 3), ``sandwich_norm``, ``scale_embeddings`` and
  ``query_pre_attn_scalar`` (Gemma 2/3), ``use_bias = attention_bias`` (refused when True: the
  decoder's biases would also sit on the MLP), ``tie_embeddings = tie_word_embeddings``,
  ``max_len = max_position_embeddings``; plus ``pattern_from_hf_config``.

  Raises:
    ValueError: gpt-oss or Llama 4 (naming the piece the decoder lacks), another family,
      ``attention_bias`` True.
  """
  cfg = hf_config.text_config(hf_config.as_dict(config))
  kind = _model_type(cfg)
  if kind not in DECODER_FAMILIES:
    raise ValueError(
      f"jaxpe's decoder cannot build {kind}: it lacks {_MISSING[kind]}; pattern_from_hf_config reads its "
      "attention pattern"
    )
  if cfg.get("attention_bias"):
    raise ValueError(f"{kind} with attention_bias=True: jaxpe's use_bias would also add MLP biases")
  gemma = kind.startswith("gemma")
  out: dict[str, Any] = {
    "vocab_size": int(cfg["vocab_size"]),
    "d_model": int(cfg["hidden_size"]),
    "num_layers": int(cfg["num_hidden_layers"]),
    "num_heads": int(cfg["num_attention_heads"]),
    "num_kv_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
    "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
    "mlp_dim": int(cfg["intermediate_size"]),
    "max_len": int(cfg["max_position_embeddings"]),
    "pos_encoding": "rope",
    "norm_type": "gemma_rmsnorm" if gemma else "rmsnorm",
    "layernorm_eps": float(cfg["rms_norm_eps"]),
    "mlp_type": "gated",
    "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
    "qk_norm": kind in ("qwen3", "gemma3_text"),
    "sandwich_norm": gemma,
    "scale_embeddings": gemma,
    "tie_embeddings": bool(cfg.get("tie_word_embeddings", gemma)),
  }
  if gemma:
    out["query_pre_attn_scalar"] = float(cfg["query_pre_attn_scalar"])
  out.update(pattern_from_hf_config(cfg))
  out.update(overrides)
  return out
