"""The per-layer RoPE schedule (NoPE layers), p-RoPE and the RoPE + emulated ALiBi hybrid: the
checks and the derived schedule of ``ModelConfig``'s keys ``no_rope_layers``,
``no_rope_layer_interval``, ``rope_proportion`` and ``rope_alibi_content_rope``.

Sources: NoPE layers as Llama 4 and SmolLM3 (transformers 5.24 ``Llama4TextConfig`` /
``SmolLM3Config``: ``no_rope_layers``, 1 = RoPE, default ``int((layer_idx + 1) %
no_rope_layer_interval != 0)``; Yang et al., "Rope to Nope and Back Again", arXiv 2501.18795);
p-RoPE (Barbero et al., arXiv 2410.06205; gemma's ``rope_proportion``).
"""

from __future__ import annotations

from typing import Any, Protocol


class RopeKeys(Protocol):
  """The keys of ``jaxpe.model.config.ModelConfig`` these checks read (a Protocol, not an import:
  the config imports this module, and nothing here imports the config)."""

  pos_encoding: str
  num_layers: int
  max_len: int
  rotary_dim: int | None
  rope_scaling: Any  # a RopeScalingConfig or None
  rope_alibi_content_rope: bool
  rope_alibi_in_projection: bool
  no_rope_layers: tuple[int, ...] | None
  no_rope_layer_interval: int | None
  rope_proportion: float | None

  @property
  def rotates(self) -> bool: ...


def rope_layers(cfg: RopeKeys) -> tuple[bool, ...] | None:
  """``[L]`` whether each layer rotates (``no_rope_layers``, or the ``no_rope_layer_interval``
  rule ``(i + 1) % n != 0`` of transformers' Llama4TextConfig and SmolLM3Config); None without a
  schedule (every layer rotates)."""
  if cfg.no_rope_layers is not None:
    return tuple(bool(f) for f in cfg.no_rope_layers)
  if cfg.no_rope_layer_interval is not None:
    return tuple((i + 1) % cfg.no_rope_layer_interval != 0 for i in range(cfg.num_layers))
  return None


def check_rope_options(cfg: RopeKeys) -> None:
  """The per-layer schedule, p-RoPE and the hybrid (issue 20); xPos's longest context."""
  pe = cfg.pos_encoding
  if cfg.pos_encoding == "xpos" and cfg.max_len > 65536:
    # xPos scales zeta^((p - offset) / scale_base) with offset = max_len // 2 overflow float32
    # beyond |p - offset| ~ 35,000.
    raise ValueError(f"max_len must be <= 65536 for pos_encoding='xpos', got {cfg.max_len}")
  if cfg.rope_alibi_content_rope and (pe != "rope_alibi" or cfg.rope_alibi_in_projection):
    raise ValueError(
      "rope_alibi_content_rope=True needs pos_encoding='rope_alibi' without rope_alibi_in_projection, "
      f"got pos_encoding={pe!r}, rope_alibi_in_projection={cfg.rope_alibi_in_projection}"
    )
  if cfg.no_rope_layers is not None or cfg.no_rope_layer_interval is not None:
    if cfg.no_rope_layers is not None and cfg.no_rope_layer_interval is not None:
      raise ValueError("give no_rope_layers or no_rope_layer_interval, not both")
    if not cfg.rotates:
      raise ValueError(
        "no_rope_layers / no_rope_layer_interval choose which layers rotate q and k: they need pos_encoding "
        f"'rope', 'xpos' or 'rope_alibi' with rope_alibi_content_rope=True, got pos_encoding={pe!r}"
      )
    flags = cfg.no_rope_layers
    if flags is not None and (len(flags) != cfg.num_layers or any(f not in (0, 1) for f in flags)):
      raise ValueError(
        f"no_rope_layers must hold num_layers ({cfg.num_layers}) entries, each 1 (RoPE) or 0 (NoPE), "
        f"got {list(flags)}"
      )
  if cfg.rope_proportion is not None:
    kind = None if cfg.rope_scaling is None else cfg.rope_scaling.rope_type
    if pe not in ("rope", "rope_alibi") or not cfg.rotates or cfg.rotary_dim is not None:
      raise ValueError(
        "rope_proportion (p-RoPE) needs pos_encoding 'rope' (or 'rope_alibi' with rope_alibi_content_rope=True) "
        f"and no rotary_dim (its zero frequencies span the head), got pos_encoding={pe!r}, "
        f"rotary_dim={cfg.rotary_dim}"
      )
    if kind not in (None, "linear"):
      raise ValueError(
        f"rope_proportion combines only with rope_scaling 'linear' (gemma's scale_factor), got {kind!r}; "
        "rope_scaling={'rope_type': 'proportional', 'partial_rotary_factor': p} is the same p-RoPE"
      )
    unused = sorted(set(cfg.rope_scaling.as_dict()) - {"rope_type", "factor", "rope_theta"}) if kind else []
    if unused:  # p-RoPE reads only the linear factor (and the base); the rest would be ignored
      raise ValueError(
        f"rope_scaling keys {unused} are not used with rope_proportion (p-RoPE reads rope_type 'linear', "
        "factor and rope_theta only)"
      )
