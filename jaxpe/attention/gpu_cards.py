"""Per-card limits of NVIDIA GPUs that jaxpe's GPU kernels size themselves by, and the card a program
is built for: the one place these numbers live (``jaxpe.train.targets`` reads them for its compile
targets; ``flash.gpu_block``, ``pallas_gpu.forward_block`` and the cuDNN head-dim check use them).

Which card (``card()``): inside ``building_for(cc)`` (``jaxpe.train.targets.cuda_target`` enters it
for a deviceless compile of ``h100`` / ``h200`` / ``a100``) that compute capability; else, on a host
whose default backend is a GPU, the first device's ``compute_capability`` (jax's ``Device``
attribute, ``"8.0"`` on an A100); else (lowering for ``cuda`` from a CPU with no target named)
``DEFAULT_CAPABILITY``, an H100's. The card is read when a program is traced: a function jitted once
and traced again for another card in one process keeps jax's cached trace.

Sources:

- ``SHARED_MEMORY_OPTIN``: CUDA C++ Programming Guide, "Technical Specifications per Compute
  Capability", row "Maximum amount of shared memory per thread block" (opt-in, what Triton kernels
  may ask for): 7.0 96 KB, 7.5 64 KB, 8.0 163 KB, 8.6 99 KB, 8.7 163 KB, 8.9 99 KB, 9.0 227 KB,
  10.0 / 10.3 227 KB, 12.0 99 KB (KB = 1024 bytes; the guide's tuning guides for Ampere / Hopper give
  the same). XLA's target specs (``xla/backends/gpu/target_config/specs``: h100_sxm 232448,
  a100_sxm_80 166912) and Triton's "requested ..., available: ..." errors agree.
- ``cudnn_max_head_dim``: jax's cuDNN rule (``jax._src.cudnn.fused_attention_stablehlo
  .check_is_flash_attention``: "The head dim must be <= 256" on compute capability >= 9.0, <= 128
  before).

Cards (``CARDS``, by the names ``jaxpe.train.targets`` uses): h100 and h200 (sm_90), a100 (sm_80);
other capabilities are in the table for a real device of them (L4 / RTX 4090: 8.9; B200: 10.0).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

SHARED_MEMORY_OPTIN: dict[tuple[int, int], int] = {
  (7, 0): 96 * 1024,  # V100
  (7, 5): 64 * 1024,  # T4
  (8, 0): 163 * 1024,  # A100: 166912
  (8, 6): 99 * 1024,  # A10, RTX 30xx: 101376
  (8, 7): 163 * 1024,  # Jetson Orin
  (8, 9): 99 * 1024,  # L4, L40, RTX 40xx
  (9, 0): 227 * 1024,  # H100, H200: 232448
  (10, 0): 227 * 1024,  # B200
  (10, 3): 227 * 1024,  # B300
  (12, 0): 99 * 1024,  # RTX 50xx
}
"""Compute capability -> bytes of shared memory one thread block may use (opt-in maximum; see the
module's sources). A capability not listed takes its major version's smallest listed value."""

CARDS: dict[str, tuple[int, int]] = {"h100": (9, 0), "h200": (9, 0), "a100": (8, 0)}
"""Card name (``jaxpe.train.targets``' GPU targets) -> compute capability."""

DEFAULT_CAPABILITY = (9, 0)
"""The card assumed where none is named or present (lowering for ``cuda`` on a CPU): an H100."""

_BUILDING_FOR: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
  "jaxpe_gpu_card", default=None
)


def parse_capability(capability) -> tuple[int, int]:
  """``(major, minor)`` of ``capability``: a tuple, or jax's ``Device.compute_capability`` string
  (``"8.0"``, ``"9.0"``). Raises ValueError naming the argument for anything else."""
  if isinstance(capability, str):
    parts = capability.split(".")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
      return int(parts[0]), int(parts[1])
  elif isinstance(capability, tuple) and len(capability) == 2 and all(isinstance(p, int) for p in capability):
    return capability
  raise ValueError(f"capability must be 'major.minor' (e.g. '8.0') or (major, minor), got {capability!r}")


@contextlib.contextmanager
def building_for(capability):
  """While active, ``card()`` is ``capability`` (a ``(major, minor)`` tuple or ``"9.0"``): programs
  traced inside are sized for that card. Raises ValueError for a malformed capability."""
  token = _BUILDING_FOR.set(parse_capability(capability))
  try:
    yield
  finally:
    _BUILDING_FOR.reset(token)


def card() -> tuple[int, int]:
  """Compute capability of the card a program traced now is for (see the module docstring)."""
  named = _BUILDING_FOR.get()
  if named is not None:
    return named
  if jax.default_backend() == "gpu":
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is not None:
      return parse_capability(capability)
  return DEFAULT_CAPABILITY


def shared_memory(capability=None) -> int:
  """Bytes of shared memory a thread block may use on ``capability`` (default ``card()``)."""
  cc = card() if capability is None else parse_capability(capability)
  if cc in SHARED_MEMORY_OPTIN:
    return SHARED_MEMORY_OPTIN[cc]
  same = [v for (major, _), v in SHARED_MEMORY_OPTIN.items() if major == cc[0]]
  return min(same) if same else min(SHARED_MEMORY_OPTIN.values())


def cudnn_max_head_dim(capability=None) -> int:
  """Largest head dim (after emulation dims and padding) jax's cuDNN flash attention takes on
  ``capability`` (default ``card()``): 256 from compute capability 9.0 (Hopper), else 128."""
  cc = card() if capability is None else parse_capability(capability)
  return 256 if cc >= (9, 0) else 128


__all__ = [
  "CARDS",
  "DEFAULT_CAPABILITY",
  "SHARED_MEMORY_OPTIN",
  "building_for",
  "card",
  "cudnn_max_head_dim",
  "parse_capability",
  "shared_memory",
]
