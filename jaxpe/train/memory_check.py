"""A floor of the memory a training run needs, checked against the devices before any work: a huge
``model.*``, ``batch_size``, ``seq_len`` or ``sample_len`` is one line, not an out-of-memory crash (or
the kernel's OOM killer) minutes later."""

from __future__ import annotations

import math
import os
from typing import Any

import jax
from flax import nnx

from jaxpe.model.decoder import Decoder
from jaxpe.train import sharding
from jaxpe.train.config import TrainConfig

STATE_BYTES_PER_PARAM = 16
"""Training memory per parameter, at the least: float32 parameter, gradient and AdamW's two moments
(``model.param_dtype=bfloat16``: 2 + 2 bytes of parameter and gradient, 4 of float32 master weight, 8
of moments: also 16)."""


def memory_floor_bytes(cfg: TrainConfig) -> tuple[int, int]:
  """``(parameters, bytes)``: the model's exact parameter count (``nnx.eval_shape``: nothing is
  allocated) and a lower bound of the bytes a run needs on all devices together: parameters,
  gradients and AdamW moments (``STATE_BYTES_PER_PARAM`` each), the float32 logits of one
  micro-batch and their gradient (``2 x 4 B T V`` bytes with B = batch_size / grad_accum_steps) and
  the end-of-run sample's KV cache (``2 L (prompt + sample_len) K H x 4`` bytes)."""
  m = cfg.model

  def count(layers: int) -> int:  # shapes only; layers are identical, so 1 and 2 layers give the rest
    small = m.model_copy(update={"num_layers": layers, "scan_layers": False, "remat": "none"})
    abstract = nnx.eval_shape(lambda: Decoder(small, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))

  one = count(1)
  params = one + (m.num_layers - 1) * (count(2) - one)
  micro = cfg.batch_size // cfg.grad_accum_steps
  logits = 2 * 4 * micro * cfg.seq_len * m.vocab_size
  sample = 0
  if cfg.sample_len:
    sample = (
      2 * m.num_layers * (len(cfg.sample_prompt.encode()) + cfg.sample_len) * m.kv_heads * m.head_size * 4
    )
  return params, STATE_BYTES_PER_PARAM * params + logits + sample


def check_fits_memory(cfg: TrainConfig, devices: list[Any] | None = None) -> None:
  """Refuses a run whose ``memory_floor_bytes`` exceed the memory of all ``devices`` together
  (default ``jax.devices()``; an accelerator's ``bytes_limit``, the machine's physical memory for
  CPU devices, counted once; the state then counts once per copy the mesh keeps on them,
  ``_state_copies``), so a huge ``model.*``, ``seq_len``, ``batch_size`` or ``sample_len``
  is one error instead of an out-of-memory crash (or the kernel's OOM killer) minutes later. A
  run that passes can still run out of memory (activations, XLA buffers): the check is a floor.

  Listing the devices starts JAX's backends: in a multi-process run call
  ``jaxpe.sharding.initialize_distributed`` first (the command lines do).

  Raises:
    ValueError: naming the keys to shrink, the bytes needed at least and the bytes available.
  """
  devices = list(jax.devices() if devices is None else devices)  # after jax.distributed.initialize, if any
  available, host_devices = 0, 0
  for d in devices:
    stats = None
    try:
      stats = d.memory_stats()
    except Exception:  # noqa: BLE001 (backends without memory statistics)
      stats = None
    if stats and stats.get("bytes_limit"):
      available += int(stats["bytes_limit"])
    else:
      available += 0 if host_devices else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
      host_devices += 1
  params, need = memory_floor_bytes(cfg)
  copies = _state_copies(cfg, host_devices) if host_devices == len(devices) else 1
  need += (copies - 1) * STATE_BYTES_PER_PARAM * params
  held = (
    f", held {copies} times: the mesh replicates them over devices that share the host's memory "
    "(cpu_devices=1 keeps one)"
    if copies > 1
    else ""
  )
  if need > available:
    raise ValueError(
      f"this run needs at least {need / 2**30:,.1f} GiB ({params:,} parameters x {STATE_BYTES_PER_PARAM} B for "
      f"parameters, gradients and AdamW moments{held}, plus logits of batch_size / grad_accum_steps x seq_len x "
      f"model.vocab_size and the sample's cache) but the {len(devices)} device(s) have "
      f"{available / 2**30:,.1f} GiB in all: make model.d_model, model.num_layers, model.mlp_dim, "
      "model.vocab_size, batch_size, seq_len or sample_len smaller"
    )


def _state_copies(cfg: TrainConfig, num_devices: int) -> int:
  """The copies of the training state that ``num_devices`` devices sharing one memory (the host's
  CPU devices, ``cpu_devices``) hold at the least: the product of the mesh axes that no parameter's
  logical rule splits over (``data`` and ``context`` with the default rules); 1 for a mesh that does
  not fit (the mesh check names it later)."""
  try:
    dims = dict(zip(sharding.MESH_AXES, sharding.mesh_dims(cfg.mesh_shape, num_devices), strict=True))
  except ValueError:
    return 1
  split: set[str] = set()
  for name, axes in cfg.logical_rules.as_tuple():
    if name not in ("batch", "length"):
      split.update(sharding.rule_axes(axes))
  return math.prod(size for axis, size in dims.items() if axis not in split)
