"""``StrictConfig``, the base of every jaxpe config (``ModelConfig``, ``TrainConfig``, the study's),
and the ops' bounds that the keys' ranges are, so that a value an op cannot use is refused when the
config is read, naming the dotted key, not when the op first runs (issue 39).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import annotated_types
import pydantic

from jaxpe.emulation import MAX_POSITION as EMULATION_MAX_POSITION
from jaxpe.ops import checks

MAX_DIM, MAX_POSITION, MAX_INT32 = checks.MAX_DIM, checks.MAX_POSITION, checks.MAX_INT32
MAX_INT64 = 2**63 - 1
"""Every int key, also one no op bounds (``data.max_bytes``, ``eval_every``): larger ints overflow
numpy and Python's floats (``data.max_bytes=1e400`` as digits was an ``OverflowError`` traceback)."""
"""The ops' bounds (``jaxpe.ops.checks``): sizes (dims, heads, vocabulary, layers, buckets) <=
``MAX_DIM`` = 2^20; lengths and positions <= ``MAX_POSITION`` = 2^31 (int32 token indices); the
emulation's context <= ``EMULATION_MAX_POSITION`` = 2^24 (``jaxpe.emulation``); step counts <=
``MAX_INT32`` (the optimizer's int32 count)."""

Length = Annotated[int, pydantic.Field(lt=MAX_POSITION)]
"""An int key that is a length in tokens (< 2^31: a sequence's positions are int32 token indices)."""
Steps = Annotated[int, pydantic.Field(le=MAX_INT32)]
"""An int key that is a number of optimizer steps (<= 2^31 - 1: the optimizer's int32 step count)."""

__all__ = [
  "EMULATION_MAX_POSITION",
  "MAX_DIM",
  "MAX_INT32",
  "MAX_INT64",
  "MAX_POSITION",
  "Length",
  "StrictConfig",
  "Steps",
]


def _positive(field: pydantic.fields.FieldInfo) -> bool:
  """Whether the key is declared > 0 (``gt >= 0`` or ``ge > 0``)."""
  return any(
    (isinstance(m, annotated_types.Gt) and m.gt >= 0) or (isinstance(m, annotated_types.Ge) and m.ge > 0)
    for m in field.metadata
  )


class StrictConfig(pydantic.BaseModel):
  """Base of every jaxpe config: frozen, no unknown keys, strict types (ints for floats), no inf/NaN,
  and every float (also inside a tuple) a usable float32 (``jaxpe.ops.checks.float32_problem``: at
  most ~3.4e38 in magnitude, and a key declared > 0 at least ~1.2e-38), the dtype the ops compute in,
  so ``fire_init_L=1e39`` is refused naming the key instead of becoming inf in the first step; every
  int at most ``MAX_INT64`` in magnitude."""

  model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
  omit_at_default: ClassVar[tuple[str, ...]] = ()
  """Keys left out of dumps while they hold their default (keys added later: the saved configs, and
  the cache keys made from them, of runs that do not set them stay as they were)."""

  @pydantic.model_serializer(mode="wrap")
  def _omit_defaults(self, handler: Any) -> dict[str, Any]:
    out = handler(self)
    for key in self.omit_at_default:
      if getattr(self, key) == type(self).model_fields[key].default:
        out.pop(key, None)
    return out

  @pydantic.field_validator("*", mode="after")
  @classmethod
  def _float32_values(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
    positive = _positive(cls.model_fields[info.field_name])
    for v in value if isinstance(value, tuple) else (value,):
      problem = checks.float32_problem(v, positive=positive) if isinstance(v, float) else None
      if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT64:
        digits = str(v)
        shown = digits if len(digits) <= 24 else f"a {len(digits.lstrip('-'))}-digit integer"
        problem = f"must be at most 2^63 - 1 = {MAX_INT64} in magnitude (a 64-bit integer), got {shown}"
      if problem:
        raise ValueError(problem)
    return value
