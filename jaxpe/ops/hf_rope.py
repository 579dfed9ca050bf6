"""RoPE settings from a Hugging Face model config: ``rope_from_hf_config(config)``.

Takes a ``config.json`` dict (transformers v4 ``rope_scaling`` or v5 ``rope_parameters``) or a
transformers ``PretrainedConfig`` and returns a ``HFRope``: the inverse frequencies, the attention
factor, head and rotary dims, the pair layout, where the rotated dims sit in the head, the softmax
scale factor some families add, and ``frequencies(seq_len)`` for the length-dependent types
(``dynamic``, ``longrope``). The rules are transformers 5.24's config standardisation
(``modeling_rope_utils.RotaryEmbeddingConfigMixin`` and the families' ``convert_rope_params_to_dict``):

* the rope dict is ``rope_scaling`` or ``rope_parameters`` (``rope_scaling`` first, as
  transformers); ``type`` and ``rope_type`` (and legacy names: ``"su"`` -> ``longrope``; in Phi-3
  configs also ``"yarn"`` -> ``longrope``; Qwen2-VL's ``"mrope"`` -> ``default`` with
  ``mrope_section``) via ``jaxpe.rope_scaling.normalize_rope_parameters``;
* ``rope_theta`` and ``partial_rotary_factor`` inside the dict win over the top-level keys (v4
  configs have them at the top level; GPT-NeoX spells them ``rotary_emb_base`` / ``rotary_pct``);
* for ``llama3``, ``yarn`` and ``longrope`` a top-level ``original_max_position_embeddings`` wins
  over the nested one (Phi-3.5 ships it only at the top level; Phi-3 / Phi-4-multimodal config
  classes declare 4096, so their top-level value is 4096 when config.json omits it), else the
  nested one, else ``max_position_embeddings``; ``dynamic`` uses ``max_position_embeddings`` (transformers ignores
  a nested original length for it);
* head dim: ``head_dim`` when set, else ``hidden_size // num_attention_heads``; MLA families
  (DeepSeek-V2/V3...) rotate ``qk_rope_head_dim`` trailing dims; GPT-J / CodeGen rotate
  ``rotary_dim`` leading dims;
* per-layer-type parameters (Gemma-3 / Gemma-3n / ModernBERT: ``sliding_attention`` /
  ``full_attention``; their v4 configs spell the bases ``rope_theta`` / ``rope_local_base_freq``,
  ModernBERT ``global_rope_theta`` / ``local_rope_theta``): pass ``layer_type``.

Keys of the rope dict that jaxpe does not understand raise ``ValueError`` naming them.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any, Literal

import jax

from jaxpe.ops import rope_scaling as _rs

# Families whose transformers modeling code rotates adjacent pairs (2i, 2i+1) ("interleaved");
# every other family uses rotate_half ("half"). Found in transformers 5.24: ``rotate_every_two`` or a
# ``rotate_half`` that slices ``x[..., ::2]``, or complex multiplication (``view_as_complex``).
INTERLEAVED_FAMILIES: frozenset[str] = frozenset(
  {
    "bailing_hybrid",
    "blt",
    "blt_global_transformer",
    "blt_local_decoder",
    "blt_local_encoder",
    "blt_patcher",
    "codegen",
    "cohere",
    "cohere2",
    "cohere2_moe",
    "deepseek_v2",
    "deepseek_v32",
    "deepseek_v4",
    "ernie4_5",
    "ernie4_5_moe",
    "glm",
    "glm4",
    "glm4v",
    "glm4v_text",
    "glm_moe_dsa",
    "glm_ocr",
    "glm_ocr_text",
    "gptj",
    "helium",
    "hy_v4_vl",
    "hy_v4_vl_text",
    "llama4",
    "llama4_text",
    "longcat_flash",
    "mistral_large4",
    "mistral_large4_text",
    "moonshine",
    "moonshine_streaming",
    "openai_privacy_filter",
    "pe_audio_encoder",
    "pe_audio_video_encoder",
    "pe_video_encoder",
    "axk2",
  }
)
# Latent-attention (MLA) families: q/k heads are [nope | rope], the rope part is qk_rope_head_dim
# wide and last. Those with a ``rope_interleave`` config key (default True) rotate interleaved pairs
# when it is set, rotate-half otherwise.
_MLA_FAMILIES = frozenset(
  {
    "axk1",
    "axk2",
    "bailing_hybrid",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "hy_v4",
    "hy_v4_vl",
    "longcat_flash",
    "minicpm3",
    "mistral4",
    "mistral_large4",
    "mistral_large4_text",
    "sarvam_mla",
    "youtu",
  }
)
_ROPE_INTERLEAVE_FAMILIES = frozenset(
  {"axk1", "deepseek_v3", "glm4_moe_lite", "mistral4", "sarvam_mla", "youtu"}
)
# Families whose attention multiplies the softmax scale by yarn_get_mscale(factor, mscale_all_dim)**2
# (``yarn_apply_mscale`` in their modeling code).
_MSCALE_SOFTMAX_FAMILIES = frozenset(
  {
    "axk1",
    "axk2",
    "bailing_hybrid",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "hy_v4",
    "hy_v4_vl",
    "longcat_flash",
    "minicpm3",
    "mistral4",
    "mistral_large4",
    "youtu",
  }
)
# Config-class defaults that a config.json written by transformers leaves out (it saves only values
# that differ from the class defaults): rope_theta, partial_rotary_factor and the top-level
# original_max_position_embeddings (Phi-3: a class attribute, so transformers always prefers it to a
# nested one) per family, transformers 5.24. Families not listed use the generic defaults (theta 1e4 is *not* assumed: a config without
# rope_theta from an unlisted family is an error).
_FAMILY_DEFAULTS: dict[str, dict[str, float | int]] = {
  "llama": {"rope_theta": 10000.0},
  "mistral": {"rope_theta": 10000.0},
  "mixtral": {"rope_theta": 1e6},
  "qwen2": {"rope_theta": 10000.0},
  "qwen2_moe": {"rope_theta": 10000.0},
  "qwen3": {"rope_theta": 10000.0},
  "gemma": {"rope_theta": 10000.0},
  "gemma2": {"rope_theta": 10000.0},
  "phi3": {"rope_theta": 10000.0, "original_max_position_embeddings": 4096},
  "phi4_multimodal": {"original_max_position_embeddings": 4096},
  "phi": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
  "persimmon": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
  "gpt_neox": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
  "gpt_neox_japanese": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0},
  "gptj": {"rope_theta": 10000.0},
  "codegen": {"rope_theta": 10000.0},
  "falcon": {"rope_theta": 10000.0},
  "stablelm": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
  "deepseek_v2": {"rope_theta": 10000.0},
  "deepseek_v3": {"rope_theta": 10000.0},
  "cohere": {"rope_theta": 500000.0},
  "glm": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
  "glm4": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
  "qwen2_vl": {"rope_theta": 1e6},
  "qwen2_5_vl": {"rope_theta": 1e6},
}
# GPT-J and CodeGen: fixed base 10000 and an integer ``rotary_dim`` (HF ``create_sinusoidal_positions``).
_ROTARY_DIM_FAMILIES = frozenset({"gptj", "codegen"})
_PHI3_FAMILIES = frozenset({"phi3", "phi4_multimodal"})  # legacy "yarn" means longrope here
_MROPE_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})  # legacy "mrope" means default + mrope_section
# Families whose v4 config.json gives one base per layer type outside the rope dict (transformers'
# convert_rope_params_to_dict): (full-attention base key, sliding base key, their class defaults,
# whether rope_scaling applies to the sliding layers too).
_LOCAL_THETA_FAMILIES: dict[str, tuple[str, str, float, float, bool]] = {
  "gemma3": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
  "gemma3_text": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
  "gemma3n": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
  "modernbert": ("global_rope_theta", "local_rope_theta", 160_000.0, 10_000.0, True),
  "modernbert-decoder": ("global_rope_theta", "local_rope_theta", 160_000.0, 10_000.0, True),
}
_GEMMA3_FAMILIES = frozenset(_LOCAL_THETA_FAMILIES)
_NO_ROPE_FAMILIES = frozenset({"bloom", "mpt", "gpt2", "opt", "bert", "roberta", "t5", "baichuan"})
# Families whose nested rope_parameters are keyed by labels other than layer_types
# (transformers' ``_rope_type_labels``).
_ROPE_TYPE_LABELS = {"deepseek_v4": ("main", "compress"), "lfm3": ("full_attention", "sliding_attention")}
# Where a family's config.json spells the head dim differently (transformers' attribute_map).
_HEAD_DIM_KEYS = {"jetmoe": "kv_channels", "zamba2": "attention_head_dim"}
_HEADS_KEYS = {"moonshine": "decoder_num_attention_heads"}
# Families whose rotary table transformers builds in a way jaxpe's 1-D inv_freq does not describe.
_UNSUPPORTED = {
  "nanochat": "its rotate_half has flipped signs (rotation by -theta), neither jaxpe layout",
  "eomt_dinov3": "it is a vision transformer with 2-D patch RoPE (jaxpe's tables are 1-D token positions)",
  "dinov3_vit": "it is a vision transformer with 2-D patch RoPE (jaxpe's tables are 1-D token positions)",
  "ernie4_5_vl_moe": "its text rotary embedding pre-permutes the height/width frequencies of mrope_section",
  "ernie4_5_vl_moe_text": "its text rotary embedding pre-permutes the height/width frequencies of mrope_section",
}
# Types whose transformers standardisation moves an original pretraining length into the dict.
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True, eq=False)
class HFRope:
  """What a RoPE layer needs to reproduce a Hugging Face model's rotary embedding.

  Attributes:
    model_type: the config's ``model_type`` (None when absent).
    layer_type: the per-layer-type entry used (``"full_attention"``, ...) or None.
    rope_type: one of ``jaxpe.ROPE_TYPES`` after normalisation (``"su"`` reads as ``"longrope"``).
    parameters: the normalised rope dict passed to ``jaxpe.rope_frequencies`` (with ``rope_theta``
      and, for llama3/yarn/longrope, ``original_max_position_embeddings``).
    head_dim: H, the per-head width the rotary embedding is built for (MLA: ``qk_rope_head_dim``).
    rotary_dim: R <= H, the rotated dims (even); ``inv_freq`` has R/2 entries (``proportional``,
      Gemma-4: R = H with zero frequencies past the rotated share, as transformers).
    rope_theta: base of the frequencies (radians per token at pair 0 is 1).
    layout: ``"half"`` (rotate-half, pairs (i, i + R/2)) or ``"interleaved"`` (pairs (2i, 2i+1)),
      as ``jaxpe.apply_rope(layout=...)`` takes it.
    rotated_slice: ``"leading"`` (the first R dims of each q/k head rotate; standard) or
      ``"trailing"`` (DeepSeek-V2/V3/V4-style heads ``[nope | rope]``: the last R dims of each q/k
      head rotate, e.g. the last ``qk_rope_head_dim`` of ``qk_head_dim``).
    max_position_embeddings: the config's context length in tokens (None when absent).
    original_max_position_embeddings: the pretraining length that the scaling uses (None when the
      type has none).
    mrope_section: multimodal RoPE sections (Qwen2-VL), or None; jaxpe's ``inv_freq`` is the plain
      1-D table, the split over (temporal, height, width) positions is the caller's.
    inv_freq: ``[R/2]`` float32 radians per token at transformers' init (``seq_len=None``:
      ``dynamic`` unscaled, ``longrope`` short factors).
    attention_factor: multiplies cos and sin (``jaxpe.apply_rope(scale=...)``); yarn and longrope.
    softmax_scale_factor: multiplies the attention softmax scale ``1/sqrt(qk_head_dim)``
      (``yarn_get_mscale(factor, mscale_all_dim) ** 2`` in DeepSeek-V2/V3 style models; else 1).
    length_dependent: True for ``dynamic`` and ``longrope``: use ``frequencies(seq_len)``.
    query_scale_beta: Ministral-3 / Mistral-4's ``llama_4_scaling_beta`` (queries multiplied by
      ``query_scale(positions)``), or None.
  """

  model_type: str | None
  layer_type: str | None
  rope_type: str
  parameters: Mapping[str, Any]
  head_dim: int
  rotary_dim: int
  rope_theta: float
  layout: Literal["half", "interleaved"]
  rotated_slice: Literal["leading", "trailing"]
  max_position_embeddings: int | None
  original_max_position_embeddings: int | None
  mrope_section: tuple[int, ...] | None
  inv_freq: jax.Array
  attention_factor: float
  softmax_scale_factor: float
  length_dependent: bool
  query_scale_beta: float | None = None

  def query_scale(self, positions: jax.Array) -> jax.Array:
    """Ministral-3 / Mistral-4 position-dependent query scale ``[B, T]`` float32.

    ``1 + beta * log(1 + floor(p / original_max_position_embeddings))`` with ``beta =
    query_scale_beta`` (the config's ``llama_4_scaling_beta``); multiply the rotated queries by
    ``query_scale(positions)[:, :, None, None]``. All ones when the config has no beta.

    Raises:
      ValueError: ``positions`` not ``[B, T]``, or (concrete) negative or >= 2^31; a beta without
        an original length. Traced negative positions are not checked (their scale is NaN or
        below 1).
      TypeError (also a ValueError): ``positions`` not integers.
    """
    import jax.numpy as jnp

    from jaxpe.ops import checks as _checks

    positions = _checks.as_array("positions", positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
      raise _checks.ArgTypeError(
        f"positions must be [B, T] integer token indices, got {positions.shape} {positions.dtype}"
      )
    _checks.check_rank("positions", positions, 2, "[B, T]")
    _checks.check_positions("positions", positions)
    positions = jnp.asarray(positions)
    if self.query_scale_beta is None:
      return jnp.ones(positions.shape, jnp.float32)
    if self.original_max_position_embeddings is None:
      raise ValueError("query_scale needs original_max_position_embeddings in the config's rope parameters")
    blocks = jnp.floor_divide(positions, self.original_max_position_embeddings).astype(jnp.float32)
    return jnp.float32(1.0) + jnp.float32(self.query_scale_beta) * jnp.log1p(blocks)

  def frequencies(self, seq_len: int | jax.Array | None = None) -> tuple[jax.Array, float]:
    """``(inv_freq [R/2] float32, attention_factor)`` for a sequence of ``seq_len`` tokens.

    Pass what transformers' ``dynamic_rope_update`` sees: ``max(position_ids) + 1`` of the call
    (with a KV cache, the total length so far). ``longrope`` switches to the long factors when
    ``seq_len > original_max_position_embeddings``; ``dynamic`` grows the base once ``seq_len >
    max_position_embeddings`` (stateless: a fresh transformers module, no cache of the longest
    length seen). Other types ignore ``seq_len``. A traced int scalar works under ``jax.jit``.

    Raises:
      ValueError: ``seq_len`` negative or not an integer.
    """
    return _rs.rope_frequencies(
      self.parameters,
      head_dim=self.head_dim,
      rotary_dim=self.rotary_dim,
      max_position_embeddings=self.max_position_embeddings,
      seq_len=seq_len,
    )


def _as_dict(config: Any) -> dict[str, Any]:
  if isinstance(config, Mapping):
    return dict(config)
  get_text_config = getattr(config, "get_text_config", None)
  if callable(get_text_config):  # composite (vision-language) configs: the decoder's config
    try:
      config = get_text_config()
    except ValueError:  # several candidate text configs: keep the whole config
      pass
  to_dict = getattr(config, "to_dict", None)
  if callable(to_dict):  # transformers PretrainedConfig (already standardised by transformers)
    out = to_dict()
    if isinstance(out, Mapping):
      out = dict(out)
      # Properties (Falcon's head_dim) and attribute_map aliases are not in to_dict().
      for key in (
        "head_dim",
        "hidden_size",
        "num_attention_heads",
        "max_position_embeddings",
        "_rope_type_labels",
      ):
        if out.get(key) is None:
          try:
            value = getattr(config, key, None)
          except Exception:  # noqa: BLE001 - heterogeneous configs refuse global per-layer attributes
            value = None
          if value is not None:
            out[key] = value
      return out
  raise TypeError(
    f"config must be a config.json dict or a transformers PretrainedConfig, got {type(config).__name__}"
  )


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
  """The decoder part of a composite (vision-language) config, as transformers' get_text_config."""
  has_rope = any(k in cfg for k in ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim"))
  text = cfg.get("text_config")
  if not has_rope and isinstance(text, Mapping):
    return dict(text)
  return cfg


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
  value = cfg[key]
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"config[{key!r}] must be a positive integer, got {value!r}")
  return value


def _first(cfg: Mapping[str, Any], *keys: str) -> Any:
  for key in keys:
    if cfg.get(key) is not None:
      return cfg[key]
  return None


def _rope_dict(cfg: dict[str, Any], model_type: str | None) -> dict[str, Any]:
  """The raw rope dict (possibly nested by layer type), per transformers' convert_rope_params_to_dict."""
  scaling, parameters = cfg.get("rope_scaling"), cfg.get("rope_parameters")
  if scaling and parameters and dict(scaling) != dict(parameters):
    raise ValueError(
      "config has both 'rope_scaling' and 'rope_parameters' and they differ; transformers reads "
      f"'rope_scaling' ({dict(scaling)}) and would ignore 'rope_parameters' ({dict(parameters)}): "
      "keep one"
    )
  raw = scaling or parameters or {}
  if not isinstance(raw, Mapping):
    raise ValueError(f"config['rope_scaling' / 'rope_parameters'] must be a dict, got {raw!r}")
  raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
  if model_type in _LOCAL_THETA_FAMILIES:
    full_key, local_key, full_default, local_default, both = _LOCAL_THETA_FAMILIES[model_type]
    if not any(k in raw for k in ("full_attention", "sliding_attention")):
      # v4 Gemma-3 / ModernBERT: rope_scaling is the full-attention entry (ModernBERT: both entries)
      # and the bases are top-level keys.
      scaling = dict(raw)
      raw = {"full_attention": dict(scaling), "sliding_attention": dict(scaling) if both else {}}
    for layer, key, default in (
      ("full_attention", full_key, full_default),
      ("sliding_attention", local_key, local_default),
    ):
      entry = raw.setdefault(layer, {"rope_type": "default"})
      if entry is not None:
        entry.setdefault("rope_type", entry.get("type", "default"))
        entry.setdefault("rope_theta", _first(cfg, key) or default)
  return raw


def _layer_types(cfg: Mapping[str, Any], raw: Mapping[str, Any], model_type: str | None) -> list[str]:
  """Keys of ``raw`` that are layer types (transformers' nested_rope_parameter_keys)."""
  labels = set(
    cfg.get("_rope_type_labels") or _ROPE_TYPE_LABELS.get(model_type) or cfg.get("layer_types") or ()
  )
  if model_type in _GEMMA3_FAMILIES:
    labels |= {"full_attention", "sliding_attention"}
  return sorted(k for k in raw if k in labels)


def _family_rope_type(params: dict[str, Any], model_type: str | None) -> dict[str, Any]:
  params = dict(params)
  for key in ("type", "rope_type"):
    kind = params.get(key)
    if model_type in _PHI3_FAMILIES and kind in ("su", "yarn"):
      params[key] = "longrope"  # Phi3Config: "For backward compatibility if previous version used su or yarn"
    if model_type in _MROPE_FAMILIES and kind == "mrope":
      params[key] = "default"  # Qwen2VLConfig: mrope is default RoPE with mrope_section
  return params


def _head_dim(cfg: Mapping[str, Any], model_type: str | None, layer_type: str | None, mla: bool) -> int:
  """The width the rotary embedding is built for (transformers: ``config.head_dim`` or
  ``hidden_size // num_attention_heads``, with the family's aliases and per-layer overrides)."""
  if mla:
    return _positive_int(cfg, "qk_rope_head_dim")
  if layer_type is not None and isinstance(cfg.get("per_layer_config"), Mapping):
    # Heterogeneous configs (Gemma-4): layers of this type may override head_dim.
    types_ = list(cfg.get("layer_types") or ())
    dims = {
      int(v["head_dim"])
      for k, v in cfg["per_layer_config"].items()
      if isinstance(v, Mapping)
      and v.get("head_dim") is not None
      and int(k) < len(types_)
      and types_[int(k)] == layer_type
    }
    if len(dims) > 1:
      raise ValueError(f"layers of type {layer_type!r} have different head_dim overrides {sorted(dims)}")
    if dims:
      return dims.pop()
  if layer_type == "full_attention" and cfg.get("global_head_dim") is not None:
    return _positive_int(cfg, "global_head_dim")  # Gemma-4 config.json spelling
  key = _HEAD_DIM_KEYS.get(model_type, "head_dim")
  if cfg.get(key) is not None:
    return _positive_int(cfg, key)
  hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
  heads = _first(
    cfg, _HEADS_KEYS.get(model_type, "num_attention_heads"), "num_attention_heads", "n_head", "n_heads"
  )
  if hidden is None or heads is None:
    raise ValueError("config needs head_dim, or hidden_size and num_attention_heads, for the rotary dim")
  for name, value in (("hidden_size", hidden), ("num_attention_heads", heads)):
    _positive_int({name: value}, name)
  return _positive_int(
    {"hidden_size // num_attention_heads": hidden // heads}, "hidden_size // num_attention_heads"
  )


def _check_rotary_dim(
  cfg: Mapping[str, Any],
  params: Mapping[str, Any],
  family: Any,
  head_dim: int,
  rotary_dim: int | None,
  mla: bool,
) -> None:
  """ValueError in the config's terms when the rotated dims would be odd or zero (transformers rounds
  an odd partial dim up, which jaxpe's pairs cannot express)."""
  prf = params.get("partial_rotary_factor")
  if rotary_dim is not None or params.get("rope_type") == "proportional":
    return
  if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1):
    return  # rope_frequencies names the bad partial_rotary_factor
  dim = head_dim if prf is None else int(head_dim * prf)
  if dim > 0 and dim % 2 == 0:
    return
  key = _HEAD_DIM_KEYS.get(family, "head_dim")
  if mla:
    source = "'qk_rope_head_dim'"
  elif cfg.get(key) is not None:
    source = repr(key)
  else:
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(
      cfg, _HEADS_KEYS.get(family, "num_attention_heads"), "num_attention_heads", "n_head", "n_heads"
    )
    source = f"hidden_size // num_attention_heads = {hidden} // {heads}"
  scaled = "" if prf is None else f" * partial_rotary_factor {prf}"
  raise ValueError(
    f"config gives rotary dim {dim} = head_dim {head_dim} (from {source}){scaled}; the rotated dims "
    "must be even and > 0 (RoPE rotates pairs)"
  )


def _family(model_type: Any) -> Any:
  """The name jaxpe's family tables use: a composite model's text config (``qwen2_5_vl_text``,
  ``mistral_large4_text``) is its family's decoder, so ``<family>_text`` reads as ``<family>`` unless
  the family is unknown to them (each table that names a ``<family>_text`` names ``<family>`` too)."""
  if not isinstance(model_type, str) or not model_type.endswith("_text"):
    return model_type
  tables = (
    INTERLEAVED_FAMILIES,
    _MLA_FAMILIES,
    _ROPE_INTERLEAVE_FAMILIES,
    _MSCALE_SOFTMAX_FAMILIES,
    _FAMILY_DEFAULTS,
    _ROTARY_DIM_FAMILIES,
    _PHI3_FAMILIES,
    _MROPE_FAMILIES,
    _GEMMA3_FAMILIES,
    _NO_ROPE_FAMILIES,
    _ROPE_TYPE_LABELS,
    _HEAD_DIM_KEYS,
    _HEADS_KEYS,
    _UNSUPPORTED,
  )
  family = model_type[: -len("_text")]
  return family if any(family in t for t in tables) else model_type


def rope_from_hf_config(config: Any, *, layer_type: str | None = None) -> HFRope:
  """Everything a RoPE layer needs from a Hugging Face model config.

  Args:
    config: a ``config.json`` dict (``json.load``) or a transformers ``PretrainedConfig``. Composite
      configs (a ``text_config`` and no rope keys at the top) use their ``text_config``.
    layer_type: for configs with per-layer-type rope parameters (Gemma-3's ``"sliding_attention"``
      / ``"full_attention"``, and any v5 config whose ``rope_parameters`` is keyed by
      ``layer_types``): which entry. Must be None for the other configs.

  Returns:
    ``HFRope`` (frozen): ``inv_freq [R/2]`` float32 radians per token, ``attention_factor`` (scales
    cos and sin), ``head_dim``, ``rotary_dim``, ``layout``, ``rotated_slice``,
    ``softmax_scale_factor``, ``length_dependent`` and ``frequencies(seq_len)``; see ``HFRope``.
    Apply with ``jaxpe.apply_rope(x, positions, inv_freq=r.inv_freq, layout=r.layout,
    scale=r.attention_factor)`` on the rotated slice of each head.

  Raises:
    TypeError: ``config`` is neither a mapping nor has ``to_dict()``.
    ValueError: unknown keys in the rope dict (named); unknown ``rope_type``; a family without
      RoPE (``alibi: true`` Falcon, BLOOM, MPT, ...); no ``rope_theta`` where transformers' default
      for the ``model_type`` is not known to jaxpe; missing ``hidden_size`` / ``num_attention_heads``;
      ``layer_type`` missing, unknown or given for a config without per-layer entries; both
      ``rope_scaling`` and ``rope_parameters`` set and different; ``mscale_all_dim`` without
      ``factor`` in a family that scales its softmax by it; every value check of
      ``jaxpe.rope_frequencies``.

  Source: transformers 5.24 ``modeling_rope_utils`` (``RotaryEmbeddingConfigMixin``
  ``convert_rope_params_to_dict`` / ``standardize_rope_params``, ``ROPE_INIT_FUNCTIONS``), the
  families' configuration files (Phi3, GPT-NeoX, Gemma-3, Qwen2-VL, DeepSeek-V3) and their modeling
  files for layout and head slicing; tested against their ``*RotaryEmbedding`` modules.
  """
  cfg = _text_config(_as_dict(config))
  model_type = cfg.get("model_type")
  family = _family(model_type)
  if family == "falcon" and cfg.get("alibi"):
    raise ValueError("config has alibi: true (Falcon with ALiBi): the model has no rotary embedding")
  if family in _NO_ROPE_FAMILIES:
    raise ValueError(f"model_type {model_type!r} has no rotary embedding in transformers")
  if family in _UNSUPPORTED:
    raise ValueError(
      f"model_type {model_type!r} is not supported by rope_from_hf_config: {_UNSUPPORTED[family]}"
    )
  defaults = _FAMILY_DEFAULTS.get(family, {})

  raw = _rope_dict(cfg, family)
  nested = _layer_types(cfg, raw, family)
  if nested:
    if layer_type is None or layer_type not in nested:
      raise ValueError(
        f"config has per-layer-type rope parameters for {nested}; pass layer_type= one of them, "
        f"got {layer_type!r}"
      )
    params = raw[layer_type]
    if params is None:
      raise ValueError(
        f"config's rope parameters for layer_type {layer_type!r} are None (a layer without RoPE)"
      )
    params = dict(params)
  else:
    if layer_type is not None:
      raise ValueError(
        f"layer_type must be None for a config without per-layer-type rope parameters, got {layer_type!r}"
      )
    params = dict(raw)
  params = _family_rope_type(params, family)
  query_scale_beta = params.pop("llama_4_scaling_beta", None)  # Ministral-3 / Mistral-4: scales queries

  # rope_theta / partial_rotary_factor: the dict's value first, then the top-level key (and the
  # family's legacy spelling), then the family default (transformers' setdefault order).
  if params.get("rope_theta") is None:
    theta = _first(cfg, "rope_theta", "rotary_emb_base")
    if theta is None and family in _ROTARY_DIM_FAMILIES:
      theta = 10000.0  # hard-coded in create_sinusoidal_positions
    if theta is None:
      theta = defaults.get("rope_theta")
    if theta is None:
      raise ValueError(
        f"config has no rope_theta and jaxpe does not know transformers' default for model_type "
        f"{model_type!r}: add rope_theta to the dict, or pass the transformers config object "
        "(transformers.AutoConfig.for_model(**config_json))"
      )
    params["rope_theta"] = theta
  if params.get("partial_rotary_factor") is None:
    prf = _first(cfg, "partial_rotary_factor", "rotary_pct")
    if prf is None:
      prf = defaults.get("partial_rotary_factor")
    if prf is not None:
      params["partial_rotary_factor"] = prf
  params = _rs.normalize_rope_parameters(params)
  rope_type = params["rope_type"]

  # Head and rotary dims.
  trailing = family in _MLA_FAMILIES or family == "deepseek_v4"
  # MLA configs set head_dim = qk_rope_head_dim (DeepseekV3Config), unless the rope dict carries a
  # partial_rotary_factor of head_dim (Mistral-4).
  mla = family in _MLA_FAMILIES and cfg.get("qk_rope_head_dim") is not None
  mla = mla and params.get("partial_rotary_factor") is None
  head_dim = _head_dim(cfg, family, layer_type, mla)
  rotary_dim = None
  if family in _ROTARY_DIM_FAMILIES and cfg.get("rotary_dim") is not None:
    rotary_dim = _positive_int(cfg, "rotary_dim")
  _check_rotary_dim(cfg, params, family, head_dim, rotary_dim, mla)

  max_pos = _first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length")
  if max_pos is not None:
    max_pos = _positive_int({"max_position_embeddings": max_pos}, "max_position_embeddings")
  original = None
  if rope_type in _ORIGINAL_LENGTH_TYPES:
    # standardize_rope_params: Phi-3 style top-level original length (the config.json key, else the
    # config class's attribute) wins; nested configs ignore it. None values mean absent.
    top = None if nested else _first(cfg, "original_max_position_embeddings")
    if top is None and not nested:
      top = defaults.get("original_max_position_embeddings")
    original = _first(
      {"top": top, "nested": params.get("original_max_position_embeddings"), "max": max_pos},
      "top",
      "nested",
      "max",
    )
    if original is not None:
      params["original_max_position_embeddings"] = original
  elif rope_type == "dynamic":
    # transformers' dynamic NTK uses max_position_embeddings as the pretraining length.
    params.pop("original_max_position_embeddings", None)
    original = max_pos
  else:
    original = params.get("original_max_position_embeddings")
  mrope = params.get("mrope_section")
  mrope = None if mrope is None else tuple(int(v) for v in mrope)

  layout: Literal["half", "interleaved"] = "half"
  if family in INTERLEAVED_FAMILIES or (trailing and cfg.get("rope_interleave", family == "deepseek_v3")):
    layout = "interleaved"
  if family == "deepseek_v2":
    layout = "interleaved"  # complex multiplication (view_as_complex)

  inv_freq, attention_factor = _rs.rope_frequencies(
    params, head_dim=head_dim, rotary_dim=rotary_dim, max_position_embeddings=max_pos
  )
  softmax_scale_factor = 1.0
  if family in _MSCALE_SOFTMAX_FAMILIES and rope_type != "default" and params.get("mscale_all_dim"):
    if params.get("factor") is None:
      raise ValueError(
        f"model_type {model_type!r} scales the softmax by yarn_get_mscale(factor, mscale_all_dim) ** 2: "
        "its rope dict needs 'factor' when it has 'mscale_all_dim'"
      )
    factor = float(params["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
    softmax_scale_factor = mscale * mscale
  return HFRope(
    model_type=model_type,
    layer_type=layer_type,
    rope_type=rope_type,
    parameters=types.MappingProxyType(params),
    head_dim=head_dim,
    rotary_dim=2 * int(inv_freq.shape[0]),
    rope_theta=float(params["rope_theta"]),
    layout=layout,
    rotated_slice="trailing" if trailing else "leading",
    max_position_embeddings=max_pos,
    original_max_position_embeddings=original,
    mrope_section=mrope,
    inv_freq=inv_freq,
    attention_factor=float(attention_factor),
    softmax_scale_factor=softmax_scale_factor,
    length_dependent=rope_type in ("dynamic", "longrope"),
    query_scale_beta=None if query_scale_beta is None else float(query_scale_beta),
  )
