"""HF ``rope_scaling`` / ``rope_parameters`` dicts: their spelling, their keys and their values.

``normalize_rope_parameters`` settles the spelling (``type`` -> ``rope_type``, legacy ``"su"`` ->
``"longrope"``); ``check_type_keys`` refuses a missing required key or a key the type does not read;
the ``param_*`` readers and ``resolve_rotary_dim`` / ``original_length`` / ``check_seq_len`` check
each value, naming the key. ``jaxpe.ops.rope_scaling.rope_frequencies`` computes the frequencies
from the checked values. Key sets: transformers 5.24 ``modeling_rope_utils`` (``RopeParameters``,
``_validate_<type>_rope_parameters``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks

ROPE_TYPES: tuple[str, ...] = (
  "default",
  "linear",
  "dynamic",
  "ntk",
  "yarn",
  "longrope",
  "llama3",
  "proportional",
)

# Keys each type reads (besides rope_type/type, rope_theta, partial_rotary_factor).
_REQUIRED: dict[str, tuple[str, ...]] = {
  "default": (),
  "linear": ("factor",),
  "dynamic": ("factor",),
  "ntk": ("factor",),
  "yarn": ("factor",),  # and original_max_position_embeddings (or max_position_embeddings)
  "longrope": ("short_factor", "long_factor"),
  "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
  "proportional": (),
}
# Every key HF's RopeParameters knows, plus max_position_embeddings; other keys are typos.
_KNOWN_KEYS = frozenset(
  {
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "original_max_position_embeddings",
    "max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "short_factor",
    "long_factor",
    "low_freq_factor",
    "high_freq_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "mrope_section",
  }
)

# Keys transformers defines for one family's rotary module only (its config declares them):
# rope_from_hf_config reads them from those families' configs, rope_frequencies refuses them.
_FAMILY_KEYS: dict[str, str] = {
  "mrope_interleaved": "the interleaved-mRoPE flag of Qwen3-VL / Qwen3.5 / Qwen3-Omni configs",
  "interleaved": "the interleaved-mRoPE flag of Qwen3-Omni configs",
  "short_mscale": "PhiMoE's longrope cos/sin scale up to the original length",
  "long_mscale": "PhiMoE's longrope cos/sin scale past the original length",
  "alpha": "HunYuan's NTK alpha (its 'dynamic' type with a static base)",
}

# Keys each type accepts: transformers 5.24's `_validate_<type>_rope_parameters` required and optional
# keys (it warns about any other key), plus the keys every type takes (rope_type/type, rope_theta,
# partial_rotary_factor, jaxpe's max_position_embeddings, and `mrope_section`, which multi-axis models
# such as Qwen2-VL / HunYuan-VL add to any type and transformers' configs exclude from the check) and
# jaxpe's extensions: `factor` for proportional (transformers' compute function reads it), the
# pretraining length for dynamic. A key of another type is refused: it would be silently ignored.
_COMMON_KEYS = frozenset(
  {"rope_type", "type", "rope_theta", "partial_rotary_factor", "max_position_embeddings", "mrope_section"}
)
_TYPE_KEYS: dict[str, frozenset[str]] = {
  "default": _COMMON_KEYS,
  "linear": _COMMON_KEYS | {"factor"},
  "dynamic": _COMMON_KEYS | {"factor", "original_max_position_embeddings"},
  "ntk": _COMMON_KEYS | {"factor"},
  "yarn": _COMMON_KEYS
  | {
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
  },
  "longrope": _COMMON_KEYS
  | {"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor"},
  "llama3": _COMMON_KEYS
  | {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
  "proportional": _COMMON_KEYS | {"factor"},
}

# Legacy spellings transformers still reads (Phi3Config maps "su" to longrope; "su" has no other meaning).
_TYPE_ALIASES: dict[str, str] = {"su": "longrope"}


def normalize_rope_parameters(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
  """The canonical form of one HF ``rope_scaling`` / ``rope_parameters`` dict.

  The one place jaxpe reads the key spellings: ``"type"`` (transformers v4) becomes ``"rope_type"``
  (both may be present if they agree), the legacy type ``"su"`` becomes ``"longrope"`` (early
  Phi-3-128k configs), a missing type is ``"default"``, lists stay lists. Values are checked later
  by ``rope_frequencies``; this only settles the spelling, so
  ``normalize_rope_parameters(normalize_rope_parameters(d)) == normalize_rope_parameters(d)``.

  Args:
    rope_scaling: a mapping with HF's keys (``rope_type``/``type``, ``rope_theta``,
      ``partial_rotary_factor``, ``factor``, ``original_max_position_embeddings``,
      ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
      ``truncate``, ``short_factor``, ``long_factor``, ``low_freq_factor``, ``high_freq_factor``,
      ``mrope_section``) plus jaxpe's ``max_position_embeddings``; None means ``{}``.

  Returns:
    A new dict with ``"rope_type"`` in ``ROPE_TYPES`` and no ``"type"``.

  Raises:
    ValueError: an unknown key (named, with the known ones; a key transformers defines for one
      family's rotary module, such as ``mrope_interleaved``, named with its family); ``type`` and ``rope_type`` that
      differ; an unknown type or one that is not a string (named, with ``ROPE_TYPES``).
    TypeError (also a ValueError): not a mapping.

  Source: transformers 5.24 ``RotaryEmbeddingConfigMixin.standardize_rope_params`` (``type`` ->
  ``rope_type``) and ``Phi3Config.convert_rope_params_to_dict`` (``"su"`` -> ``"longrope"``).
  """
  if rope_scaling is None:
    rope_scaling = {}
  if not isinstance(rope_scaling, Mapping):
    raise _checks.ArgTypeError(
      f"rope_scaling must be a mapping (dict) or None, got {type(rope_scaling).__name__}"
    )
  params = dict(rope_scaling)
  unknown = sorted(set(params) - _KNOWN_KEYS, key=str)
  family_keys = [k for k in unknown if k in _FAMILY_KEYS]
  if family_keys:
    key = family_keys[0]
    raise ValueError(
      f"rope_scaling key {key!r} is {_FAMILY_KEYS[key]}: only those model types' rotary modules read it. "
      "rope_from_hf_config reads it from such a config (with its model_type); rope_frequencies and other "
      "model types do not"
    )
  if unknown:
    raise ValueError(f"rope_scaling has unknown keys {unknown}; known keys: {sorted(_KNOWN_KEYS)}")
  kind = params.pop("type", None)
  rope_type = params.get("rope_type")

  def canonical(name):
    return _TYPE_ALIASES.get(name, name) if isinstance(name, str) else name

  if kind is not None and rope_type is not None and canonical(kind) != canonical(rope_type):
    raise ValueError(f"rope_scaling['type'] ({kind!r}) and rope_scaling['rope_type'] ({rope_type!r}) differ")
  rope_type = rope_type if rope_type is not None else (kind if kind is not None else "default")
  if isinstance(rope_type, str):
    rope_type = _TYPE_ALIASES.get(rope_type, rope_type)
  if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
    raise ValueError(
      f"rope_scaling['rope_type'] must be one of {ROPE_TYPES} (or the legacy {sorted(_TYPE_ALIASES)}), "
      f"got {rope_type!r}"
    )
  params["rope_type"] = rope_type
  return params


def check_type_keys(params: Mapping[str, Any]) -> None:
  """ValueError when the normalised ``params`` miss a key their type requires (None counts as
  missing) or hold a key the type does not read (it would be silently ignored)."""
  rope_type = params["rope_type"]
  missing = [key for key in _REQUIRED[rope_type] if params.get(key) is None]
  if missing:
    raise ValueError(f"rope_scaling for rope_type={rope_type!r} is missing required keys {missing}")
  foreign = sorted(set(params) - _TYPE_KEYS[rope_type])
  if foreign:
    raise ValueError(
      f"rope_scaling keys {foreign} are not used by rope_type={rope_type!r} (it reads "
      f"{sorted(_TYPE_KEYS[rope_type] - {'type'})})"
    )


def read_base(params: Mapping[str, Any], rope_theta: Any) -> float:
  """The base: the dict's ``rope_theta`` (a number, not a string or bool, as every other key of the
  dict), else the ``rope_theta`` argument; finite and > 0."""
  base = params.get("rope_theta")
  if base is None:
    return _checks.check_positive_float("rope_theta", rope_theta)
  return param_float("rope_theta", base, minimum=0.0, strict=True)


def read_max_positions(params: Mapping[str, Any], max_position_embeddings: Any) -> int | None:
  """``max_position_embeddings`` from the argument or the dict (they must agree), a positive int or
  None."""
  if max_position_embeddings is not None:
    max_position_embeddings = _checks.check_positive_int("max_position_embeddings", max_position_embeddings)
  if params.get("max_position_embeddings") is not None:
    dict_max = param_int("max_position_embeddings", params["max_position_embeddings"])
    if max_position_embeddings is not None and dict_max != max_position_embeddings:
      raise ValueError(
        f"rope_scaling['max_position_embeddings'] ({dict_max}) disagrees with max_position_embeddings "
        f"({max_position_embeddings})"
      )
    max_position_embeddings = dict_max
  return max_position_embeddings


def param_float(name: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
  """``rope_scaling[name]`` as a finite float, ``>= minimum`` (``> minimum`` when ``strict``).

  ArgTypeError (a TypeError and a ValueError) for a non-number (strings, bools), ValueError
  otherwise; both name the key."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise _checks.ArgTypeError(f"rope_scaling[{name!r}] must be a number, got {value!r}")
  v = float(value)
  if not math.isfinite(v):
    raise ValueError(f"rope_scaling[{name!r}] must be finite, got {value!r}")
  if minimum is not None and (v <= minimum if strict else v < minimum):
    op = ">" if strict else ">="
    raise ValueError(f"rope_scaling[{name!r}] must be {op} {minimum}, got {value!r}")
  return v


# Types whose formula is defined for a factor below 1 (compression: positions closer together).
_BELOW_ONE_TYPES = ("linear", "yarn", "proportional")


def param_factor(value: Any, rope_type: str) -> float:
  """``factor`` > 0; below 1 only for ``_BELOW_ONE_TYPES`` (ValueError naming the type otherwise)."""
  factor = param_float("factor", value, minimum=0.0, strict=True)
  if factor < 1 and rope_type not in _BELOW_ONE_TYPES:
    raise ValueError(
      f"rope_scaling['factor'] must be >= 1 for rope_type={rope_type!r}, got {value!r} (a factor below 1 "
      f"is defined only for {_BELOW_ONE_TYPES})"
    )
  return factor


def param_int(name: str, value: Any) -> int:
  """``rope_scaling[name]`` as a positive int (ArgTypeError for another type, ValueError if <= 0)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise _checks.ArgTypeError(f"rope_scaling[{name!r}] must be a positive integer, got {value!r}")
  if value <= 0:
    raise ValueError(f"rope_scaling[{name!r}] must be a positive integer, got {value!r}")
  return int(value)


def resolve_rotary_dim(params: Mapping[str, Any], head_dim: int, rotary_dim: int | None) -> int:
  """R: ``rotary_dim``, else ``int(head_dim * partial_rotary_factor)`` (HF), else ``head_dim``; the two
  must agree when both are given. ValueError unless even, > 0 and <= ``head_dim``."""
  head_dim = _checks.check_positive_int("head_dim", head_dim, maximum=_checks.MAX_DIM)
  from_factor = None
  if params.get("partial_rotary_factor") is not None:
    prf = param_float("partial_rotary_factor", params["partial_rotary_factor"], minimum=0.0, strict=True)
    if prf > 1:
      raise ValueError(f"rope_scaling['partial_rotary_factor'] must be in (0, 1], got {prf}")
    from_factor = int(head_dim * prf)  # HF: int(head_dim * partial_rotary_factor)
  if rotary_dim is not None:
    rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
    if from_factor is not None and from_factor != rotary_dim:
      raise ValueError(
        f"rotary_dim={rotary_dim} disagrees with rope_scaling['partial_rotary_factor'] "
        f"({params['partial_rotary_factor']} * head_dim {head_dim} = {from_factor})"
      )
  else:
    rotary_dim = head_dim if from_factor is None else from_factor
  if rotary_dim <= 0 or rotary_dim % 2:
    raise ValueError(f"rotary_dim must be a positive even integer, got {rotary_dim}")
  if rotary_dim > head_dim:
    raise ValueError(f"rotary_dim must be <= head_dim = {head_dim}, got {rotary_dim}")
  return rotary_dim


def original_length(params: Mapping[str, Any], max_position_embeddings: int | None, rope_type: str) -> int:
  """The pretraining length: ``original_max_position_embeddings``, else ``max_position_embeddings``
  (HF's default); ValueError naming the key when neither is given."""
  value = params.get("original_max_position_embeddings")
  if value is None:
    value = max_position_embeddings  # HF's standardize_rope_params default
  if value is None:
    raise ValueError(
      f"rope_scaling for rope_type={rope_type!r} needs 'original_max_position_embeddings' "
      "(or the max_position_embeddings argument)"
    )
  return param_int("original_max_position_embeddings", value)


def check_original_not_above_max(original: int, max_position_embeddings: int | None, rope_type: str) -> None:
  """llama3 (transformers warns) and longrope's implicit factor: the pretraining length <= the context."""
  if max_position_embeddings is not None and original > max_position_embeddings:
    raise ValueError(
      f"rope_scaling['original_max_position_embeddings'] ({original}) must be <= max_position_embeddings "
      f"({max_position_embeddings}) for rope_type={rope_type!r}: the pretraining length cannot exceed the "
      "context the scaling extends to"
    )


def check_seq_len(seq_len):
  """``seq_len``: None, a non-negative Python/numpy int (returned as int) or a scalar integer array
  (a traced one is returned as is). ArgTypeError for another type, ValueError if negative."""
  if seq_len is None:
    return None
  if isinstance(seq_len, (jax.Array, np.ndarray)):
    if not jnp.issubdtype(seq_len.dtype, jnp.integer):
      raise _checks.ArgTypeError(f"seq_len must be a scalar integer (tokens), got dtype {seq_len.dtype}")
    if jnp.ndim(seq_len) != 0:
      raise ValueError(f"seq_len must be a scalar integer, got shape {jnp.shape(seq_len)} {seq_len.dtype}")
    if isinstance(seq_len, jax.core.Tracer):
      return seq_len
    seq_len = int(seq_len)
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)):
    raise _checks.ArgTypeError(f"seq_len must be a non-negative integer (tokens), got {seq_len!r}")
  if seq_len < 0:
    raise ValueError(f"seq_len must be a non-negative integer (tokens), got {seq_len!r}")
  return int(seq_len)
