"""Logical axis names for parameters and activations, and their placement on a mesh.

The decoder names the dimensions of its parameters (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``pos``, ``layers``) and pins activations at block boundaries to
``(batch, length, embed)`` with ``constrain``; logical rules (``LogicalRules``) map those names onto
the mesh axes. Building the mesh and placing state on it is the trainer's (``jaxpe.train.sharding``).

Context parallelism: when the rules split ``length`` (default: over the ``context`` mesh axis),
``sequence_split`` names the mesh axes, the decoder's attention runs across them
(``jaxpe.attention.context``), and ``zigzag_inputs`` puts a batch in the load-balanced order with
its positions and original slots travelling along.

Source: the logical-axis scheme of Flax's ``nn.partitioning`` / MaxText (``logical_axis_rules``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpe.attention import context, numerics
from jaxpe.model.config import MESH_AXES, LogicalRules
from jaxpe.ops import positions as positions_lib

DEFAULT_RULES: tuple[tuple[str, Any], ...] = LogicalRules().as_tuple()
"""The default logical rules as ``((name, mesh axes or None), ...)``: batch over ``(data, fsdp)``,
embed over ``fsdp``, heads / kv_heads / mlp / vocab over ``tensor``, the rest replicated."""

ACTIVATION = ("batch", "length", "embed")
"""Logical names of the residual stream ``[B, T, D]`` at block boundaries."""


def _rules(rules) -> tuple[tuple[str, Any], ...]:
  return rules.as_tuple() if isinstance(rules, LogicalRules) else tuple(rules)


def rule_axes(axes) -> tuple[str, ...]:
  """A logical rule's mesh axes as a tuple: None -> (), "data" -> ("data",), a sequence as is."""
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


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
    axes = rule_axes(table.get(name) if name is not None else None)
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


def sequence_split() -> tuple[jax.sharding.Mesh, tuple[str, ...]] | None:
  """``(mesh, axes)``: the mesh axes the sequence T of activations is split over (the ``length``
  entry of ``ACTIVATION``'s spec under the innermost ``activation_sharding``), or None outside one
  and when those axes multiply to 1 device (no context parallelism)."""
  active = getattr(_ACTIVATIONS, "value", None)
  if active is None:
    return None
  mesh, rules = active
  entry = logical_to_spec(ACTIVATION, rules)[1]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  if math.prod(mesh.shape[a] for a in axes) <= 1:
    return None
  return mesh, axes


def batch_split() -> tuple[jax.sharding.Mesh, tuple[str, ...]] | None:
  """``(mesh, axes)``: the mesh axes the batch B of activations is split over (the ``batch`` entry
  of ``ACTIVATION``'s spec under the innermost ``activation_sharding``), or None outside one and
  when those axes multiply to 1 device."""
  active = getattr(_ACTIVATIONS, "value", None)
  if active is None:
    return None
  mesh, rules = active
  axes = rule_axes(logical_to_spec(ACTIVATION, rules)[0])
  if math.prod(mesh.shape[a] for a in axes) <= 1:
    return None
  return mesh, axes


def batch_local(fn, batched: Sequence[Any], replicated: Sequence[Any] = ()):
  """``fn(*batched, *replicated)`` computed on each device's own batch rows.

  Under an ``activation_sharding`` whose batch is split (``batch_split``): a ``jax.shard_map`` over
  the batch's mesh axes, every leaf of ``batched`` split along its leading dim B, ``replicated``
  whole on every device, the result (leading dim B) split the same way. Fused attention kernels
  need it: XLA cannot partition a Mosaic (TPU) kernel or, on an abstract mesh, cuDNN's custom
  partitioning by itself. Outside such a context, or when B does not divide by the batch's
  devices, ``fn`` runs as it is (on TPU a Mosaic kernel then fails to partition: give a batch the
  mesh divides). Arguments that are None stay None.
  """
  split = batch_split()
  if split is None:
    return fn(*batched, *replicated)
  mesh, axes = split
  shards = math.prod(mesh.shape[a] for a in axes)
  first = next(x for x in batched if x is not None)
  if first.shape[0] % shards:  # rows that do not split evenly: the whole batch, XLA partitions it
    return fn(*batched, *replicated)
  entry = axes[0] if len(axes) == 1 else axes
  batched, replicated = list(batched), list(replicated)
  rows = [i for i, x in enumerate(batched) if x is not None]
  whole = [i for i, x in enumerate(replicated) if x is not None]

  def body(row_args, whole_args):
    b, r = list(batched), list(replicated)
    for i, x in zip(rows, row_args, strict=True):
      b[i] = x
    for i, x in zip(whole, whole_args, strict=True):
      r[i] = x
    return fn(*b, *r)

  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P(entry), P()),  # prefixes: dim 0 of every row argument split, the rest whole
    out_specs=P(entry),
    check_vma=False,
  )(tuple(batched[i] for i in rows), tuple(replicated[i] for i in whole))


def sequence_split_size(mesh_shape: Sequence[int], rules=DEFAULT_RULES) -> int:
  """Devices the sequence would be split over on a mesh of ``mesh_shape`` sizes (``MESH_AXES``
  order, before it is built): the product of the sizes of the ``length`` entry of ``ACTIVATION``'s
  spec under ``rules``; 1 when a ``-1`` is among them (known only once the devices are)."""
  entry = logical_to_spec(ACTIVATION, rules)[1]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  sizes = [mesh_shape[MESH_AXES.index(a)] for a in axes]
  return 1 if -1 in sizes else math.prod(sizes)


def sequence_shards() -> int:
  """The number of devices the sequence is split over (``sequence_split``); 1 when it is not."""
  split = sequence_split()
  return 1 if split is None else math.prod(split[0].shape[a] for a in split[1])


def zigzag_inputs(
  tokens: jax.Array,
  shards: int,
  *,
  positions: jax.Array | None = None,
  attention_mask: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """The ``Decoder`` keyword arguments that run ``tokens`` in the zig-zag order of ``shards``
  context shards (``jaxpe.attention.context.zigzag_order``): every per-token array moves with its
  token, and ``slot_index`` carries each token's original slot for the causal mask.

  Positions not given are derived first, in slot order, as the decoder derives them (restarting at
  each document of ``segment_ids``, else counting the real tokens of ``attention_mask``, else
  ``0..T-1``), then reordered: a token keeps its position (RoPE, xPos, ALiBi, the rope_alibi
  emulation, learned and sinusoidal embeddings all read it), wherever it is computed. The logits
  come back in the same order: reorder the targets (and loss weights) with
  ``jaxpe.attention.context.to_zigzag`` (a mean over tokens is order-free), or restore the order
  with ``from_zigzag``.

  Args:
    tokens: ``[B, T]`` integer token ids in slot order, T divisible by 2 x ``shards``.
    shards: C, the devices the sequence is split over (``sequence_shards()`` under a mesh).
    positions, attention_mask, segment_ids: optional ``[B, T]`` arrays in slot order, as
      ``Decoder.__call__`` takes them.

  Returns:
    ``{"tokens", "positions", "slot_index"}`` (int32 positions and slots ``[B, T]``) plus
    ``attention_mask`` / ``segment_ids`` when given, all ``[B, T]`` in zig-zag order.

  Raises:
    ValueError: T not divisible by 2 x ``shards`` (``zigzag_order``).
  """
  batch, length = tokens.shape
  if positions is None:
    if segment_ids is not None:
      positions = positions_lib.positions_from_segment_ids(segment_ids)
    elif attention_mask is not None:
      positions = positions_lib.positions_from_mask(attention_mask)
    else:
      positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  out = {"tokens": tokens, "positions": jnp.asarray(positions).astype(jnp.int32), "slot_index": slots}
  if attention_mask is not None:
    out["attention_mask"] = attention_mask
  if segment_ids is not None:  # ids int32 cannot hold (int64 0 and 2^32): ranked, never cast
    out["segment_ids"] = numerics.canonical_ids(segment_ids)
  return {name: context.to_zigzag(jnp.asarray(x), shards) for name, x in out.items()}
