"""Hugging Face decoder configs -> ``ModelConfig`` keys (issue 47): ``pattern_from_hf_config`` (the
attention pattern: layer types, window, chunk, soft-caps, per-layer RoPE, NoPE layers and Llama 4's
temperature) for Mistral, Qwen3, Gemma 2, Gemma 3 (text), gpt-oss and Llama 4 (text), and
``config_dict_from_hf`` (every key of a ``ModelConfig``) for the families jaxpe's decoder can build
whole: ``mistral``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``gpt_oss``, ``llama4_text``
(``ModelConfig.from_hf_config`` validates it; ``jaxpe.model.hf_weights`` maps the weights).

Read as transformers 5.x writes the configs (``PretrainedConfig.to_dict()`` or a ``config.json``
dict): ``layer_types``, ``sliding_window``, ``attention_chunk_size``, ``attn_logit_softcapping``,
``final_logit_softcapping``, ``rope_parameters`` (per layer type for Gemma 3: the
``sliding_attention`` entry's ``rope_theta`` is ``rope_local_base_freq``), ``no_rope_layers``,
``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``, ``query_pre_attn_scalar``.

Configs refused by ``config_dict_from_hf`` name the piece the decoder lacks: Llama 4 with dense
layers among its moe layers (``interleave_moe_layer_step`` > 1, ``moe_layers``: jaxpe's layers share
one MLP type).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxpe.ops import hf_config, hf_families

PATTERN_FAMILIES = ("mistral", "qwen3", "gemma2", "gemma3_text", "gpt_oss", "llama4_text")
"""``model_type`` values ``pattern_from_hf_config`` reads."""
DECODER_FAMILIES = PATTERN_FAMILIES
"""``model_type`` values ``config_dict_from_hf`` builds whole."""
ATTENTION_BIAS_FAMILIES = ("qwen3", "gemma2", "gemma3_text", "gpt_oss", "llama4_text")
"""Families whose transformers attention puts ``attention_bias`` on q, k, v and o (Mistral's has no
biases whatever its config says)."""


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


# transformers' config classes' sliding_window default, for a config.json dict without the key
HF_DEFAULT_SLIDING_WINDOW = {
  "mistral": 4096,
  "qwen3": 4096,
  "gemma2": 4096,
  "gemma3_text": 4096,
  "gpt_oss": 128,
}


# transformers' config classes' defaults of the keys config_dict_from_hf reads, for a config.json
# dict without them (MistralConfig, Qwen3Config, Gemma2Config, Gemma3TextConfig, transformers 5.25)
_GEMMA_DEFAULTS = dict(
  num_key_value_heads=4,
  head_dim=256,
  hidden_activation="gelu_pytorch_tanh",
  rms_norm_eps=1e-6,
  query_pre_attn_scalar=256,
)
HF_PATTERN_DEFAULTS: dict[str, dict[str, Any]] = {
  "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
  "gemma3_text": dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
  "gpt_oss": dict(rope_theta=150_000.0),
  "llama4_text": dict(rope_theta=500_000.0),
}
GPT_OSS_DEFAULT_ROPE = dict(
  rope_type="yarn",
  factor=32.0,
  beta_fast=32.0,
  beta_slow=1.0,
  truncate=False,
  original_max_position_embeddings=4096,
)
"""``GptOssConfig``'s ``rope_parameters`` when a config gives none (with ``rope_theta`` 150 000)."""
HF_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
  "mistral": dict(num_key_value_heads=8, rms_norm_eps=1e-6, max_position_embeddings=4096 * 32),
  "qwen3": dict(num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=32768),
  "gemma2": dict(_GEMMA_DEFAULTS, max_position_embeddings=8192),
  "gemma3_text": dict(_GEMMA_DEFAULTS, max_position_embeddings=131_072),
  "gpt_oss": dict(
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=131_072,
    num_local_experts=128,
    num_experts_per_tok=4,
    swiglu_limit=7.0,
    swiglu_alpha=1.702,
    attention_bias=True,
    tie_word_embeddings=False,
  ),
  "llama4_text": dict(
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=131_072,
    num_local_experts=16,
    num_experts_per_tok=1,
    use_qk_norm=True,
    tie_word_embeddings=False,
    interleave_moe_layer_step=1,
  ),
}


def _llama4_rope_flags(cfg: Mapping[str, Any], layers: int) -> tuple[int, ...]:
  """Llama 4's ``no_rope_layers`` (1 = RoPE), or Llama4TextConfig's default from
  ``no_rope_layer_interval`` (4): every interval-th layer is NoPE."""
  interval = int(cfg.get("no_rope_layer_interval") or 4)
  flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
  return tuple(int(f) for f in flags)


def _layer_types(cfg: Mapping[str, Any], kind: str, layers: int) -> tuple[str, ...]:
  """``layer_types``, or the default the family's transformers config derives when a
  ``config.json`` has none (as the configs on the Hub written before ``layer_types`` existed):
  Mistral sliding everywhere with a window; Qwen3 sliding from ``max_window_layers`` (28) on with
  a window; Gemma 2 and gpt-oss every second layer full; Gemma 3 every ``sliding_window_pattern``-th
  (6) full; Llama 4 chunked on its RoPE layers when ``attention_chunk_size`` (8192) is set."""
  if cfg.get("layer_types"):
    return tuple(cfg["layer_types"])
  window = cfg.get("sliding_window")
  if kind == "qwen3":
    first = int(cfg.get("max_window_layers", 28))
    return tuple("sliding_attention" if window and i >= first else "full_attention" for i in range(layers))
  if kind in ("gemma2", "gpt_oss", "gemma3_text"):
    every = int(cfg.get("sliding_window_pattern") or 6) if kind == "gemma3_text" else 2
    return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers))
  if kind == "llama4_text":
    chunked = cfg.get("attention_chunk_size", 8192) is not None
    flags = _llama4_rope_flags(cfg, layers)
    return tuple("chunked_attention" if f and chunked else "full_attention" for f in flags)
  return ("sliding_attention" if window else "full_attention",) * layers  # Mistral


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
    ValueError: another ``model_type``; a per-layer-type RoPE entry for sliding layers that scales;
      sliding (chunked) layers with ``sliding_window`` (``attention_chunk_size``) None.
  """
  cfg = hf_config.text_config(hf_config.as_dict(config))
  kind = _model_type(cfg)
  layers = int(cfg["num_hidden_layers"])
  cfg = {**HF_PATTERN_DEFAULTS.get(kind, {}), **cfg}  # keys a config.json left out: the class's default
  if kind == "gpt_oss" and not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
    cfg = {**cfg, "rope_parameters": GPT_OSS_DEFAULT_ROPE}
  if "sliding_window" not in cfg and kind in HF_DEFAULT_SLIDING_WINDOW:  # the config class's default
    cfg = {**cfg, "sliding_window": HF_DEFAULT_SLIDING_WINDOW[kind]}
  if kind == "qwen3" and not cfg.get("use_sliding_window", False):
    cfg = {**cfg, "sliding_window": None}  # Qwen3Config drops the window unless use_sliding_window
  types = _layer_types(cfg, kind, layers)
  if kind == "qwen3" and not cfg.get("sliding_window"):  # Qwen3Attention: no window, full
    types = tuple("full_attention" if t == "sliding_attention" else t for t in types)
  out: dict[str, Any] = _rope(cfg, kind)
  if set(types) != {"full_attention"}:
    out["layer_types"] = types
  for kind_of_layer, key, default in (
    ("sliding_attention", "sliding_window", None),
    ("chunked_attention", "attention_chunk_size", 8192),
  ):
    if kind_of_layer in types:
      size = cfg.get(key, default)
      if size is None:  # transformers' create_sliding_window / chunked_causal_mask refuse it too
        raise ValueError(
          f"{kind} config: layer_types has {kind_of_layer} layers but {key} is None; give {key} "
          f"(tokens) or make those layers full_attention"
        )
      out[key] = int(size)
  for key in SOFT_CAP_KEYS.get(kind, ()):  # the keys transformers' modeling code applies
    if cfg.get(key) is not None:
      out[key] = float(cfg[key])
  if kind == "llama4_text":
    flags = _llama4_rope_flags(cfg, layers)
    if flags and not all(flags):
      out["no_rope_layers"] = flags
      if cfg.get("attn_temperature_tuning", True):  # Llama4TextConfig's defaults
        out.update(attn_temperature_tuning=True, floor_scale=float(cfg.get("floor_scale", 8192)))
        out["attn_scale"] = float(cfg.get("attn_scale", 0.1))
  if "rope_local_base_freq" in out and "sliding_attention" not in types:
    del out["rope_local_base_freq"]
  return out


def config_dict_from_hf(config: Any, **overrides: Any) -> dict[str, Any]:
  """Every ``ModelConfig`` key of an HF config of ``DECODER_FAMILIES`` (``overrides`` last: e.g.
  ``max_len``, ``dtype``, ``attn_implementation``).

  Architecture: ``norm_type`` rmsnorm (Mistral, Qwen3, gpt-oss) or gemma_rmsnorm (Gemma 2/3) with
  ``layernorm_eps = rms_norm_eps``, ``mlp_type='gated'`` with ``hidden_act`` (``hidden_activation``
  for Gemma), ``qk_norm`` (Qwen3, Gemma 3), ``sandwich_norm``, ``scale_embeddings`` and
  ``query_pre_attn_scalar`` (Gemma 2/3), ``attention_bias`` (Qwen3, Gemma 2/3, gpt-oss: on q, k,
  v, o; Mistral's attention has none), ``tie_embeddings = tie_word_embeddings``, ``max_len =
  max_position_embeddings``; gpt-oss: ``mlp_type='moe'`` with ``num_local_experts``,
  ``num_experts_per_tok``, ``swiglu_limit``, ``swiglu_alpha``, ``mlp_bias`` (its router and experts
  are biased) and ``attention_sinks``; plus ``pattern_from_hf_config``.

  Llama 4: ``mlp_type='moe'`` with ``moe_routing='sigmoid_input'``, ``moe_shared_expert`` and
  ``use_qk_norm``.

  Raises:
    ValueError: another family; Llama 4 with dense layers among its moe layers.
  """
  cfg = hf_config.text_config(hf_config.as_dict(config))
  kind = _model_type(cfg)
  cfg = {**HF_CONFIG_DEFAULTS.get(kind, {}), **cfg}
  layers = int(cfg["num_hidden_layers"])
  if kind == "llama4_text":
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    moe_layers = cfg.get("moe_layers") or list(range(step - 1, layers, step))
    if sorted(moe_layers) != list(range(layers)):
      raise ValueError(
        "jaxpe's decoder cannot build llama4_text with dense layers among its moe layers (its layers share "
        f"one MLP type): moe_layers {moe_layers} of {layers} (interleave_moe_layer_step {step}); "
        "pattern_from_hf_config reads its attention pattern"
      )  # keys a config.json left out: the class's default
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
    "attention_bias": kind in ATTENTION_BIAS_FAMILIES and bool(cfg.get("attention_bias", False)),
  }
  if gemma:
    out["query_pre_attn_scalar"] = float(cfg["query_pre_attn_scalar"])
  if kind == "gpt_oss":  # GptOssMLP: a biased top-k router over biased clamped-SwiGLU experts
    del out["hidden_act"]  # GptOssConfig's hidden_act ("silu") is not read by its experts
    out.update(
      mlp_type="moe",
      num_local_experts=int(cfg["num_local_experts"]),
      num_experts_per_tok=int(cfg["num_experts_per_tok"]),
      swiglu_limit=float(cfg["swiglu_limit"]),
      swiglu_alpha=float(cfg["swiglu_alpha"]),
      mlp_bias=True,
      attention_sinks=True,
    )
  if kind == "llama4_text":  # Llama4TextMoe: sigmoid-weighted inputs to the top k, a shared expert
    out.update(
      mlp_type="moe",
      num_local_experts=int(cfg["num_local_experts"]),
      num_experts_per_tok=int(cfg["num_experts_per_tok"]),
      moe_routing="sigmoid_input",
      moe_shared_expert=True,
      use_qk_norm=bool(cfg["use_qk_norm"]),
    )
  out.update(pattern_from_hf_config(cfg))
  out.update(overrides)
  return out
