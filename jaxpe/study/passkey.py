"""The passkey sample's format (``PLANT``, ``PROMPT``, ``KEY_DIGITS``) and where the plant goes
(``plant_offset``): the part of ``jaxpe.study.retrieval`` that ``jaxpe.study.config`` checks lengths
with, kept apart so the config imports no evaluation code. Re-exported by ``jaxpe.study.retrieval``.
"""

from __future__ import annotations

__all__ = ["KEY_DIGITS", "PLANT", "PROMPT", "plant_offset"]

KEY_DIGITS = 5
"""Digits of a passkey."""
PLANT = " pass key {key}. "
"""The sentence planted in the filler (``{key}``: the digits)."""
PROMPT = " pass key "
"""The question at the end of a sample; the key's digits follow it."""


def _template_len() -> int:
  return len(PLANT.format(key="0" * KEY_DIGITS)) + len(PROMPT) + KEY_DIGITS


def plant_offset(length: int, depth: float) -> int:
  """Index (0-based byte) where ``PLANT`` starts in a sample of eval length ``length`` at ``depth``.

  Raises:
    ValueError: ``depth`` outside [0, 1], or ``length`` shorter than the template (plant, prompt, key).
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1] (a fraction of the filler), got {depth}")
  n = length + 1 - _template_len()
  if n < 0:
    raise ValueError(f"length must be >= {_template_len() - 1} (the passkey template), got {length}")
  return round(depth * n)
