"""Reading a Hugging Face model config for its rotary embedding, as transformers 5.24 does.

A ``config.json`` dict or a ``PretrainedConfig`` (``as_dict``, ``text_config``), its rope dict
(``rope_dict``, ``select_rope_params``: ``rope_scaling`` or ``rope_parameters``, per layer type),
the base and partial rotary factor with the family defaults (``fill_base_and_partial``), the head
dim (``head_dim_of``, ``odd_rotary_dim``) and the pretraining length (``original_length``). The
per-family rules come from ``jaxpe.ops.hf_families``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxpe.ops import checks as _checks
from jaxpe.ops.hf_families import (
  FAMILY_DEFAULTS,
  GEMMA3_FAMILIES,
  HEAD_DIM_KEYS,
  HEADS_KEYS,
  LOCAL_THETA_FAMILIES,
  ORIGINAL_LENGTH_TYPES,
  ROPE_TYPE_LABELS,
  ROTARY_DIM_FAMILIES,
)


def as_dict(config: Any) -> dict[str, Any]:
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


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
  """The decoder part of a composite (vision-language) config, as transformers' get_text_config."""
  has_rope = any(k in cfg for k in ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim"))
  text = cfg.get("text_config")
  if not has_rope and isinstance(text, Mapping):
    return dict(text)
  return cfg


def positive_int(cfg: Mapping[str, Any], key: str) -> int:
  value = cfg[key]
  if not _checks.is_int(value) or value <= 0:
    raise ValueError(f"config[{key!r}] must be a positive integer, got {value!r}")
  return int(value)


def first(cfg: Mapping[str, Any], *keys: str) -> Any:
  for key in keys:
    if cfg.get(key) is not None:
      return cfg[key]
  return None


def rope_dict(cfg: dict[str, Any], model_type: str | None) -> dict[str, Any]:
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
  if model_type in LOCAL_THETA_FAMILIES:
    full_key, local_key, full_default, local_default, both = LOCAL_THETA_FAMILIES[model_type]
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
        entry.setdefault("rope_theta", first(cfg, key) or default)
  return raw


def layer_types(cfg: Mapping[str, Any], raw: Mapping[str, Any], model_type: str | None) -> list[str]:
  """Keys of ``raw`` that are layer types (transformers' nested_rope_parameter_keys)."""
  labels = set(
    cfg.get("_rope_type_labels") or ROPE_TYPE_LABELS.get(model_type) or cfg.get("layer_types") or ()
  )
  if model_type in GEMMA3_FAMILIES:
    labels |= {"full_attention", "sliding_attention"}
  return sorted(k for k in raw if k in labels)


def head_dim_of(cfg: Mapping[str, Any], model_type: str | None, layer_type: str | None, mla: bool) -> int:
  """The width the rotary embedding is built for (transformers: ``config.head_dim`` or
  ``hidden_size // num_attention_heads``, with the family's aliases and per-layer overrides)."""
  if mla:
    return positive_int(cfg, "qk_rope_head_dim")
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
    return positive_int(cfg, "global_head_dim")  # Gemma-4 config.json spelling
  key = HEAD_DIM_KEYS.get(model_type, "head_dim")
  if cfg.get(key) is not None:
    return positive_int(cfg, key)
  hidden = first(cfg, "hidden_size", "n_embd", "d_model")
  heads = first(
    cfg, HEADS_KEYS.get(model_type, "num_attention_heads"), "num_attention_heads", "n_head", "n_heads"
  )
  if hidden is None or heads is None:
    raise ValueError("config needs head_dim, or hidden_size and num_attention_heads, for the rotary dim")
  for name, value in (("hidden_size", hidden), ("num_attention_heads", heads)):
    positive_int({name: value}, name)
  return positive_int(
    {"hidden_size // num_attention_heads": hidden // heads}, "hidden_size // num_attention_heads"
  )


def odd_rotary_dim(
  cfg: Mapping[str, Any],
  params: Mapping[str, Any],
  family: Any,
  head_dim: int,
  rotary_dim: int | None,
  mla: bool,
) -> tuple[dict[str, Any], int | None]:
  """``(params, rotary_dim)`` with transformers' reading of an odd rotary dim d = ``int(head_dim *
  partial_rotary_factor)`` (or an odd head dim): it builds ``ceil(d / 2)`` frequencies ``base **
  (-2i / d)`` and rotates ``d + 1`` dims (GLM-4-MoE's default config: d = 21). jaxpe gives the same
  as ``rotary_dim = d + 1`` with base ``base ** ((d + 1) / d)`` (the same frequencies), for
  ``default`` and ``linear``. Even dims pass through unchanged.

  Raises:
    ValueError in the config's terms: d is 0; d odd with another rope type; ``d + 1 > head_dim``
      (transformers' table is wider than the head: the model cannot apply it).
  """
  params = dict(params)
  prf = params.get("partial_rotary_factor")
  if rotary_dim is not None or params.get("rope_type") == "proportional":
    return params, rotary_dim
  if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1):
    return params, rotary_dim  # rope_frequencies names the bad partial_rotary_factor
  dim = head_dim if prf is None else int(head_dim * prf)
  if dim > 0 and dim % 2 == 0:
    return params, rotary_dim
  if dim > 0 and dim + 1 <= head_dim and params["rope_type"] in ("default", "linear"):
    base = params["rope_theta"]
    if isinstance(base, (int, float)) and not isinstance(base, bool) and base > 0:
      params.pop("partial_rotary_factor", None)
      params["rope_theta"] = float(base) ** ((dim + 1) / dim)
      return params, dim + 1
  key = HEAD_DIM_KEYS.get(family, "head_dim")
  if mla:
    source = "'qk_rope_head_dim'"
  elif cfg.get(key) is not None:
    source = repr(key)
  else:
    hidden = first(cfg, "hidden_size", "n_embd", "d_model")
    heads = first(
      cfg, HEADS_KEYS.get(family, "num_attention_heads"), "num_attention_heads", "n_head", "n_heads"
    )
    source = f"hidden_size // num_attention_heads = {hidden} // {heads}"
  scaled = "" if prf is None else f" * partial_rotary_factor {prf}"
  given = f"config gives rotary dim {dim} = head_dim {head_dim} (from {source}){scaled}"
  if dim <= 0:
    raise ValueError(f"{given}; the rotated dims must be > 0")
  if dim + 1 > head_dim:
    raise ValueError(
      f"{given}, odd: transformers builds {(dim + 1) // 2} frequencies and a {dim + 1}-wide cos/sin "
      f"table for it, wider than the {head_dim}-dim head, so the model cannot apply it"
    )
  raise ValueError(
    f"{given}, odd: transformers rotates {dim + 1} dims with base ** (-2i / {dim}); jaxpe reads that "
    f"for rope_type 'default' and 'linear', not {params['rope_type']!r}"
  )


def select_rope_params(
  cfg: Mapping[str, Any], raw: Mapping[str, Any], family: Any, layer_type: str | None
) -> tuple[dict[str, Any], list[str]]:
  """``(params, nested)``: the rope dict for ``layer_type`` (a copy) and the config's layer types
  with their own rope parameters (empty for a config with one rope dict).

  Raises:
    ValueError: ``layer_type`` missing or unknown for a config with per-layer-type parameters, given
      for one without, or naming an entry that is None (a layer without RoPE).
  """
  nested = layer_types(cfg, raw, family)
  if not nested:
    if layer_type is not None:
      raise ValueError(
        f"layer_type must be None for a config without per-layer-type rope parameters, got {layer_type!r}"
      )
    return dict(raw), nested
  if layer_type is None or layer_type not in nested:
    raise ValueError(
      f"config has per-layer-type rope parameters for {nested}; pass layer_type= one of them, got {layer_type!r}"
    )
  params = raw[layer_type]
  if params is None:
    raise ValueError(
      f"config's rope parameters for layer_type {layer_type!r} are None (a layer without RoPE)"
    )
  return dict(params), nested


def fill_base_and_partial(
  params: Mapping[str, Any], cfg: Mapping[str, Any], family: Any, partial_default: bool = True
) -> dict[str, Any]:
  """``params`` with ``rope_theta`` and ``partial_rotary_factor``: the dict's value first, then the
  top-level key (and the family's legacy spelling: GPT-NeoX ``rotary_emb_base`` / ``rotary_pct``),
  then the family default (transformers' setdefault order; the partial factor's only with
  ``partial_default``: a stated ``rotary_dim`` replaces it). GPT-J / CodeGen: base 10000.

  Raises:
    ValueError: no ``rope_theta`` anywhere and no transformers default known for the family.
  """
  params = dict(params)
  defaults = FAMILY_DEFAULTS.get(family, {})
  if params.get("rope_theta") is None:
    theta = first(cfg, "rope_theta", "rotary_emb_base")
    if theta is None and family in ROTARY_DIM_FAMILIES:
      theta = 10000.0  # hard-coded in create_sinusoidal_positions
    if theta is None:
      theta = defaults.get("rope_theta")
    if theta is None:
      raise ValueError(
        f"config has no rope_theta and jaxpe does not know transformers' default for model_type "
        f"{cfg.get('model_type')!r}: add rope_theta to the dict, or pass the transformers config object "
        "(transformers.AutoConfig.for_model(**config_json))"
      )
    params["rope_theta"] = theta
  if params.get("partial_rotary_factor") is None:
    prf = first(cfg, "partial_rotary_factor", "rotary_pct")
    if prf is None and partial_default:  # not when the caller states rotary_dim
      prf = defaults.get("partial_rotary_factor")
    if prf is not None:
      params["partial_rotary_factor"] = prf
  return params


def max_positions(cfg: Mapping[str, Any]) -> int | None:
  """The context length: ``max_position_embeddings`` (GPT-2 style ``n_positions``,
  ``max_sequence_length``), a positive int, or None when absent."""
  max_pos = first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length")
  if max_pos is not None:
    max_pos = positive_int({"max_position_embeddings": max_pos}, "max_position_embeddings")
  return max_pos


def original_length(
  params: Mapping[str, Any], cfg: Mapping[str, Any], family: Any, nested: bool, max_pos: int | None
) -> tuple[dict[str, Any], int | None]:
  """``(params, original)``: the pretraining length the scaling uses, written into the dict where
  transformers' ``standardize_rope_params`` puts it.

  llama3 / yarn / longrope: a top-level ``original_max_position_embeddings`` (the config.json key,
  else the family's class attribute: Phi-3 declares 4096) wins, unless the parameters are per layer
  type; else the nested one, else ``max_position_embeddings``. dynamic: ``max_position_embeddings``
  (transformers ignores a nested original length for it). Other types: the nested value or None.
  """
  params = dict(params)
  rope_type = params["rope_type"]
  if rope_type in ORIGINAL_LENGTH_TYPES:
    # None values mean absent.
    top = None if nested else first(cfg, "original_max_position_embeddings")
    if top is None and not nested:
      top = FAMILY_DEFAULTS.get(family, {}).get("original_max_position_embeddings")
    original = first(
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
  return params, original
