"""Per-layer attention patterns of ``ModelConfig`` (issue 47): the checks of its keys ``layer_types``,
``sliding_window_pattern``, ``sliding_window``, ``attention_chunk_size``, ``attn_logit_softcapping``,
``final_logit_softcapping``, ``rope_local_base_freq``, ``attn_temperature_tuning`` (``floor_scale``,
``attn_scale``) and the llama / gemma / gpt-oss architecture keys (``norm_type``, ``mlp_type``,
``hidden_act``, ``num_local_experts``, ``num_experts_per_tok``, ``swiglu_limit``, ``qk_norm``,
``sandwich_norm``, ``scale_embeddings``, ``query_pre_attn_scalar``), and each layer's
derived pattern (``layer_pattern``).

Conventions (HF transformers 5.x, whose config keys these are):

- ``sliding_window = w`` counts the query itself: query slot i sees key slot j iff ``i - w < j <= i``,
  which is ``jaxpe.attention.attention``'s ``local_window_size=(w - 1, 0)`` (transformers'
  ``sliding_window_causal_mask_function``: ``q_idx - sliding_window < kv_idx``). Distances are slot
  indices (a left-padded row counts its padding, as transformers' ``cache_position``).
- ``attention_chunk_size = C`` (Llama 4): query slot i sees key slot j iff ``i // C == j // C``
  (transformers' ``chunked_causal_mask_function``).
- ``sliding_window_pattern = n`` (Gemma 3): layer i is ``full_attention`` iff ``(i + 1) % n == 0``.
- ``rope_local_base_freq`` (Gemma 3): ``sliding_attention`` layers rotate at that base without
  ``rope_scaling``; ``full_attention`` layers at ``rope_theta`` with it (``Gemma3TextConfig``).
- Llama 4's attention temperature (``Llama4TextAttention``): on NoPE layers (``no_rope_layers``) q
  is multiplied by ``log1p(floor((slot + 1) / floor_scale)) * attn_scale + 1``, slot the query's
  index in the sequence (``cache_position``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention", "chunked_attention")


class PatternKeys(Protocol):
  """The keys of ``jaxpe.model.config.ModelConfig`` read here (a Protocol: no import of the config)."""

  num_layers: int
  pos_encoding: str
  scan_layers: bool
  layer_types: tuple[str, ...] | None
  sliding_window_pattern: int | None
  sliding_window: int | None
  attention_chunk_size: int | None
  attn_logit_softcapping: float | None
  rope_local_base_freq: float | None
  attn_temperature_tuning: bool
  mlp_type: str
  qk_norm: bool
  hidden_act: str | None
  num_local_experts: int | None
  num_experts_per_tok: int | None
  swiglu_limit: float | None
  moe_routing: str
  moe_shared_expert: bool
  use_qk_norm: bool

  @property
  def rotates(self) -> bool: ...

  def rope_layers(self) -> tuple[bool, ...] | None: ...

  def model_copy(self, *, update: dict[str, Any]) -> Any: ...


class LayerPattern(NamedTuple):
  """One layer's attention pattern.

  Attributes:
    layer_type: ``full_attention``, ``sliding_attention`` or ``chunked_attention``.
    local_window_size: ``(left, 0)`` tokens for ``jaxpe.attention.attention`` (sliding layers), or None.
    chunk_size: ``attention_chunk_size`` (chunked layers), or None.
    ring_slots: KV cache slots the layer needs at most: ``left`` (sliding) or ``chunk_size - 1``
      (chunked), at least 1; None for full attention (every slot).
    logits_soft_cap: ``attn_logit_softcapping`` (every layer), or None.
  """

  layer_type: str
  local_window_size: tuple[int, int] | None
  chunk_size: int | None
  ring_slots: int | None
  logits_soft_cap: float | None


def layer_types(cfg: PatternKeys) -> tuple[str, ...]:
  """``[L]`` each layer's type: ``layer_types``; else Gemma 3's ``sliding_window_pattern``; else
  every layer sliding (only ``sliding_window`` set, Mistral), chunked (only
  ``attention_chunk_size``) or full."""
  if cfg.layer_types is not None:
    return tuple(cfg.layer_types)
  if cfg.sliding_window_pattern is not None:
    n = cfg.sliding_window_pattern
    return tuple("full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(cfg.num_layers))
  if cfg.sliding_window is not None:
    return ("sliding_attention",) * cfg.num_layers
  if cfg.attention_chunk_size is not None:
    return ("chunked_attention",) * cfg.num_layers
  return ("full_attention",) * cfg.num_layers


def layer_type(cfg: PatternKeys, layer: int) -> str:
  """``layer_types(cfg)[layer]`` without building the tuple."""
  if cfg.layer_types is not None:
    return cfg.layer_types[layer]
  if cfg.sliding_window_pattern is not None:
    return "full_attention" if (layer + 1) % cfg.sliding_window_pattern == 0 else "sliding_attention"
  return layer_types(cfg.model_copy(update={"num_layers": 1}))[0]


def _kinds(cfg: PatternKeys) -> set[str]:
  """``set(layer_types(cfg))`` without building the tuple (num_layers may be huge)."""
  if cfg.layer_types is None and cfg.sliding_window_pattern is not None:
    return {"sliding_attention"} | (
      {"full_attention"} if cfg.num_layers >= cfg.sliding_window_pattern else set()
    )
  if cfg.layer_types is None:
    return {layer_type(cfg, 0)}
  return set(cfg.layer_types)


def layer_pattern(cfg: PatternKeys, layer: int) -> LayerPattern:
  """Layer ``layer``'s ``LayerPattern`` (``layer`` in ``[0, num_layers)``)."""
  kind = layer_type(cfg, layer)
  window = chunk = ring = None
  if kind == "sliding_attention":
    window = (cfg.sliding_window - 1, 0)
    ring = max(cfg.sliding_window - 1, 1)
  elif kind == "chunked_attention":
    chunk = cfg.attention_chunk_size
    ring = max(chunk - 1, 1)
  return LayerPattern(kind, window, chunk, ring, cfg.attn_logit_softcapping)


def rope_config(cfg: PatternKeys, layer: int) -> Any:
  """The config whose RoPE keys are layer ``layer``'s: ``cfg`` itself, or for a
  ``sliding_attention`` layer with ``rope_local_base_freq`` a copy with ``rope_theta`` that base and
  no ``rope_scaling`` (Gemma 3's local layers)."""
  if cfg.rope_local_base_freq is None or layer_type(cfg, layer) != "sliding_attention":
    return cfg
  return cfg.model_copy(update={"rope_theta": cfg.rope_local_base_freq, "rope_scaling": None})


def check_moe_options(cfg: PatternKeys) -> None:
  """ValueError naming the key: ``mlp_type='moe'`` needs ``num_local_experts`` (E) and
  ``num_experts_per_tok`` (k) with ``k <= E``; those keys and ``swiglu_limit`` mean nothing without
  it (nor ``moe_routing`` / ``moe_shared_expert`` off their defaults); gpt-oss's clamped SwiGLU
  (``swiglu_limit``) has no ``hidden_act``; Llama 4's ``use_qk_norm`` needs ``pos_encoding='rope'``."""
  experts, per_tok = cfg.num_local_experts, cfg.num_experts_per_tok
  if cfg.use_qk_norm and cfg.pos_encoding != "rope":
    raise ValueError(
      f"use_qk_norm normalises q and k of RoPE layers after RoPE: pos_encoding='rope', got {cfg.pos_encoding!r}"
    )
  if cfg.mlp_type != "moe" and (cfg.moe_routing != "softmax" or cfg.moe_shared_expert):
    raise ValueError(
      f"moe_routing and moe_shared_expert are keys of mlp_type='moe', got mlp_type={cfg.mlp_type!r} with "
      f"moe_routing={cfg.moe_routing!r}, moe_shared_expert={cfg.moe_shared_expert}"
    )
  if cfg.mlp_type == "moe":
    if experts is None or per_tok is None or per_tok > experts:
      raise ValueError(
        "mlp_type='moe' needs num_local_experts (E >= 1) and num_experts_per_tok (k in [1, E]), got "
        f"num_local_experts={experts}, num_experts_per_tok={per_tok}"
      )
    if cfg.swiglu_limit is not None and cfg.hidden_act is not None:
      raise ValueError(
        f"swiglu_limit is gpt-oss's clamped SwiGLU (its own sigmoid, swiglu_alpha): not with hidden_act, got "
        f"hidden_act={cfg.hidden_act!r}"
      )
    return
  for key in ("num_local_experts", "num_experts_per_tok", "swiglu_limit"):
    if getattr(cfg, key) is not None:
      raise ValueError(
        f"{key} is a key of mlp_type='moe', got mlp_type={cfg.mlp_type!r} with {key}={getattr(cfg, key)}"
      )


def check_pattern_options(cfg: PatternKeys) -> None:
  """ValueError naming the key for an inconsistent pattern (the module docstring's rules)."""
  if cfg.layer_types is not None and cfg.sliding_window_pattern is not None:
    raise ValueError("give layer_types or sliding_window_pattern, not both")
  if cfg.layer_types is not None and len(cfg.layer_types) != cfg.num_layers:
    raise ValueError(
      f"layer_types must hold num_layers ({cfg.num_layers}) entries, each one of {list(LAYER_TYPES)}, "
      f"got {len(cfg.layer_types)}"
    )
  explicit = cfg.layer_types is not None or cfg.sliding_window_pattern is not None
  if not explicit and cfg.sliding_window is not None and cfg.attention_chunk_size is not None:
    raise ValueError(
      "sliding_window and attention_chunk_size together need layer_types saying which layers use which"
    )
  kinds = _kinds(cfg)
  for kind, key in (("sliding_attention", "sliding_window"), ("chunked_attention", "attention_chunk_size")):
    if kind in kinds and getattr(cfg, key) is None:
      raise ValueError(f"{kind} layers need {key} (a positive int), got None")
    if explicit and kind not in kinds and getattr(cfg, key) is not None:
      raise ValueError(f"{key} is set but no layer is {kind} (layer types: {sorted(kinds)})")
  if cfg.rope_local_base_freq is not None and (not cfg.rotates or "sliding_attention" not in kinds):
    raise ValueError(
      "rope_local_base_freq is the RoPE base of sliding_attention layers: it needs a rotating pos_encoding "
      f"and a sliding layer, got pos_encoding={cfg.pos_encoding!r}, layer types {sorted(set(kinds))}"
    )
  if cfg.attn_temperature_tuning and (cfg.rope_layers() is None or all(cfg.rope_layers())):
    raise ValueError(
      "attn_temperature_tuning scales q on NoPE layers: give no_rope_layers (or no_rope_layer_interval) with "
      "at least one 0"
    )
  if cfg.hidden_act is not None and cfg.mlp_type == "mlp":
    raise ValueError(
      "hidden_act is the gated MLP's (and moe experts') activation (mlp_type='gated' or 'moe'); mlp uses "
      "gelu_approximate"
    )
  check_moe_options(cfg)
  if cfg.qk_norm and cfg.pos_encoding == "rope_alibi":
    raise ValueError(
      "qk_norm normalises H dims per head: not with pos_encoding='rope_alibi' (extra q/k dims)"
    )
  uniform = len(kinds) == 1 and cfg.rope_local_base_freq is None
  if cfg.scan_layers and not uniform:
    raise ValueError(
      "scan_layers runs one block for every layer: it needs one attention type for all layers (and no "
      f"rope_local_base_freq), got layer types {sorted(kinds)}; set scan_layers=False"
    )
