"""Device mesh, logical-axis rules, sharded model creation and multi-process batches.

The mesh has four named axes: ``data`` (data parallelism), ``fsdp`` (fully sharded data parallelism:
parameters and optimizer state split, the batch split too), ``tensor`` (tensor parallelism: heads, MLP and
vocab split) and ``context`` (context parallelism: the sequence of activations split, attention across the
shards by ``jaxpe.attention.context``). The decoder's parameters carry logical axis names (``vocab``,
``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``pos``, ``layers``); activations at block
boundaries are ``(batch, length, embed)``. Logical rules (``jaxpe.config.LogicalRules``) map logical names
onto mesh axes; within one array each mesh axis is used at most once (a later dimension whose mesh axis is
taken is replicated).

Source: the logical-axis scheme of Flax's ``nn.partitioning`` / MaxText (``logical_axis_rules``),
with FSDP as in ZeRO-3 (Rajbhandari et al., arXiv 1910.02054) and Megatron-style tensor
parallelism (Shoeybi et al., arXiv 1909.08053); context parallelism as in ring attention (Liu et
al., arXiv 2310.01889) and MaxText / Megatron-LM's load-balanced (zig-zag) causal split.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxpe.model.config import MESH_AXES, ModelConfig
from jaxpe.model.partitioning import (  # noqa: F401  (re-exported: the trainer's one sharding namespace)
  ACTIVATION,
  DEFAULT_RULES,
  _rules,
  activation_sharding,
  constrain,
  logical_to_spec,
  rule_axes,
  sequence_shards,
  sequence_split,
  zigzag_inputs,
)
from jaxpe.train.config import DistributedConfig


def mesh_dims(shape: Sequence[int], num_devices: int) -> tuple[int, int, int, int]:
  """Resolves a ``(data, fsdp, tensor, context)`` shape (one entry may be ``-1``) against ``num_devices``.

  A 3-tuple is ``(data, fsdp, tensor)`` with ``context`` 1 (the form before the context axis), a
  2-tuple the old ``(data, model)`` form, read as ``(data, 1, model, 1)``.

  Raises:
    ValueError: not 2, 3 or 4 entries, more than one ``-1``, a size < 1, or sizes whose product is
      not ``num_devices``.
  """
  shape = tuple(int(s) for s in shape)
  if len(shape) == 2:
    shape = (shape[0], 1, shape[1])
  if len(shape) == 3:
    shape = (*shape, 1)
  if len(shape) != 4 or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(
      f"mesh_shape must be (data, fsdp, tensor, context) sizes >= 1 with at most one -1, got {list(shape)}"
    )
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh_shape {list(shape)}: {num_devices} devices do not divide by {known}")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(
      f"mesh_shape {list(shape)} does not fit {num_devices} devices (data * fsdp * tensor * context must "
      f"equal {num_devices}; use -1 for one axis to take the rest)"
    )
  return shape  # type: ignore[return-value]


def make_mesh(
  shape: Sequence[int] = (-1, 1, 1, 1), devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
  """A ``(data, fsdp, tensor, context)`` mesh over ``devices`` (default: all devices of all processes).

  Axes are ``Auto`` (jax.make_mesh's default Explicit axes break NNX embedding lookups). With
  several processes, ``jax.make_mesh`` orders devices so that each process holds a contiguous
  block of the ``data`` x ``fsdp`` rows. ``context`` is the innermost axis (neighbouring devices:
  the ring of ``jaxpe.attention.context`` passes keys and values between them).

  Args:
    shape: ``(data, fsdp, tensor, context)`` sizes in devices, one may be ``-1``;
      ``(data, fsdp, tensor)`` reads as context 1, ``(data, model)`` as ``(data, 1, model, 1)``.
    devices: the devices to use (e.g. ``jax.devices()[:4]``); default all.

  Raises:
    ValueError: see ``mesh_dims``.
  """
  devices = list(jax.devices() if devices is None else devices)
  dims = mesh_dims(shape, len(devices))
  return jax.make_mesh(
    dims, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices
  )


def _names(x) -> tuple[str | None, ...]:
  if isinstance(x, nnx.Variable):
    return tuple(x.get_metadata().get("out_sharding") or ())
  return ()


def state_shardings(state, mesh: jax.sharding.Mesh, rules=DEFAULT_RULES):
  """``NamedSharding`` on ``mesh`` for every leaf of an NNX state (or abstract state), from the
  ``out_sharding`` logical names its Variables carry and ``rules`` (``logical_to_spec``).

  Leaves without names (optimizer step counts, RNG keys) are replicated. Returns a pytree like
  ``state``.
  """

  def one(x):
    spec = logical_to_spec(_names(x), rules)
    return x.replace(NamedSharding(mesh, spec)) if isinstance(x, nnx.Variable) else NamedSharding(mesh, spec)

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: jax.sharding.Mesh, rules=DEFAULT_RULES) -> NamedSharding:
  """Sharding for ``[B, ...]`` arrays (token batches ``[B, T + 1]``): B split as the ``batch``
  rule says (default ``data`` x ``fsdp``), the rest replicated. ``check_divisible`` checks B."""
  return NamedSharding(mesh, logical_to_spec(("batch",), rules))


def create_sharded(make: Callable[[], Any], mesh: jax.sharding.Mesh, rules=DEFAULT_RULES):
  """Builds ``make()`` (a function returning NNX objects) directly into their shardings.

  Shapes come from ``nnx.eval_shape``; the init is jitted with ``out_shardings`` so that no
  device holds an unsharded copy. Returns what ``make()`` returns, its arrays sharded on ``mesh``.
  """
  abstract = nnx.eval_shape(make)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.state(make())

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def param_bytes_per_device(state) -> dict[jax.Device, int]:
  """Bytes of the arrays of ``state`` (any pytree of ``jax.Array``) that each device holds."""
  out: dict[jax.Device, int] = {}
  for leaf in jax.tree.leaves(state):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def logical_sizes(cfg: ModelConfig, *, batch_size: int, seq_len: int) -> dict[str, int]:
  """The size of every logical axis for a model ``cfg``, a (micro-)batch of ``batch_size`` rows
  and ``seq_len`` tokens: batch B, length T, embed D, heads N, kv_heads K, head_dim H, mlp F,
  vocab V, pos max_len, layers L."""
  return {
    "batch": batch_size,
    "length": seq_len,
    "embed": cfg.d_model,
    "heads": cfg.num_heads,
    "kv_heads": cfg.kv_heads,
    "head_dim": cfg.head_size,
    "mlp": cfg.mlp_size,
    "vocab": cfg.vocab_size,
    "pos": cfg.max_len,
    "layers": cfg.num_layers,
  }


def check_divisible(
  cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_size: int, *, seq_len: int = 1, rules=DEFAULT_RULES
) -> None:
  """Checks that every sharded size divides by the product of the mesh axes its rule names:
  ``batch_size`` (B, per micro-batch) by ``data`` x ``fsdp`` by default, D by ``fsdp``, N, K, F
  and V by ``tensor``, and so on for the configured ``rules``. ``seq_len`` (T) split over C > 1
  devices (``length``, default ``context``) must divide by 2 C: the zig-zag order
  (``jaxpe.model.partitioning.zigzag_inputs``) cuts each sequence into 2 C chunks.

  Raises:
    ValueError: naming the size (``batch_size``, ``d_model``, ``num_heads``, ``seq_len``, ...), the
      mesh axes and their product.
  """
  config_names = {
    "batch": "batch_size / grad_accum_steps",
    "length": "seq_len",
    "embed": "d_model",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "mlp": "mlp_dim",
    "vocab": "vocab_size",
    "pos": "max_len",
    "layers": "num_layers",
  }
  sizes = logical_sizes(cfg, batch_size=batch_size, seq_len=seq_len)
  for name, axes in _rules(rules):
    if axes is None or name not in sizes:
      continue
    axes = rule_axes(axes)
    ways = math.prod(mesh.shape[a] for a in axes)
    if name == "length" and ways > 1 and sizes[name] % (2 * ways):
      raise ValueError(
        f"seq_len ({sizes[name]}) must be divisible by 2 x {ways} = {2 * ways}: the mesh axes {list(axes)} "
        f"(size {ways}) that logical_rules.length splits it over hold 2 zig-zag chunks each; change "
        "seq_len or mesh_shape"
      )
    if sizes[name] % ways:
      raise ValueError(
        f"{config_names[name]} ({sizes[name]}) must be divisible by the mesh axes {list(axes)} "
        f"(size {ways}) that logical_rules.{name} splits it over; change mesh_shape or logical_rules"
      )


def process_rows(sharding: NamedSharding, num_rows: int) -> slice:
  """The rows ``[start, stop)`` of a ``[num_rows, ...]`` array with ``sharding`` whose shards live
  on this process's devices (one contiguous block for meshes from ``make_mesh``).

  Raises:
    ValueError: this process's rows are not contiguous (a hand-made device order).
  """
  index_map = sharding.addressable_devices_indices_map((num_rows,))
  rows = set()
  for index in index_map.values():
    rows.update(range(num_rows)[index[0]])
  start, stop = min(rows), max(rows) + 1
  if len(rows) != stop - start:
    raise ValueError("this process's batch rows are not contiguous; build the mesh with make_mesh")
  return slice(start, stop)


def global_batch(
  make_rows: Callable[[slice], np.ndarray], sharding: NamedSharding, global_shape: tuple[int, ...]
) -> jax.Array:
  """A global ``[B, ...]`` array with ``sharding`` whose rows this process builds itself.

  ``make_rows(rows)`` returns the rows ``rows`` of the global batch (this process's block,
  ``process_rows``); with one process that is the whole batch. Every process must describe the
  same global batch, so results do not depend on the process count.
  """
  rows = process_rows(sharding, global_shape[0])
  local = make_rows(rows)
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.make_array_from_process_local_data(sharding, local, global_shape)


def _distributed_settings(cfg: DistributedConfig) -> tuple[bool, str | None, int | None, int | None]:
  """``(enabled, address, num_processes, process_id)`` from ``cfg`` and the environment, refused
  when they cannot form a job (see ``initialize_distributed``)."""
  env = os.environ

  def from_env(value, name):
    if value is not None or env.get(name) in (None, ""):
      return value
    raw = env[name].strip()
    if not (raw.isascii() and raw.lstrip("-").isdigit()):  # int() also reads '٢', '1_0', '+2'
      raise ValueError(f"{name}={env[name]!r} is not an integer")
    return int(raw)

  address = cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
  num = from_env(cfg.num_processes, "JAX_NUM_PROCESSES")
  pid = from_env(cfg.process_id, "JAX_PROCESS_ID")
  enabled = cfg.enabled if cfg.enabled is not None else address is not None or (num or 1) > 1
  if cfg.enabled is False and ((num or 1) > 1 or address is not None):
    raise ValueError(
      f"distributed.enabled=false contradicts distributed.num_processes={num} / coordinator_address="
      f"{address!r}: drop those keys (and JAX_* variables) for a one-process run, or enable it"
    )
  if not enabled or cfg.enabled and address is None and num is None and pid is None:
    return enabled, address, num, pid  # one process, or JAX's cluster detection (enabled=true alone)
  missing = [
    name
    for name, value in (
      ("distributed.coordinator_address (host:port of process 0, or JAX_COORDINATOR_ADDRESS)", address),
      ("distributed.num_processes (or JAX_NUM_PROCESSES)", num),
      ("distributed.process_id (or JAX_PROCESS_ID)", pid),
    )
    if value is None
  ]
  if missing:
    raise ValueError(
      f"a multi-process run needs {' and '.join(missing)}; it has none, so it cannot form the job"
    )
  host, _, port = address.rpartition(":")
  if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
    raise ValueError(f"distributed.coordinator_address must be host:port (port 1-65535), got {address!r}")
  if num < 1 or not 0 <= pid < num:
    raise ValueError(
      f"distributed.process_id ({pid}) must be in 0..{num - 1} (distributed.num_processes={num})"
    )
  return enabled, address, num, pid


def multi_process(cfg: DistributedConfig) -> bool:
  """Whether ``cfg`` and the environment ask for a multi-process run (``initialize_distributed``
  would initialise); starts nothing. Raises ``ValueError`` as ``initialize_distributed``."""
  return _distributed_settings(cfg)[0]


def _check_coordinator_port(address: str) -> None:
  """Process 0 starts the coordinator service on ``address``'s port: refuse at once when something
  (another process 0 of this job, another program) already listens there."""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as probe:
    probe.setsockopt(
      socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
    )  # as the service does: TIME_WAIT is no conflict
    try:
      probe.bind(("" if host in ("localhost", "0.0.0.0") else host, int(port)))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise ValueError(
          f"distributed.coordinator_address {address!r}: port {port} is already in use (another process "
          "with distributed.process_id=0, or another program): give each process its own process_id in "
          "0..num_processes-1, or choose a free port"
        ) from None
      # Another host's address (EADDRNOTAVAIL) or a name: process 0 normally runs on it; JAX reports it.


def initialize_distributed(cfg: DistributedConfig) -> bool:
  """Starts JAX's multi-controller runtime (``jax.distributed.initialize``) when ``cfg`` asks for
  it; call before any other JAX use. Returns True when this process is part of a multi-process run.

  ``enabled=None`` initialises when a coordinator address (``cfg.coordinator_address`` or
  ``JAX_COORDINATOR_ADDRESS``) is set or ``num_processes`` > 1. Unset fields come from
  ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``; ``enabled=true`` with
  none of them is left to JAX's cluster detection. On the CPU backend the cross-process collectives
  are ``cfg.cpu_collectives`` (gloo by default). The processes must all join within
  ``cfg.initialization_timeout`` seconds, and a process whose peer stops answering fails after
  the same time.

  Raises:
    ValueError: settings that cannot form a job, before anything starts: a coordinator address,
      ``num_processes`` or ``process_id`` missing while another is set (``num_processes`` > 1
      without a coordinator would otherwise train alone), ``process_id`` outside
      ``0..num_processes-1``, an address that is not ``host:port``, ``enabled=false`` with
      multi-process keys, the coordinator's port already in use on process 0 (a second process
      0); a non-integer ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``.
    ConnectionError: JAX refused to initialise (its first line kept).

  When the processes do not all join within ``initialization_timeout`` seconds, the process prints
  one line (``<program>: error: process P of N could not form the job ...``) and exits with status
  2 (JAX itself would abort with a misleading "another task died").
  """
  enabled, address, num, pid = _distributed_settings(cfg)
  if not enabled:
    return jax.process_count() > 1
  if jax.distributed.is_initialized():
    return True
  if pid == 0 and address is not None:
    _check_coordinator_port(address)
  jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
  timeout = cfg.initialization_timeout
  message = (
    f"process {pid} of {num} could not form the job with the coordinator {address} within "
    f"distributed.initialization_timeout={timeout} s: start all {num} processes with the same "
    f"coordinator_address and num_processes and each its own process_id in 0..{(num or 1) - 1}"
  )
  # JAX aborts the process (a C++ fatal error blaming "another task") when registration times out;
  # this watchdog ends it first with one line naming what is missing.
  done = threading.Event()

  def watchdog():
    if not done.wait(timeout):
      print(f"{Path(sys.argv[0]).name or 'jaxpe'}: error: {message}", file=sys.stderr, flush=True)
      os._exit(2)

  threading.Thread(target=watchdog, name="jaxpe-distributed-watchdog", daemon=True).start()
  try:
    jax.distributed.initialize(
      coordinator_address=address,
      num_processes=num,
      process_id=pid,
      initialization_timeout=timeout + 30,  # the watchdog reports first
      heartbeat_timeout_seconds=max(timeout, 10),
      shutdown_timeout_seconds=max(timeout, 10),  # a refusal's shutdown barrier (run_guard.JobRefused)
    )
  except Exception as e:  # JAX's errors here are long gRPC reports
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    raise ConnectionError(f"{message} (JAX: {first[:200]})") from e
  finally:
    done.set()
  return True
