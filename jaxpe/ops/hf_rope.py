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
  ``mrope_section``) via ``jaxpe.ops.rope_parameters.normalize_rope_parameters``;
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

Keys of the rope dict that jaxpe does not understand raise ``ValueError`` naming them. The
per-family rules live in ``jaxpe.ops.hf_families``, the config reading in ``jaxpe.ops.hf_config``;
``HFRope.apply`` rotates q or k with the config's pair layout (no layout to guess).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops import hf_families as _families
from jaxpe.ops import hf_verified as _verified
from jaxpe.ops.hf_axial import axial_rope
from jaxpe.ops.hf_config import (
  as_dict,
  fill_base_and_partial,
  first,
  head_dim_of,
  max_positions,
  odd_rotary_dim,
  original_length,
  positive_int,
  rope_dict,
  select_rope_params,
  text_config,
)
from jaxpe.ops.hf_families import INTERLEAVED_FAMILIES
from jaxpe.ops.layouts import check_layout
from jaxpe.ops.rope import PhasePrecision, apply_rope
from jaxpe.ops.rope_parameters import check_seq_len, normalize_rope_parameters, param_float
from jaxpe.ops.rope_scaling import rope_frequencies

__all__ = ["INTERLEAVED_FAMILIES", "HFRope", "rope_from_hf_config"]


@dataclasses.dataclass(frozen=True, eq=False)
class HFRope:
  """What a RoPE layer needs to reproduce a Hugging Face model's rotary embedding.

  Attributes:
    model_type: the config's ``model_type`` (None when absent).
    layer_type: the per-layer-type entry used (``"full_attention"``, ...) or None.
    rope_type: one of ``jaxpe.ROPE_TYPES`` after normalisation (``"su"`` reads as ``"longrope"``),
      or ``"axial"`` (vision encoders' 2-D patch RoPE, see ``jaxpe.ops.hf_axial``).
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
    attention_factor: multiplies cos and sin (``jaxpe.apply_rope(attention_factor=...)``); yarn and longrope.
    softmax_scale_factor: multiplies the attention softmax scale ``1/sqrt(qk_head_dim)``
      (``yarn_get_mscale(factor, mscale_all_dim) ** 2`` in DeepSeek-V2/V3 style models; else 1).
    length_dependent: True for ``dynamic`` and ``longrope``: use ``frequencies(seq_len)``.
    query_scale_beta: Ministral-3 / Mistral-4's ``llama_4_scaling_beta`` (queries multiplied by
      ``query_scale(positions)``), or None.
    mrope_axes: ``[R/2]`` the row of ``[A, B, T]`` multi-axis positions (t, h, w) each frequency
      takes, as the family's rotary module recomposes them (Qwen2-VL contiguous sections, Qwen3-VL
      interleaved, ERNIE-4.5-VL h/w pairs, NeoMME row/column), with the module's default section
      when the config has none; None without multi-axis RoPE, and for HunYuan-VL (its XD sections
      give the two dims of a pair different rows: text positions only).
    rotation_sign: 1, or -1 where the family's ``rotate_half`` has flipped signs (NanoChat: q
      rotates by ``-theta``; ``apply`` passes ``-inv_freq``). cos/sin are transformers' either way.
    longrope_mscale: PhiMoE's ``(short_mscale, long_mscale)``: the cos/sin scale for ``seq_len <=
      original_max_position_embeddings`` and past it, replacing longrope's attention factor, with
      longrope's long factors past that length (``frequencies``; the model's authors' rule, where
      transformers 5.x's module keeps the short-factor table at every length). Else None.
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
  mrope_axes: tuple[int, ...] | None = None
  rotation_sign: int = 1
  longrope_mscale: tuple[float, float] | None = None

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

    PhiMoE (``longrope_mscale``): longrope's tables (the long factors past the original length, as
    Microsoft's model code, transformers 4.x and vLLM; transformers 5.x keeps the short table at
    every length), scaled by ``short_mscale`` up to the original length and ``long_mscale`` past it.

    Raises:
      ValueError: ``seq_len`` negative or not an integer.
    """
    if self.rope_type == "axial":
      check_seq_len(seq_len)
      return self.inv_freq, self.attention_factor
    if self.longrope_mscale is not None:
      seq_len = check_seq_len(seq_len)
      short, long = self.longrope_mscale
      inv_freq, _ = rope_frequencies(  # longrope's table: the long factors past the original length
        self.parameters,
        head_dim=self.head_dim,
        rotary_dim=self.rotary_dim,
        max_position_embeddings=self.max_position_embeddings,
        seq_len=seq_len,
      )
      if seq_len is None:
        return inv_freq, short
      if isinstance(seq_len, jax.core.Tracer):
        return inv_freq, jnp.where(seq_len > self.original_max_position_embeddings, long, short)
      return inv_freq, long if seq_len > self.original_max_position_embeddings else short
    return rope_frequencies(
      self.parameters,
      head_dim=self.head_dim,
      rotary_dim=self.rotary_dim,
      max_position_embeddings=self.max_position_embeddings,
      seq_len=seq_len,
    )

  def apply(
    self,
    x: jax.Array,
    positions: jax.Array,
    *,
    seq_len: int | jax.Array | None = None,
    phase_precision: PhasePrecision = "exact",
  ) -> jax.Array:
    """``x`` rotated as the model rotates it: ``apply_rope`` with this config's ``layout``,
    ``rotated_slice``, ``mrope_section``, ``inv_freq`` and ``attention_factor``.

    Args:
      x: ``[B, T, N, H]`` float queries (or keys ``[B, S, K, H]``), the whole head: ``H >=
        rotary_dim``; the first R dims rotate (the last R for ``rotated_slice="trailing"``).
      positions: ``[B, T]``, ``[1, T]`` or ``[T]`` token indices; with ``mrope_axes``, also ``[A, B, T]``
        or ``[A, 1, T]`` multi-axis positions (one row per axis, t/h/w). Token positions give every
        axis the same position, as transformers does for text tokens (the cos/sin of plain RoPE).
      seq_len: for ``dynamic`` / ``longrope``, the length ``frequencies(seq_len)`` takes; None:
        transformers' init-time table (``inv_freq``, ``attention_factor``).
      phase_precision: as ``apply_rope``.

    Returns:
      ``[B, T, N, H]`` array of ``x.dtype``. Ministral-3's ``query_scale`` and the
      ``softmax_scale_factor`` are the caller's (they act on queries and scores).

    Raises:
      ValueError / TypeError: as ``apply_rope`` and ``frequencies``; rank-3 positions without
        ``mrope_axes``; with ``mrope_axes``, ``[B, T]`` positions whose B equals the number of axes
        A > 1 (ambiguous with the ``[A, T]`` multi-axis form this method took before: pass
        ``[A, B, T]``).
    """
    inv_freq, attention_factor = self.inv_freq, self.attention_factor
    if seq_len is not None:
      inv_freq, attention_factor = self.frequencies(seq_len)
    if self.rotation_sign == -1:
      inv_freq = -inv_freq
    section = None
    axes = None if self.mrope_axes is None else max(self.mrope_axes) + 1
    if jnp.ndim(positions) == 2 and axes is not None and axes > 1 and jnp.shape(positions)[0] == axes:
      # [A, T] was this method's multi-axis form before 2026-12; [B, T] with B == A would now be read
      # as token positions: refuse the ambiguity rather than misread either
      raise ValueError(
        f"positions of shape {jnp.shape(positions)} are ambiguous for model_type {self.model_type!r} "
        f"({axes} position axes): pass multi-axis positions as [A, B, T] = [{axes}, B, T] (text tokens: "
        "every row the same, as transformers expands position_ids), or token positions as [T]"
      )
    if jnp.ndim(positions) == 3:  # [A, B, T] multi-axis positions
      if self.mrope_axes is None:
        raise ValueError(
          f"positions of shape {jnp.shape(positions)} are multi-axis ([A, B, T]), but model_type "
          f"{self.model_type!r} has no per-frequency axis map (mrope_axes is None): pass [B, T] token positions"
        )
      if jnp.shape(positions)[0] != max(self.mrope_axes) + 1:
        raise ValueError(
          f"multi-axis positions must have {max(self.mrope_axes) + 1} rows for model_type "
          f"{self.model_type!r}, got shape {jnp.shape(positions)}"
        )
      positions = jnp.asarray(positions)[np.asarray(self.mrope_axes)]  # one row per frequency
      section = (1,) * len(self.mrope_axes)
    return apply_rope(
      x,
      positions,
      inv_freq=inv_freq,
      layout=self.layout,
      attention_factor=attention_factor,
      rotated_slice=self.rotated_slice,
      mrope_section=section,
      phase_precision=phase_precision,
    )


def _axial_rope(
  cfg: Mapping[str, Any], model_type: Any, params: Mapping[str, Any], layer_type: Any
) -> HFRope:
  """A vision encoder's ``axial`` RoPE (``jaxpe.ops.hf_axial``): 2-D (h, w) patch positions."""
  foreign = sorted(set(params) - {"rope_type", "type", "rope_theta"})
  if foreign:
    raise ValueError(f"rope_scaling keys {foreign} are not read by rope_type 'axial' (it reads rope_theta)")
  base = param_float(
    "rope_theta", first(params, "rope_theta") or cfg.get("rope_theta"), minimum=0.0, strict=True
  )
  inv_freq, axes, layout, head_dim = axial_rope(cfg, model_type, base)
  return HFRope(
    model_type=model_type,
    layer_type=layer_type,
    rope_type="axial",
    parameters=types.MappingProxyType({"rope_type": "axial", "rope_theta": base}),
    head_dim=head_dim,
    rotary_dim=2 * len(inv_freq),
    rope_theta=base,
    layout=layout,
    rotated_slice="leading",
    max_position_embeddings=None,
    original_max_position_embeddings=None,
    mrope_section=None,
    inv_freq=jnp.asarray(inv_freq, jnp.float32),
    attention_factor=1.0,
    softmax_scale_factor=1.0,
    length_dependent=False,
    mrope_axes=axes,
  )


def rope_from_hf_config(
  config: Any,
  *,
  layer_type: str | None = None,
  layout: Literal["half", "interleaved"] | None = None,
  rotated_slice: Literal["leading", "trailing"] | None = None,
  rotary_dim: int | None = None,
) -> HFRope:
  """Everything a RoPE layer needs from a Hugging Face model config.

  What a config does not state (the pair layout, which dims rotate, multi-axis positions, latent
  heads, a softmax scale convention, its class's defaults) is read from ``jaxpe.ops.hf_families``'
  tables only for a family jaxpe has verified against transformers' modeling code
  (``jaxpe.ops.hf_verified.VERIFIED_FAMILIES``, transformers 5.25.0: 270 model types). Any other
  ``model_type`` (a family a newer transformers adds, a config without ``model_type``) is refused
  by name (``UnverifiedFamilyError``) unless ``layout``, ``rotated_slice`` and, for a config that
  does not state ``partial_rotary_factor``, ``rotary_dim`` are given; the message says how to read
  them off the family's ``apply_rotary_pos_emb`` and docs/rope.md how to check the result.

  Args:
    config: a ``config.json`` dict (``json.load``) or a transformers ``PretrainedConfig``. Composite
      configs (a ``text_config`` and no rope keys at the top) use their ``text_config``.
    layer_type: for configs with per-layer-type rope parameters (Gemma-3's ``"sliding_attention"``
      / ``"full_attention"``, and any v5 config whose ``rope_parameters`` is keyed by
      ``layer_types``): which entry. Must be None for the other configs.
    layout: ``"half"`` (rotate_half, pairs (i, i + R/2)) or ``"interleaved"`` (pairs (2i, 2i + 1)):
      the pair layout the model's checkpoint rotates. None: the verified family's (required for an
      unverified one). A value given always wins over the tables (a checkpoint converted to the
      other layout).
    rotated_slice: ``"leading"`` (the first R dims of each q/k head rotate) or ``"trailing"`` (the
      last R: latent-attention heads ``[nope | rope]``). None: the verified family's (required for an
      unverified one); a value given always wins.
    rotary_dim: R, the dims per head that rotate (even, ``0 < R <= head_dim``; must agree with a
      ``partial_rotary_factor`` the config states). None: from the config (and the family's class
      default, which a stated value replaces). Required for an unverified family unless its config
      states ``partial_rotary_factor``.

  Returns:
    ``HFRope`` (frozen): ``inv_freq [R/2]`` float32 radians per token, ``attention_factor`` (scales
    cos and sin), ``head_dim``, ``rotary_dim``, ``layout``, ``rotated_slice``,
    ``softmax_scale_factor``, ``length_dependent`` and ``frequencies(seq_len)``; see ``HFRope``.
    Apply with ``r.apply(x, positions)``, which is ``jaxpe.apply_rope(x, positions,
    inv_freq=r.inv_freq, layout=r.layout, attention_factor=r.attention_factor, rotated_slice=r.rotated_slice,
    mrope_section=r.mrope_section)``.

  Family rules beyond the rope dict (see ``HFRope`` and docs/rope.md): mRoPE (``mrope_axes``:
  Qwen2-VL contiguous sections, Qwen3-VL / Qwen3.5 / Qwen3-Omni interleaved, ERNIE-4.5-VL h/w pairs,
  NeoMME; token positions ``[B, T]`` give every axis the same position, ``[A, B, T]`` the rows per
  axis; HunYuan-VL token positions only); PhiMoE's ``short_mscale`` / ``long_mscale``
  (``longrope_mscale``); HunYuan's ``dynamic`` with ``alpha`` (a static base ``rope_theta * alpha **
  (H / (H - 2))``); an odd rotary dim d (``rotary_dim = d + 1``, base ``** (-2i / d)``, as
  transformers); NanoChat's flipped rotation (``rotation_sign = -1``); vision encoders' ``axial``
  2-D RoPE (``jaxpe.ops.hf_axial``: ``inv_freq`` per frequency of the head, ``mrope_axes`` its row
  of ``[2, B, T]`` (h, w) patch positions).

  Raises:
    TypeError: ``config`` is neither a mapping nor has ``to_dict()``.
    ``jaxpe.ops.UnverifiedFamilyError`` (a ValueError): a ``model_type`` outside ``VERIFIED_FAMILIES`` (or none)
      without ``layout`` / ``rotated_slice`` / ``rotary_dim`` as above, or with a key whose meaning is
      the family's (``qk_rope_head_dim``, ``mrope_section``, ``mscale_all_dim``, ...), named.
    ValueError: ``layout`` / ``rotated_slice`` not one of their values, ``rotary_dim`` not an even
      int in ``(0, head_dim]``; unknown keys in the rope dict (named); unknown ``rope_type``; a family without
      RoPE (``alibi: true`` Falcon, BLOOM, MPT, ...); image-grid RoPE that is not one rotation per
      pair or not built from the config (Gemma-4's vision tower, DINOv3, EfficientLoFTR), named; an odd rotary dim with a type
      other than default / linear, or whose table is wider than the head; PhiMoE longrope without
      ``short_mscale`` / ``long_mscale``; an ``mrope_section`` that does not sum to R/2 where the
      family splits by it; no ``rope_theta`` where transformers' default
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
  if layout is not None:
    layout = check_layout(layout, "rope_from_hf_config")
  if rotated_slice is not None and (
    not isinstance(rotated_slice, str) or rotated_slice not in ("leading", "trailing")
  ):
    raise ValueError(f"rotated_slice must be 'leading' or 'trailing' (or None), got {rotated_slice!r}")
  if rotary_dim is not None:
    rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  cfg = text_config(as_dict(config))
  model_type = cfg.get("model_type")
  if model_type is not None and not isinstance(model_type, str):
    raise _checks.ArgTypeError(f"config['model_type'] must be a string, got {model_type!r}")
  family = _families.family(model_type)
  _families.check_supported(family, model_type, cfg)
  params, nested = select_rope_params(cfg, rope_dict(cfg, family), family, layer_type)
  if not _verified.is_verified(model_type):
    _verified.refuse_unverified(
      model_type,
      cfg,
      params,
      layout=layout,
      rotated_slice=rotated_slice,
      rotary_dim=rotary_dim,
    )
  params = _families.family_rope_type(params, family)
  if params.get("rope_type", params.get("type")) == "axial":
    for arg, value in (
      ("rotated_slice", rotated_slice if rotated_slice == "trailing" else None),
      ("rotary_dim", rotary_dim),
    ):
      if value is not None:
        raise ValueError(
          f"model_type {model_type!r} has 2-D axial RoPE over the whole head: {arg}={value!r} does not apply to it"
        )
    axial = _axial_rope(cfg, model_type, params, layer_type)
    return axial if layout is None else dataclasses.replace(axial, layout=layout)
  query_scale_beta = params.pop("llama_4_scaling_beta", None)  # Ministral-3 / Mistral-4: scales queries
  params, extras = _families.family_extras(params, family)
  # A stated rotary_dim replaces the family's default partial factor (a value the config states
  # must still agree with it: rope_frequencies checks that).
  params = normalize_rope_parameters(fill_base_and_partial(params, cfg, family, rotary_dim is None))
  rope_type = params["rope_type"]

  # Head and rotary dims.
  table_trailing = family in _families.MLA_FAMILIES or family == "deepseek_v4"
  rotated_slice = rotated_slice or ("trailing" if table_trailing else "leading")
  # MLA configs set head_dim = qk_rope_head_dim (DeepseekV3Config), unless the rope dict carries a
  # partial_rotary_factor of head_dim (Mistral-4).
  mla = family in _families.MLA_FAMILIES and cfg.get("qk_rope_head_dim") is not None
  mla = mla and params.get("partial_rotary_factor") is None
  head_dim = head_dim_of(cfg, family, layer_type, mla)
  rope_theta = params["rope_theta"]
  if rope_type == "dynamic" and extras.get("alpha"):
    # HunYuan: "dynamic" with alpha is transformers' static ntk_alpha, base * alpha ** (H / (H - 2))
    # over the whole head; the dict's other keys are not read.
    alpha = param_float("alpha", extras["alpha"], minimum=0.0, strict=True)
    if head_dim <= 2:
      raise ValueError(f"HunYuan's NTK alpha needs head_dim > 2 (exponent H / (H - 2)), got {head_dim}")
    rope_theta = float(params["rope_theta"]) * alpha ** (head_dim / (head_dim - 2))
    kept = {k: params[k] for k in ("mrope_section",) if k in params}
    params = {"rope_type": "default", "rope_theta": rope_theta, **kept}
    rope_type = "default"
  if rotary_dim is not None and rotary_dim > head_dim:
    raise ValueError(f"rotary_dim must be <= head_dim = {head_dim} (from the config), got {rotary_dim}")
  if rotary_dim is None and family in _families.ROTARY_DIM_FAMILIES and cfg.get("rotary_dim") is not None:
    rotary_dim = positive_int(cfg, "rotary_dim")
  params, rotary_dim = odd_rotary_dim(cfg, params, family, head_dim, rotary_dim, mla)

  max_pos = max_positions(cfg)
  params, original = original_length(params, cfg, family, bool(nested), max_pos)
  mrope = params.get("mrope_section")
  mrope = None if mrope is None else tuple(int(v) for v in mrope)
  inv_freq, attention_factor = rope_frequencies(
    params, head_dim=head_dim, rotary_dim=rotary_dim, max_position_embeddings=max_pos
  )
  longrope_mscale = None
  if family in _families.FAMILY_KEYS["short_mscale"] and rope_type != "default":
    # PhiMoE's forward scales cos/sin by short_mscale / long_mscale (by seq_len) instead of the
    # type's attention factor, and recomputes the init-time table at every length.
    missing = [k for k in ("short_mscale", "long_mscale") if extras.get(k) is None]
    if missing:
      raise ValueError(
        f"model_type {model_type!r} with rope_type {rope_type!r} needs {missing} in its rope dict"
      )
    if original is None:
      raise ValueError(
        f"model_type {model_type!r} with short/long_mscale needs original_max_position_embeddings"
      )
    longrope_mscale = tuple(param_float(k, extras[k]) for k in ("short_mscale", "long_mscale"))
    attention_factor = longrope_mscale[0]
  return HFRope(
    model_type=model_type,
    layer_type=layer_type,
    rope_type=rope_type,
    parameters=types.MappingProxyType(params),
    head_dim=head_dim,
    rotary_dim=2 * int(inv_freq.shape[0]),
    rope_theta=float(rope_theta),
    # the family's layout (its MLA heads' rope_interleave included) whatever slice was stated
    layout=layout or _families.pair_layout(family, cfg, table_trailing),
    rotated_slice=rotated_slice,
    max_position_embeddings=max_pos,
    original_max_position_embeddings=original,
    mrope_section=mrope,
    inv_freq=inv_freq,
    attention_factor=float(attention_factor),
    softmax_scale_factor=_families.softmax_scale_factor(family, model_type, rope_type, params),
    length_dependent=rope_type in ("dynamic", "longrope") or longrope_mscale is not None,
    query_scale_beta=None if query_scale_beta is None else float(query_scale_beta),
    mrope_axes=_families.mrope_axes(family, mrope, int(inv_freq.shape[0])),
    rotation_sign=-1 if family in _families.FLIPPED_ROTATION_FAMILIES else 1,
    longrope_mscale=longrope_mscale,
  )
