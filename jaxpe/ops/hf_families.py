"""What transformers does per model family (``model_type``) for RoPE, as jaxpe reads it.

The tables name the families by their transformers 5.25 behaviour: pair layout, latent-attention
(MLA) heads, softmax scale, the config-class defaults a ``config.json`` leaves out, legacy rope type
names, per-layer-type bases, and the families without (or with an unsupported) rotary embedding.
``jaxpe.ops.hf_config`` reads a config with them; ``jaxpe.ops.hf_rope.rope_from_hf_config`` puts
the result together.

A table answers only for the families it was checked on: a ``model_type`` outside
``jaxpe.ops.hf_verified.VERIFIED_FAMILIES`` is refused by name (``hf_verified.refuse_unverified``)
unless the caller states what its config does not (``layout``, ``rotated_slice``, ``rotary_dim``),
and a value the caller states always wins over a table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from jaxpe.ops import checks as _checks
from jaxpe.ops import hf_verified as _verified

# Families whose transformers modeling code rotates adjacent pairs (2i, 2i+1) ("interleaved");
# every other verified family uses rotate_half ("half"). Found in transformers 5.24 / 5.25:
# ``rotate_every_two`` or a ``rotate_half`` that slices ``x[..., ::2]`` (Ergo), complex multiplication
# (``view_as_complex``), or only ``apply_rotary_pos_emb_interleave`` (HunYuan-V4's MLA heads).
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
    "ergo",
    "ernie4_5",
    "ernie4_5_moe",
    "ernie4_5_vl_moe",
    "glm",
    "glm4",
    "glm4v",
    "glm4v_text",
    "glm_moe_dsa",
    "glm_ocr",
    "glm_ocr_text",
    "gptj",
    "helium",
    "hy_v4",
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
MLA_FAMILIES = frozenset(
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
ROPE_INTERLEAVE_FAMILIES = frozenset(
  {"axk1", "deepseek_v3", "glm4_moe_lite", "mistral4", "sarvam_mla", "youtu"}
)
# Families whose attention multiplies the softmax scale by yarn_get_mscale(factor, mscale_all_dim)**2
# (``yarn_apply_mscale`` in their modeling code).
MSCALE_SOFTMAX_FAMILIES = frozenset(
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
FAMILY_DEFAULTS: dict[str, dict[str, float | int]] = {
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
  # Config classes (transformers 5.25) whose partial_rotary_factor default is not 1 and is not per
  # layer type: a config.json that leaves it out rotates that share, as transformers reads it.
  **{
    f: {"partial_rotary_factor": p}
    for f, p in {
      "bamba": 0.5,
      "dots3_note_audio_encoder": 0.5,
      "dots3_note_text": 0.25,
      "glm4_moe": 0.5,
      "glm4v_moe": 0.5,  # glm4v_moe_text reads as glm4v_moe (family())
      "glm4v_moe_text": 0.5,
      "glmasr_encoder": 0.5,
      "mimo_v2_flash": 0.334,
      "moonshine": 0.9,
      "moonshine_streaming": 0.8,
      "nemotron": 0.5,
      "nemotron3_5_transcribe_asr_audio": 0.5,
      "nemotron3_5_transcribe_word_timestamp": 0.5,
      "qwen3_5": 0.25,
      "qwen3_5_moe": 0.25,
      "qwen3_5_moe_text": 0.25,
      "qwen3_5_text": 0.25,
      "qwen3_next": 0.25,
      "recurrent_gemma": 0.5,
      "zaya": 0.5,
    }.items()
  },
}
# GPT-J and CodeGen: fixed base 10000 and an integer ``rotary_dim`` (HF ``create_sinusoidal_positions``).
ROTARY_DIM_FAMILIES = frozenset({"gptj", "codegen"})
PHI3_FAMILIES = frozenset({"phi3", "phi4_multimodal"})  # legacy "yarn" means longrope here
MROPE_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})  # legacy "mrope" means default + mrope_section
# Families whose v4 config.json gives one base per layer type outside the rope dict (transformers'
# convert_rope_params_to_dict): (full-attention base key, sliding base key, their class defaults,
# whether rope_scaling applies to the sliding layers too).
LOCAL_THETA_FAMILIES: dict[str, tuple[str, str, float, float, bool]] = {
  "gemma3": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
  "gemma3_text": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
  "gemma3n": ("rope_theta", "rope_local_base_freq", 1_000_000.0, 10_000.0, False),
  "modernbert": ("global_rope_theta", "local_rope_theta", 160_000.0, 10_000.0, True),
  "modernbert-decoder": ("global_rope_theta", "local_rope_theta", 160_000.0, 10_000.0, True),
}
GEMMA3_FAMILIES = frozenset(LOCAL_THETA_FAMILIES)
NO_ROPE_FAMILIES = _verified.NO_ROPE_FAMILIES  # BLOOM, MPT, GPT-2, OPT, BERT, Mamba, ... (no rotary code)
# Families whose nested rope_parameters are keyed by labels other than layer_types
# (transformers' ``_rope_type_labels``).
ROPE_TYPE_LABELS = {"deepseek_v4": ("main", "compress"), "lfm3": ("full_attention", "sliding_attention")}
# Where a family's config.json spells the head dim differently (transformers' attribute_map).
HEAD_DIM_KEYS = {"jetmoe": "kv_channels", "zamba2": "attention_head_dim"}
HEADS_KEYS = {"moonshine": "decoder_num_attention_heads"}
# Families whose rotary table transformers builds in a way jaxpe's 1-D inv_freq does not describe.
_PATCH_GRID = (
  "its rotary embedding is 2-D RoPE over image-patch (row, column) positions, built by its modeling "
  "code from the image size; rope_from_hf_config reads 1-D token positions (and mRoPE text positions)"
)
UNSUPPORTED = {
  "eomt_dinov3": f"it is a vision transformer: {_PATCH_GRID}",
  "dinov3_vit": f"it is a vision transformer: {_PATCH_GRID}",
  "efficientloftr": f"it is an image matcher: {_PATCH_GRID} (its partial_rotary_factor scales the feature width)",
}
# Families whose rotate_half has flipped signs (``cat((x2, -x1))``): q rotates by -theta
# (``HFRope.rotation_sign`` -1).
FLIPPED_ROTATION_FAMILIES = frozenset({"nanochat"})
# Multi-axis RoPE (mRoPE): how the family's rotary module gives each frequency a row of the
# ``[A, B, T]`` positions (t, h, w), and the ``mrope_section`` it uses when the rope dict has none.
# "sections": contiguous, frequencies 0..s0-1 row 0, the next s1 row 1, ... (Qwen2-VL);
# "interleaved": Qwen3-VL's ``apply_interleaved_mrope`` (frequency j takes row 1 when j % 3 == 1 and
#   j < 3 s1, row 2 when j % 3 == 2 and j < 3 s2, else row 0);
# "hw_pairs": ERNIE-4.5-VL (its pre-permuted inv_freq undone): the first s0 + s1 frequencies
#   alternate rows 1, 2 (h, w), the last s2 take row 0 (t);
# "row_col": NeoMME, two rows: even frequencies row 0, odd ones row 1;
# "xd": HunYuan-VL, sections of 2 s_i dims over the duplicated [R] table (the two dims of a pair
#   may take different rows: not one frequency per row), text positions only.
MROPE_LAYOUTS: dict[str, tuple[str, tuple[int, ...] | None]] = {
  **{f: ("sections", (16, 24, 24)) for f in ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "paddleocr_vl")},
  **{f: ("sections", (8, 12, 12)) for f in ("glm4v", "glm4v_moe", "glm_image", "glm_ocr")},
  **{
    f: ("interleaved", (24, 20, 20))
    for f in ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe", "hy_v4_vl", "cosmos3_edge", "cohere_compass")
  },
  **{f: ("interleaved", (11, 11, 10)) for f in ("qwen3_5", "qwen3_5_moe", "qwen4_exp")},
  "ernie4_5_vl_moe": ("hw_pairs", (22, 22, 20)),
  "neomme": ("row_col", None),
  "hunyuan_vl": ("xd", None),
}
# Model types of composite models' sub-configs that use the family's text rotary module.
for _sub in (
  "qwen2_5_omni_thinker",
  "qwen2_5_omni_talker",
  "qwen3_omni_moe_thinker",
  "qwen3_omni_moe_talker",
):
  MROPE_LAYOUTS[_sub] = MROPE_LAYOUTS[_sub.rsplit("_", 1)[0]]
# Rope-dict keys beyond transformers' common RopeParameters that a family's config declares and its
# rotary module reads (its ``ignore_keys_at_rope_validation`` or its own check); other families'
# dicts refuse them (``jaxpe.ops.rope_parameters`` says what each one is).
_INTERLEAVED_MROPE = frozenset(f for f, v in MROPE_LAYOUTS.items() if v[0] == "interleaved")
FAMILY_KEYS: dict[str, frozenset[str]] = {
  "mrope_interleaved": _INTERLEAVED_MROPE,  # a flag: these families always interleave
  "interleaved": frozenset({"qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_talker"}),
  "short_mscale": frozenset({"phimoe"}),
  "long_mscale": frozenset({"phimoe"}),
  "alpha": frozenset({"hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl"}),
}
# Types whose transformers standardisation moves an original pretraining length into the dict.
ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def family(model_type: Any) -> Any:
  """The name jaxpe's family tables use: a composite model's text config (``qwen2_5_vl_text``,
  ``mistral_large4_text``) is its family's decoder, so ``<family>_text`` reads as ``<family>`` unless
  the family is unknown to them (each table that names a ``<family>_text`` names ``<family>`` too)."""
  if not isinstance(model_type, str) or not model_type.endswith("_text"):
    return model_type
  tables = (
    INTERLEAVED_FAMILIES,
    MLA_FAMILIES,
    ROPE_INTERLEAVE_FAMILIES,
    MSCALE_SOFTMAX_FAMILIES,
    FAMILY_DEFAULTS,
    ROTARY_DIM_FAMILIES,
    PHI3_FAMILIES,
    MROPE_FAMILIES,
    GEMMA3_FAMILIES,
    NO_ROPE_FAMILIES,
    ROPE_TYPE_LABELS,
    HEAD_DIM_KEYS,
    HEADS_KEYS,
    UNSUPPORTED,
    MROPE_LAYOUTS,
    FLIPPED_ROTATION_FAMILIES,
  )
  family = model_type[: -len("_text")]
  return family if any(family in t for t in tables) else model_type


def family_rope_type(params: dict[str, Any], model_type: str | None) -> dict[str, Any]:
  """``params`` with the family's legacy rope type names read as transformers reads them (Phi-3:
  ``"su"`` / ``"yarn"`` -> ``"longrope"``; Qwen2-VL: ``"mrope"`` -> ``"default"``)."""
  params = dict(params)
  for key in ("type", "rope_type"):
    kind = params.get(key)
    if model_type in PHI3_FAMILIES and kind in ("su", "yarn"):
      params[key] = "longrope"  # Phi3Config: "For backward compatibility if previous version used su or yarn"
    if model_type in MROPE_FAMILIES and kind == "mrope":
      params[key] = "default"  # Qwen2VLConfig: mrope is default RoPE with mrope_section
  return params


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
  """A boolean config key: ``default`` when absent or None; ArgTypeError for a non-bool (a JSON
  string ``"false"`` is not False)."""
  value = cfg.get(key)
  return default if value is None else _checks.check_bool(f"config {key}", value)


def check_supported(family: Any, model_type: Any, cfg: Mapping[str, Any]) -> None:
  """ValueError for a family without a rotary embedding (BLOOM, MPT, Falcon with ``alibi: true``,
  ...) or with one that jaxpe's 1-D ``inv_freq`` does not describe (the message says why)."""
  if family == "falcon" and _flag(cfg, "alibi", False):
    raise ValueError("config has alibi: true (Falcon with ALiBi): the model has no rotary embedding")
  if family in NO_ROPE_FAMILIES or model_type in NO_ROPE_FAMILIES:
    raise ValueError(
      f"model_type {model_type!r} has no rotary embedding in transformers (its modeling code has none: "
      "learned, sinusoidal, ALiBi or no positions); there is nothing for rope_from_hf_config to read"
    )
  if family in UNSUPPORTED:
    raise ValueError(
      f"model_type {model_type!r} is not supported by rope_from_hf_config: {UNSUPPORTED[family]}"
    )


def pair_layout(family: Any, cfg: Mapping[str, Any], trailing: bool) -> Literal["half", "interleaved"]:
  """The pair layout the family's modeling code rotates: ``"interleaved"`` for
  ``INTERLEAVED_FAMILIES``, for DeepSeek-V2 (complex multiplication) and for MLA heads whose
  ``rope_interleave`` is set (default True for DeepSeek-V3); ``"half"`` (rotate_half) otherwise."""
  layout: Literal["half", "interleaved"] = "half"
  if family in INTERLEAVED_FAMILIES or (trailing and _flag(cfg, "rope_interleave", family == "deepseek_v3")):
    layout = "interleaved"
  if family == "deepseek_v2":
    layout = "interleaved"  # complex multiplication (view_as_complex)
  return layout


def softmax_scale_factor(family: Any, model_type: Any, rope_type: str, params: Mapping[str, Any]) -> float:
  """``yarn_get_mscale(factor, mscale_all_dim) ** 2`` for the families that multiply their softmax
  scale by it (``MSCALE_SOFTMAX_FAMILIES``, when the rope dict has ``mscale_all_dim``), else 1.

  Raises:
    ValueError: ``mscale_all_dim`` without ``factor`` in such a family.
  """
  if family not in MSCALE_SOFTMAX_FAMILIES or rope_type == "default" or not params.get("mscale_all_dim"):
    return 1.0
  if params.get("factor") is None:
    raise ValueError(
      f"model_type {model_type!r} scales the softmax by yarn_get_mscale(factor, mscale_all_dim) ** 2: "
      "its rope dict needs 'factor' when it has 'mscale_all_dim'"
    )
  factor = float(params["factor"])
  mscale = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
  return mscale * mscale


def family_extras(params: Mapping[str, Any], family: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(params, extras)``: the rope dict without the keys the family's rotary module reads beyond
  transformers' common ones (``FAMILY_KEYS``: PhiMoE's ``short_mscale`` / ``long_mscale``, HunYuan's
  ``alpha``, Qwen3-VL's ``mrope_interleaved`` flag, ...), and those keys."""
  params = dict(params)
  extras = {k: params.pop(k) for k in list(params) if k in FAMILY_KEYS and family in FAMILY_KEYS[k]}
  return params, extras


def mrope_axes(family: Any, section: Any, half: int) -> tuple[int, ...] | None:
  """The row of the ``[A, B, T]`` positions each of the ``half`` = R/2 frequencies takes, as the
  family's rotary module recomposes them (``MROPE_LAYOUTS``; a family not listed with an
  ``mrope_section``: contiguous sections, section i row i), or None: no multi-axis RoPE,
  HunYuan-VL's XD layout, or a config without ``mrope_section`` whose head does not fit the
  module's default section (GLM-4V's default config: transformers' module fails there): text
  positions only.

  Raises:
    ValueError: ``mrope_section`` not positive ints, or not summing to R/2 where the family's
      module splits the frequencies by it (transformers fails there too).
  """
  kind, default = MROPE_LAYOUTS.get(family, ("sections", None))
  if kind == "xd":
    return None
  if kind == "row_col":
    return tuple(j % 2 for j in range(half))
  if section is None and (default is None or (kind != "interleaved" and sum(default) != half)):
    return None  # the module's default section does not fit this head: transformers cannot run it
  section = default if section is None else section
  if isinstance(section, (str, bytes)) or not all(_checks.is_int(s) and s > 0 for s in section):
    raise ValueError(f"rope_parameters['mrope_section'] must be a list of positive ints, got {section!r}")
  section = tuple(section)
  if kind == "interleaved":  # apply_interleaved_mrope: slice(offset, 3 * s_row, 3) takes row `row`
    if len(section) != 3:
      raise ValueError(
        f"interleaved mRoPE ({family!r}) needs 3 mrope_section entries (t, h, w), got {section}"
      )
    axes = [0] * half
    for row in (1, 2):
      for j in range(row, min(3 * section[row], half), 3):
        axes[j] = row
    return tuple(axes)
  if sum(section) != half:
    raise ValueError(
      f"rope_parameters['mrope_section'] {list(section)} must sum to R/2 = {half} (the rotary "
      f"frequencies of model_type {family!r}), got {sum(section)}"
    )
  if kind == "hw_pairs":  # ERNIE-4.5-VL: stack([h, w]).flatten() then t
    if len(section) != 3 or section[0] != section[1]:
      raise ValueError(f"ERNIE-4.5-VL's mrope_section needs equal h and w sections, got {list(section)}")
    return (1, 2) * section[0] + (0,) * section[2]
  rows = range(len(section)) if family not in MROPE_LAYOUTS else [i % 3 for i in range(len(section))]
  return tuple(row for row, s in zip(rows, section) for _ in range(s))
