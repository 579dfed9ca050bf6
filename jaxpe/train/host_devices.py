"""One XLA device per CPU core for ``jaxpe-train`` on the CPU backend (``TrainConfig.cpu_devices``).

XLA:CPU runs a small operation on one thread: a block pair's batched matmuls in blockwise attention
(``[B, N, 64, 64] x [B, N, 64, 64]``: 42 GFLOP/s on one core, 48 on two, where PyTorch's ``bmm`` takes
103), the LayerNorms, GELU and loss fusions. A one-device train step therefore leaves the other cores
idle for much of its time. Split into one device per core, the default mesh's ``data`` axis gives each
core its share of the batch and every operation runs on all cores at once; the gradients are summed
across the devices in memory. On the 2-core CPU of issue 21 the train step took 0.81x (D 512, L 8,
B 8 x T 512) and 0.80x (D 128, L 4, B 32 x T 256) of its one-device time (record 20261202T071954Z).

The split must be made before JAX starts its CPU backend (``jax_num_cpu_devices``), so
``jaxpe.train.cli`` applies it first thing; ``jaxpe-study`` and ``trainer.train`` apply an explicit
count only (refused when JAX already started with another), so a library caller on ``auto`` keeps the
devices it has. Results differ from a one-device run's by float32 rounding (the batch's gradient is summed in
another order); a resumed run uses the same split, so kill -9 resumes stay bit-exact.
"""

from __future__ import annotations

import math
import os
import re
import types
from pathlib import Path

import jax

from jaxpe.model.config import MESH_AXES
from jaxpe.train import sharding
from jaxpe.train.config import TrainConfig

__all__ = ["apply", "auto_count", "check_fits", "cores"]

_FLAG = re.compile(r"--xla_force_host_platform_device_count")


_CGROUP = Path("/sys/fs/cgroup")


def _quota_cores() -> int | None:
  """The CPUs a cgroup CPU limit allows (``docker --cpus``, Kubernetes limits), rounded up: v2's
  ``cpu.max`` or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None without a limit."""
  try:
    if (_CGROUP / "cpu.max").is_file():
      quota, period = (_CGROUP / "cpu.max").read_text().split()[:2]
    else:
      quota = (_CGROUP / "cpu" / "cpu.cfs_quota_us").read_text().strip()
      period = (_CGROUP / "cpu" / "cpu.cfs_period_us").read_text().strip()
    if quota == "max" or int(quota) <= 0 or int(period) <= 0:
      return None
    return max(1, math.ceil(int(quota) / int(period)))
  except (OSError, ValueError):
    return None


def cores() -> int:
  """The CPU cores this process may run on: its affinity mask (``os.cpu_count()`` where there is
  none), capped by a cgroup CPU limit, under which the mask still lists every host core."""
  mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
  quota = _quota_cores()
  return mask if quota is None else min(mask, quota)


def auto_count(cfg: TrainConfig, num_cores: int) -> int:
  """The devices ``cpu_devices="auto"`` makes of ``num_cores`` cores: with a mesh of fixed sizes (no
  -1, e.g. ``[2, 1, 1, 4]``) its product, the devices it names; with a -1 on any axis the largest
  count <= the cores that the mesh and the micro-batch (``batch_size / grad_accum_steps`` rows) fit
  (the default mesh ``[-1, 1, 1, 1]``: the largest divisor of the micro-batch), or when no count up
  to the cores fits, the fewest devices the mesh's fixed sizes need (``[1, -1, 2]`` on one core: 2)."""
  shape = tuple(cfg.mesh_shape)
  fewest = math.prod(s for s in shape if s != -1)
  if -1 not in shape:
    return fewest
  fitting = [c for c in range(fewest, max(num_cores, fewest) + 1, fewest) if _mesh_error(cfg, c) is None]
  return max(fitting, default=fewest)


def _backend_started() -> bool:
  from jax._src import xla_bridge  # no public query; jax.devices() would start the backend

  return xla_bridge.backends_are_initialized()


def apply(cfg: TrainConfig, *, auto: bool = True) -> int | None:
  """Splits the host CPU into ``cfg.cpu_devices`` XLA devices (``"auto"``: ``auto_count`` of
  ``cores()``) before JAX's backend starts; returns the count set, or None when nothing was set.
  ``auto=False`` (``trainer.train``, ``jaxpe-study``): an explicit count only, ``"auto"`` sets nothing.

  ``"auto"`` sets nothing when the count is 1, when the environment already chose (``XLA_FLAGS`` with
  ``--xla_force_host_platform_device_count``, or ``JAX_NUM_CPU_DEVICES``), in a multi-process run
  (``cfg.distributed``: each process keeps one device per host as before), or when JAX's backend has
  started. An explicit int is set unless the backend started; it then must equal the CPU devices.
  Only the CPU backend's devices change: on a GPU or TPU host the mesh still uses the accelerators.

  Raises:
    ValueError: an explicit ``cpu_devices`` that JAX's already started CPU backend cannot have (it
      has another number of devices in this process), naming both counts; one the run's mesh or
      batch cannot use (single process), before JAX makes the devices.
  """
  wanted = cfg.cpu_devices
  if wanted == "auto":
    if not auto:
      return None
    env_chose = _FLAG.search(os.environ.get("XLA_FLAGS", "")) or os.environ.get("JAX_NUM_CPU_DEVICES")
    if env_chose or sharding.multi_process(cfg.distributed) or _backend_started():
      return None
    wanted = auto_count(cfg, cores())
    if wanted == 1:
      return None
  if _backend_started():
    have = len(jax.local_devices(backend="cpu"))  # this process's: jax.devices lists every process's
    if have != wanted:
      raise ValueError(
        f"cpu_devices={wanted} cannot apply: JAX's CPU backend already started with {have} devices "
        "(set it before any JAX use, or leave cpu_devices=auto)"
      )
    return None
  err = None if sharding.multi_process(cfg.distributed) else _mesh_error(cfg, wanted)
  if err is not None:  # before XLA makes the devices (cpu_devices=1000000 hung there)
    raise ValueError(
      f"cpu_devices={wanted} does not fit this run's mesh or batch ({err}); or cpu_devices=auto"
    )
  jax.config.update("jax_num_cpu_devices", wanted)
  return wanted


def _mesh_error(cfg: TrainConfig, num_devices: int) -> ValueError | None:
  """The mesh check's error for ``cfg`` on ``num_devices`` devices (``mesh_shape`` resolved against
  them, then every sharded size by its axes), or None when the run fits; builds no mesh."""
  try:
    dims = sharding.mesh_dims(cfg.mesh_shape, num_devices)
    mesh = types.SimpleNamespace(shape=dict(zip(MESH_AXES, dims, strict=True)))
    micro = cfg.batch_size // cfg.grad_accum_steps
    sharding.check_divisible(cfg.model, mesh, micro, seq_len=cfg.seq_len, rules=cfg.logical_rules)
  except ValueError as err:
    return err
  return None


def check_fits(cfg: TrainConfig, *, key: str = "cpu_devices") -> None:
  """Refuses, in one line naming ``cpu_devices``, an explicit count that the run's mesh or batch
  cannot use (``mesh_shape``, ``batch_size / grad_accum_steps``, ``logical_rules``), before the
  memory check or the trainer would report it as a mesh problem; the line lists the counts that fit
  (up to the cores, or the fixed mesh's size; per process in a multi-process run, whose mesh holds
  every process's devices). ``"auto"`` fits by construction when the CLI set the count; when the
  environment, a library caller or a multi-process run left another count, the line names
  ``cpu_devices`` and the counts that fit too. Nothing is checked when the devices are not CPUs.

  The count is named only when another count would fit: a mesh that fails on its fewest devices (the
  product of its fixed sizes, e.g. ``[1, 1, 3, 1]`` with 4 heads, or ``[3, 1, 1, 1]`` with a 16-row
  micro-batch) fails on every count, so the mesh check's own error is raised instead; so does a
  multi-process run no per-process count fits.

  ``key``: the name the message gives the setting (``jaxpe-study``: ``train.cpu_devices``).

  Raises:
    ValueError: the mesh does not fit the ``cpu_devices`` CPU devices, or an axis the batch, heads or
      sequence are split over does not divide them; the message carries the mesh check's own.
  """
  if jax.devices()[0].platform != "cpu":
    return
  procs = jax.process_count()  # each process has cpu_devices of the mesh's devices
  err = _mesh_error(cfg, len(jax.devices()))
  if err is None:
    return
  # Growing the -1 axis only multiplies the sizes each check divides by: a mesh that fails with the
  # -1 axis at 1 fails on every count, and the count is not what to change.
  fewest = math.prod(s for s in cfg.mesh_shape if s != -1)
  if _mesh_error(cfg, fewest) is not None:
    raise err
  micro = cfg.batch_size // cfg.grad_accum_steps
  each = f" per process ({procs} processes)" if procs > 1 else ""
  if -1 in cfg.mesh_shape:
    most = max(cores(), fewest)
    fitting = [c for c in range(1, most + 1) if _mesh_error(cfg, c * procs) is None]
    if not fitting:
      raise err  # no count fits with this many processes: the batch or mesh is what to change
    counts = ", ".join(map(str, fitting))
    fit = f"a count{each} up to {most} that mesh_shape {list(cfg.mesh_shape)} and the micro-batch "
    fit += f"({micro} rows) fit: {counts}"
  elif fewest % procs:
    raise err  # a fixed mesh whose size the processes cannot share equally: no count fits
  else:
    fit = f"the count{each} that fixed mesh_shape {list(cfg.mesh_shape)} names: {fewest // procs}"
  if cfg.cpu_devices == "auto":
    raise ValueError(
      f"{key}=auto left {len(jax.local_devices())} CPU devices in this process (XLA_FLAGS, "
      f"JAX_NUM_CPU_DEVICES or an earlier JAX use chose them), which this run's mesh or batch does not "
      f"fit ({err}); set {key} to {fit}"
    )
  raise ValueError(
    f"{key}={cfg.cpu_devices} does not fit this run's mesh or batch ({err}); choose {fit}; or {key}=auto"
  )
