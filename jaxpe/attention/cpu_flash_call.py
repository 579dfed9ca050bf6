"""The CPU attention kernel's two XLA calls (``jax.ffi.ffi_call``) as sharded, batchable ops.

``batchable(kind, attrs, layout)`` is the forward or backward call for fixed static arguments:
a ``custom_partitioning`` op (each device computes its own batch rows and whole kv groups of heads;
the sequence, the head dims and a split inside a kv group are gathered first) under
``custom_batching.custom_vmap`` (a mapped axis is folded into the batch). The differentiation and
the argument checks are ``jaxpe.attention.cpu_flash``'s.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, G = N / K, Hq q/k
head dim, H v head dim.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning

FORWARD, BACKWARD = "jaxpe_cpu_flash_forward", "jaxpe_cpu_flash_backward"
"""The FFI target names the kernel's handlers are registered under."""

# Factors of the operands (custom_partitioning's einsum-like rules; the query heads n are the
# compound factor (kh g)): the batch and the kv heads follow q's sharding; the sequence, the head
# dims and the query heads within a kv head (g: split, each device would hold a partial sum of dk
# and dv) are gathered (need replication).
_Q, _K, _V, _O, _L = "b t n hq", "b s kh hq", "b s kh d", "b t n d", "b t n"  # n = (kh g)
_SIDE = ("b t", "b s", "b t", "b s", "b s", "n")


def layout(q, k, side) -> tuple[tuple[bool, ...], int, int]:
  """The static layout of a call: which side arrays are present (absent ones are passed as shape
  ``(0,)``), G (query heads per kv head) and K."""
  return tuple(x.shape != (0,) for x in side), q.shape[2] // k.shape[2], k.shape[2]


def _rule(operands, results, layout, mesh) -> tuple[str, dict]:
  """The sharding rule of a call: ``custom_partitioning``'s string and keyword arguments.

  The query heads n are ``(kh g)`` (``kh`` alone when G = 1, ``g`` alone when K = 1); absent side
  arrays get factors of their own. Replicated: the sequence, the head dims and ``g`` (split, each
  device would hold a partial sum of dk and dv). ``partition`` has the last word: it keeps a split
  of the batch or the kv heads only over whole mesh axes (``_dim_axes``)."""
  del mesh
  present, group, num_kv = layout
  heads = "kh" if group == 1 else "g" if num_kv == 1 else "(kh g)"
  side = [rule if there else f"e{i}" for i, (rule, there) in enumerate(zip(_SIDE, present))]
  text = f"{', '.join([*operands[:3], *side, *operands[3:]])} -> {', '.join(results)}"
  text = re.sub(r"\bn\b", heads, text)
  order = list(dict.fromkeys(re.findall(r"[a-z]\w*", text)))  # first appearance (sdy wants it sorted)
  replicated = {"t", "s", "hq", "d", "g"}
  kwargs = {"need_replication_factors": tuple(f for f in order if f in replicated)}
  if heads == "(kh g)":
    kwargs["g"] = group  # a factor only inside a compound one needs its size
  return text, kwargs


def _dim_axes(sharding, shape, dim: int, mesh, whole: int | None = None):
  """The mesh axes (a tuple, or None) that split dim ``dim`` of an array of ``shape`` under
  ``sharding`` exactly as ``PartitionSpec`` would, in any order; None where the dim is whole, or no
  set of whole mesh axes splits it so (a split into sub-axes: the dim is then gathered).
  ``whole``: the count of parts must also divide it."""
  try:
    want = {d: idx[dim] for d, idx in sharding.devices_indices_map(tuple(shape)).items()}
  except Exception:  # noqa: BLE001  shardings jax cannot map to devices here: gather
    return None
  if len({(s.start, s.stop) for s in want.values()}) == 1:
    return None  # not split (size-1 axes match it too, and would repeat in a spec)
  names = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  for size in range(1, len(names) + 1):
    for combo in itertools.permutations(names, size):
      count = int(np.prod([mesh.shape[a] for a in combo]))
      if shape[dim] % count or (whole is not None and whole % count):
        continue
      spec = [None] * len(shape)
      spec[dim] = combo
      got = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)).devices_indices_map(
        tuple(shape)
      )
      if all(got[d][dim] == want[d] for d in want):
        return combo
  return None


def _factors(operands: tuple[str, ...], present: tuple[bool, ...]) -> list[list[str]]:
  side = [rule if there else "e" for rule, there in zip(_SIDE, present)]
  return [f.split() for f in (*operands[:3], *side, *operands[3:])]


def _partitioned(body, operands, results, n_after: int):
  """``body`` (an FFI call on whole or per-device arrays) as a ``custom_partitioning`` op that keeps
  each operand's and result's batch and head sharding and lowers ``body`` on the shards. Its last
  four arguments are static: scale, the mask tuple ``(causal, window left, window right, chunk,
  soft cap)`` (``_mask_attrs``), precise_dims and the layout (``layout``)."""
  first = 9 + n_after
  op = custom_partitioning(body, static_argnums=tuple(range(first, first + 4)))

  def partition(scale, causal, precise, layout, mesh, arg_shapes, result_shape):
    # the shardings the kernel needs (the partitioner reshards to them), whatever was propagated:
    # only the batch and the heads stay split, the heads in whole kv groups
    q, k = arg_shapes[0], arg_shapes[1]
    axes = {"b": _dim_axes(q.sharding, q.shape, 0, mesh)}
    axes["kh"] = _dim_axes(q.sharding, q.shape, 2, mesh, whole=k.shape[2])
    if axes["kh"] is not None and axes["b"] is not None and set(axes["kh"]) & set(axes["b"]):
      axes["kh"] = None
    axes["n"] = axes["kh"]  # N / count heads per device: whole groups of G

    def sharding(factors):
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(axes.get(f) for f in factors)))

    arg_shardings = tuple(sharding(f) for f in _factors(operands, layout[0]))
    result_shardings = tuple(sharding(f.split()) for f in results)
    on_shards = lambda *args: body(*args, scale, causal, precise, layout)  # noqa: E731
    return mesh, on_shards, result_shardings, arg_shardings

  def rule(scale, causal, precise, layout, mesh, value_types, result_types):
    del scale, causal, precise, value_types, result_types
    return _rule(operands, results, layout, mesh)

  # decode_shardings=False: the proposed shardings arrive as they are (jax cannot name a split of
  # a mesh axis into sub-axes, which the propagation may propose); _dim_axes reads what it needs
  op.def_partition(partition=partition, sharding_rule=rule, decode_shardings=False)
  return op


def _mask_attrs(mask) -> dict:
  """The kernel's mask attributes from ``(causal, left, right, chunk, cap)`` (``cpu_flash``'s static
  mask tuple: window sides < 0 unbounded, chunk 0 none, cap 0 none)."""
  causal, left, right, chunk, cap = mask
  return dict(
    causal=bool(causal),
    window_left=np.int64(left),
    window_right=np.int64(right),
    chunk_size=np.int64(chunk),
    soft_cap=np.float32(cap),
  )


def _forward_body(q, k, v, qpos, kpos, qseg, kseg, valid, slopes, scale, causal, precise, layout):
  del layout  # the sharding rule's
  b, t, n, _ = q.shape
  types = (
    jax.ShapeDtypeStruct((b, t, n, v.shape[-1]), jnp.float32),
    jax.ShapeDtypeStruct((b, t, n), jnp.float32),
  )
  return jax.ffi.ffi_call(FORWARD, types, vmap_method="sequential")(
    q, k, v, qpos, kpos, qseg, kseg, valid, slopes,
    scale=np.float32(scale), precise_dims=np.int64(precise), **_mask_attrs(causal),
  )  # fmt: skip


def _backward_body(
  q, k, v, qpos, kpos, qseg, kseg, valid, slopes, out, lse, d_out, d_lse, scale, causal, precise, layout
):
  del layout
  types = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
  return jax.ffi.ffi_call(BACKWARD, types, vmap_method="sequential")(
    q, k, v, qpos, kpos, qseg, kseg, valid, slopes, out, lse, d_out, d_lse,
    scale=np.float32(scale), precise_dims=np.int64(precise), **_mask_attrs(causal),
  )  # fmt: skip


def _inside_manual_axes() -> bool:
  """Whether this is traced inside a ``shard_map`` (some mesh axes manual), where
  ``custom_partitioning`` cannot map shardings to devices."""
  mesh = jax.sharding.get_abstract_mesh()
  return bool(getattr(mesh, "manual_axes", ()))


@functools.cache
def batchable(kind: str, attrs: tuple, layout: tuple):
  """The forward or backward op for fixed static arguments, under ``jax.vmap`` too: a mapped axis
  is folded into the batch axis B (every operand but the slopes and the absent side arrays has B
  first; unmapped ones are broadcast), and split off the results again."""
  op = _forward_op if kind == "forward" else _backward_op

  @jax.custom_batching.custom_vmap
  def call(*args):
    if _inside_manual_axes():  # in a shard_map: the per-shard call (auto axes are gathered for it)
      body = _forward_body if kind == "forward" else _backward_body
      return body(*args, *attrs, layout)
    return op(*args, *attrs, layout)

  @call.def_vmap
  def call_vmap(axis_size, in_batched, *args):
    rows = args[0].shape[1] if in_batched[0] else args[0].shape[0]  # q's B within one mapped item
    merged = []
    for i, (arg, batched) in enumerate(zip(args, in_batched)):
      per_row = i < 3 or i > 8 or (i < 8 and layout[0][i - 3])  # q, k, v, side [B, ...], out/lse/cotangents
      if not per_row:
        if batched:
          raise NotImplementedError("the CPU attention kernel's ALiBi slopes cannot be mapped by jax.vmap")
        merged.append(arg)
        continue
      arg = arg if batched else jnp.broadcast_to(arg, (axis_size, *arg.shape))
      merged.append(arg.reshape(axis_size * arg.shape[1], *arg.shape[2:]))
    outs = call(*merged)
    # rows, not -1: a mapped axis of size 0 (or B = 0) leaves nothing to infer -1 from
    return tuple(o.reshape(axis_size, rows, *o.shape[1:]) for o in outs), (True,) * len(outs)

  return call


_forward_op = _partitioned(_forward_body, (_Q, _K, _V), (_O, _L), 0)
_backward_op = _partitioned(_backward_body, (_Q, _K, _V, _O, _L, _O, _L), (_Q, _K, _V), 4)


__all__ = ["BACKWARD", "FORWARD", "batchable", "layout"]
