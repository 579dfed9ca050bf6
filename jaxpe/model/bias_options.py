"""The checks of ``ModelConfig``'s keys for attention biases and sinks: the encodings only the
``xla`` backend computes (CoPE, T5, Kerple, FIRE), ``cope_npos_max``, ``attention_sinks`` and T5's
buckets (``relative_attention_num_buckets`` / ``relative_attention_max_distance``, HF T5's keys)."""

from __future__ import annotations

from typing import Protocol

from jaxpe.ops import checks


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
  fire_init_c: float
  fire_init_L: float
  max_len: int


XLA_ONLY_ENCODINGS: tuple[str, ...] = ("cope", "t5", "kerple_log", "kerple_power", "fire")
"""Encodings that are additive biases only the ``xla`` backend computes (docs/attention.md): a config
with a fused ``attn_implementation`` is refused (``auto`` runs them on ``xla`` on every platform:
``jaxpe.attention.attention`` passes over the kernels that take no bias)."""


def check_bias_options(cfg: BiasKeys) -> None:
  """Raises ValueError naming the key: ``cope_npos_max`` without ``pos_encoding='cope'``; an
  ``XLA_ONLY_ENCODINGS`` encoding with a fused ``attn_implementation``; ``attention_sinks`` on
  ``cudnn`` or ``pallas_gpu``; T5's ``relative_attention_max_distance`` not above half the buckets;
  FIRE's ``fire_init_c x max(fire_init_L, max_len)`` above ``FLOAT32_MAX`` (its log(c x + 1) would be inf)."""
  if cfg.cope_npos_max is not None and cfg.pos_encoding != "cope":
    raise ValueError(f"cope_npos_max needs pos_encoding='cope', got pos_encoding={cfg.pos_encoding!r}")
  if cfg.pos_encoding in XLA_ONLY_ENCODINGS and cfg.attn_implementation not in ("xla", "auto"):
    raise ValueError(
      f"pos_encoding={cfg.pos_encoding!r} is an additive bias that only the xla backend computes "
      f"(fused kernels take no bias): attn_implementation must be 'xla', got {cfg.attn_implementation!r}"
    )
  if cfg.attention_sinks and cfg.attn_implementation in ("cudnn", "pallas_gpu"):
    raise ValueError(
      f"attention_sinks runs on attn_implementation 'xla', 'splash' or 'flash', got {cfg.attn_implementation!r}"
    )
  if (
    cfg.pos_encoding == "t5"
    and cfg.relative_attention_max_distance <= cfg.relative_attention_num_buckets // 2
  ):
    raise ValueError(
      f"relative_attention_max_distance ({cfg.relative_attention_max_distance}) must be > "
      f"relative_attention_num_buckets // 2 = {cfg.relative_attention_num_buckets // 2} (the exact buckets)"
    )
  if cfg.pos_encoding == "fire" and cfg.fire_init_c * max(cfg.fire_init_L, cfg.max_len) > checks.FLOAT32_MAX:
    # FIRE's normaliser log(|c max(L, i)| + 1) (jaxpe.ops.fire_interpolation) in float32
    raise ValueError(
      f"fire_init_c x max(fire_init_L, max_len) must be <= {checks.FLOAT32_MAX:.7g} (FIRE's log(c x + 1) in "
      f"float32), got {cfg.fire_init_c!r} x {max(cfg.fire_init_L, cfg.max_len)!r}"
    )
