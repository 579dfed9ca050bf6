"""Logical axis names for parameters and activations, and their placement on a mesh.

The decoder names the dimensions of its parameters (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``pos``, ``layers``) and pins activations at block boundaries to
``(batch, length, embed)`` with ``constrain``; logical rules (``LogicalRules``) map those names onto
the mesh axes. Building the mesh and placing state on it is the trainer's (``jaxpe.train.sharding``).

Source: the logical-axis scheme of Flax's ``nn.partitioning`` / MaxText (``logical_axis_rules``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpe.model.config import LogicalRules

DEFAULT_RULES: tuple[tuple[str, Any], ...] = LogicalRules().as_tuple()
"""The default logical rules as ``((name, mesh axes or None), ...)``: batch over ``(data, fsdp)``,
embed over ``fsdp``, heads / kv_heads / mlp / vocab over ``tensor``, the rest replicated."""

ACTIVATION = ("batch", "length", "embed")
"""Logical names of the residual stream ``[B, T, D]`` at block boundaries."""


def _rules(rules) -> tuple[tuple[str, Any], ...]:
  return rules.as_tuple() if isinstance(rules, LogicalRules) else tuple(rules)


def logical_to_spec(names: Sequence[str | None], rules=DEFAULT_RULES) -> P:
  """``PartitionSpec`` for an array whose dimensions have the logical ``names`` (None = no name).

  Each name is looked up in ``rules`` (``LogicalRules`` or ``((name, axes), ...)``); a mesh axis
  already used by an earlier dimension of the same array is dropped (that dimension is then split
  over the remaining axes, or replicated). Unknown names are replicated.
  """
  table = dict(_rules(rules))
  used: set[str] = set()
  spec = []
  for name in names:
    axes = table.get(name) if name is not None else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    free = tuple(a for a in axes if a not in used)
    used.update(free)
    spec.append(None if not free else free[0] if len(free) == 1 else free)
  return P(*spec)


_ACTIVATIONS = threading.local()


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh, rules=DEFAULT_RULES) -> Iterator[None]:
  """While tracing inside this context, ``constrain`` pins activations to ``mesh`` by ``rules``;
  outside it ``constrain`` does nothing (single-device use, generation)."""
  old = getattr(_ACTIVATIONS, "value", None)
  _ACTIVATIONS.value = (mesh, _rules(rules))
  try:
    yield
  finally:
    _ACTIVATIONS.value = old


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``jax.lax.with_sharding_constraint`` of ``x`` to the logical ``names`` (one per dimension)
  under the innermost ``activation_sharding`` context; ``x`` unchanged outside one."""
  active = getattr(_ACTIVATIONS, "value", None)
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules)))
