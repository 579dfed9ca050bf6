"""The checks of ``ModelConfig``'s keys for attention biases and sinks: the encodings only the
``xla`` backend computes (CoPE, T5, Kerple, FIRE), ``cope_npos_max``, ``attention_sinks`` and T5's
buckets (``relative_attention_num_buckets`` / ``relative_attention_max_distance``, HF T5's keys)."""

from __future__ import annotations

from typing import Protocol


class BiasKeys(Protocol):
  """The keys of ``jaxpe.model.config.ModelConfig`` these checks read (a Protocol, not an import:
  the config imports this module, and nothing here imports the config)."""

  pos_encoding: str
  attn_implementation: str
  attention_interpret: bool
  attention_sinks: bool
  cope_npos_max: int | None
  relative_attention_num_buckets: int
  relative_attention_max_distance: int


XLA_ONLY_ENCODINGS: tuple[str, ...] = ("cope", "t5", "kerple_log", "kerple_power", "fire")
"""Encodings that are additive biases only the ``xla`` backend computes (docs/attention.md): a config
with a fused ``attn_implementation`` is refused (``auto`` runs them on ``xla`` on every platform:
``jaxpe.attention.attention`` passes over the kernels that take no bias)."""


def check_bias_options(cfg: BiasKeys) -> None:
  """Raises ValueError naming the key: ``cope_npos_max`` without ``pos_encoding='cope'``; an
  ``XLA_ONLY_ENCODINGS`` encoding with a fused ``attn_implementation``; ``attention_sinks`` on
  ``cudnn``, ``pallas_gpu`` or ``flash``; T5's ``relative_attention_max_distance`` not above half the buckets."""
  if cfg.cope_npos_max is not None and cfg.pos_encoding != "cope":
    raise ValueError(f"cope_npos_max needs pos_encoding='cope', got pos_encoding={cfg.pos_encoding!r}")
  if cfg.pos_encoding in XLA_ONLY_ENCODINGS and cfg.attn_implementation not in ("xla", "auto"):
    raise ValueError(
      f"pos_encoding={cfg.pos_encoding!r} is an additive bias that only the xla backend computes "
      f"(fused kernels take no bias): attn_implementation must be 'xla', got {cfg.attn_implementation!r}"
    )
  if cfg.attention_sinks and cfg.attn_implementation in ("cudnn", "pallas_gpu", "flash"):
    raise ValueError(
      f"attention_sinks runs on attn_implementation 'xla' or 'splash', got {cfg.attn_implementation!r}"
    )
  if (
    cfg.pos_encoding == "t5"
    and cfg.relative_attention_max_distance <= cfg.relative_attention_num_buckets // 2
  ):
    raise ValueError(
      f"relative_attention_max_distance ({cfg.relative_attention_max_distance}) must be > "
      f"relative_attention_num_buckets // 2 = {cfg.relative_attention_num_buckets // 2} (the exact buckets)"
    )
