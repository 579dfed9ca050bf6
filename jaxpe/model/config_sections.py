"""Sections of ``jaxpe.model.config.ModelConfig`` and the training config: ``RopeScalingConfig`` (HF's
``rope_scaling`` / ``rope_parameters`` dict) and ``LogicalRules`` (where the logical axes go on the
mesh). ``jaxpe.model.config`` re-exports both (their historical home)."""

from __future__ import annotations

import typing
from typing import Any, Literal

import pydantic

from jaxpe.model.strict import MAX_POSITION, StrictConfig
from jaxpe.ops import rope_scaling as rope_scaling_lib

MeshAxis = Literal["data", "fsdp", "tensor", "context"]
"""The mesh axes ``(data, fsdp, tensor, context)``, the values of ``LogicalRules``."""
MESH_AXES: tuple[str, ...] = typing.get_args(MeshAxis)


class RopeScalingConfig(StrictConfig):
  """HF-style ``rope_scaling`` / ``rope_parameters`` entry; see ``jaxpe.ops.rope_scaling.rope_frequencies``.

  A YAML mapping with HF's keys, spelled as transformers v4 (``rope_scaling``, ``type``) or v5
  (``rope_parameters`` with ``rope_theta`` and ``partial_rotary_factor`` inside). The spelling is
  settled by ``jaxpe.ops.rope_scaling.normalize_rope_parameters`` (``type`` -> ``rope_type``, legacy
  ``"su"`` -> ``"longrope"``, unknown keys and types refused); values are checked by
  ``rope_frequencies`` when ``ModelConfig`` validates. Lists become tuples so the config stays
  hashable. Unset keys are left out of ``as_dict()``.
  """

  rope_type: str = "default"
  rope_theta: float | None = pydantic.Field(None, gt=0, description="overrides ModelConfig.rope_theta")
  partial_rotary_factor: float | None = pydantic.Field(
    None, gt=0, le=1, description="rotary_dim = int(head_dim * partial_rotary_factor)"
  )
  factor: float | None = pydantic.Field(None, gt=0)
  original_max_position_embeddings: int | None = pydantic.Field(None, le=MAX_POSITION, gt=0)
  attention_factor: float | None = pydantic.Field(None, gt=0)
  beta_fast: float | None = None
  beta_slow: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  short_factor: tuple[float, ...] | None = None
  long_factor: tuple[float, ...] | None = None

  @pydantic.model_validator(mode="before")
  @classmethod
  def _from_hf_dict(cls, data: Any) -> Any:
    if isinstance(data, dict):
      kind = data.get("rope_type", data.get("type"))
      if kind is not None and not isinstance(kind, str):
        raise ValueError(f"rope_type must be a string such as 'linear' or 'yarn', got {kind!r}")
      data = rope_scaling_lib.normalize_rope_parameters(data)
      data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return data

  def as_dict(self) -> dict[str, Any]:
    """The HF-style dict (set keys only) for ``jaxpe.ops.rope_scaling.rope_frequencies``."""
    return {
      k: (list(v) if isinstance(v, tuple) else v) for k, v in self.model_dump().items() if v is not None
    }


Axes = MeshAxis | tuple[MeshAxis, ...] | None


class LogicalRules(StrictConfig):
  """Where each logical axis of parameters and activations goes on the mesh ``(data, fsdp, tensor,
  context)``.

  A value is one mesh axis, a list of them (the dimension is split over their product) or null
  (replicated). Within one array a mesh axis is used once: a later dimension whose axis is already
  taken is replicated (activations ``[B, T, D]`` are ``(batch, length, embed)``, so with the
  defaults B is split over ``data`` x ``fsdp`` and D, whose ``fsdp`` is taken, is not). Defaults:
  data parallelism over ``data``, FSDP over ``fsdp`` (parameters and optimizer state split along D,
  the batch over ``data`` x ``fsdp``), tensor parallelism over ``tensor`` (heads, MLP, vocab),
  context parallelism over ``context`` (the sequence T of activations; attention then runs across
  the shards, ``jaxpe.attention.context``). No parameter has a ``length`` axis, so parameters are
  replicated over ``context``.
  """

  batch: Axes = pydantic.Field(("data", "fsdp"), description="B of activations")
  length: Axes = pydantic.Field("context", description="T of activations (context parallelism)")
  embed: Axes = pydantic.Field("fsdp", description="D of parameters and activations")
  heads: Axes = pydantic.Field("tensor", description="N: query heads")
  kv_heads: Axes = pydantic.Field("tensor", description="K: key/value heads")
  head_dim: Axes = pydantic.Field(None, description="H: the head dimension")
  mlp: Axes = pydantic.Field("tensor", description="F: the MLP hidden dimension")
  vocab: Axes = pydantic.Field("tensor", description="V: the vocabulary")
  pos: Axes = pydantic.Field(None, description="the learned position table's positions")
  layers: Axes = pydantic.Field(None, description="L: stacked layers (scan_layers)")

  @pydantic.model_validator(mode="before")
  @classmethod
  def _lists_to_tuples(cls, data: Any) -> Any:
    if isinstance(data, dict):
      data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return data

  @pydantic.model_validator(mode="after")
  def _check_repeats(self) -> LogicalRules:
    for name, axes in self.as_tuple():
      if axes == ():
        raise ValueError(f"logical_rules.{name} is an empty list; write null for a replicated dimension")
      if isinstance(axes, tuple) and len(set(axes)) != len(axes):
        raise ValueError(f"logical_rules.{name} names a mesh axis twice: {list(axes)}")
    return self

  def as_tuple(self) -> tuple[tuple[str, Any], ...]:
    """``((logical name, mesh axes or None), ...)`` in field order."""
    return tuple((name, getattr(self, name)) for name in type(self).model_fields)
