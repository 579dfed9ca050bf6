"""Compile targets: the accelerators ``jaxpe-compile`` compiles a run for from any host (a CPU is
enough), their specifications, and compile-only devices of them.

A target names a slice of chips: ``v5e-8`` (TPU v5e, topology 2x4, 8 chips), ``v6e-4``, ``v5p-8`` (4
chips: v5p and v4 count TensorCores, two per chip), ``v4-8``, ``h100``, ``h200``, ``a100`` (one GPU),
``h100-8`` (8 GPUs of one host). Several hosts' worth of TPU chips (``v5e-16``: 4 hosts of 4; ``v5p-16``,
``v4-16``, ...) compile alike: the program of one slice, as every host runs it.

Compile-only devices (``jax.experimental.topologies.get_topology_desc``) run no code; ``jax.jit(f)
.lower(...).compile()`` over a mesh of them runs the chip's real compiler (XLA:TPU and Mosaic from
libtpu; XLA:GPU, Triton and ptxas from jax's CUDA plugin) and answers ``memory_analysis()`` and
``cost_analysis()`` per device. Recipe: ``/work/shared/DESIGN.md`` section 8, maxtext's
``train_compile.py`` (``docs/accelerator.md``). Needs, per platform:

- TPU: the ``libtpu`` package (``pip install "jax[tpu]==<the installed jax>"``; jaxpe's ``test``
  extra installs it on Linux x86_64);
- GPU: jax's CUDA plugin (``pip install "jaxpe[gpu-compile]"``, i.e. ``jax[cuda12]``: several GB).

A missing one raises ``MissingExtraError`` naming the pip command.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

import jax

from jaxpe.attention import gpu_cards
from jaxpe.errors import MissingExtraError

__all__ = ["CHIPS", "TARGETS", "Chip", "Target", "compile_devices", "target"]

GiB = 2**30


@dataclass(frozen=True)
class Chip:
  """One accelerator chip: ``hbm_bytes`` of memory (bytes), ``peak_flops`` its dense bfloat16 matmul
  peak (FLOP/s), ``hbm_bandwidth`` (bytes/s), and ``source``: where the numbers are from."""

  name: str
  platform: str  # "tpu" | "cuda"
  hbm_bytes: int
  peak_flops: float
  hbm_bandwidth: float
  source: str


CHIPS = {
  "v4": Chip("TPU v4", "tpu", 32 * GiB, 275e12, 1200e9, "cloud.google.com/tpu/docs/v4 (32 GiB HBM2, 1200 GB/s)"),
  "v5e": Chip("TPU v5e", "tpu", 16 * GiB, 197e12, 819e9, "cloud.google.com/tpu/docs/v5e (16 GiB HBM2, 819 GB/s)"),
  "v5p": Chip("TPU v5p", "tpu", 95 * GiB, 459e12, 2765e9, "cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 2765 GB/s)"),
  "v6e": Chip("TPU v6e", "tpu", 32 * GiB, 918e12, 1640e9, "cloud.google.com/tpu/docs/v6e (32 GiB HBM, 1640 GB/s)"),
  "h100": Chip(
    "NVIDIA H100 SXM 80GB", "cuda", 84929347584, 989e12, 3.35e12,
    "NVIDIA H100 data sheet (SXM: 989 TFLOP/s dense bf16, 3.35 TB/s); memory: XLA's h100_sxm target spec",
  ),
  "h200": Chip(
    "NVIDIA H200 141GB", "cuda", 151397597184, 989e12, 4.8e12,
    "NVIDIA H200 data sheet (989 TFLOP/s dense bf16, 4.8 TB/s); memory: XLA's h200 target spec",
  ),
  "a100": Chip(
    "NVIDIA A100 SXM 80GB", "cuda", 85100068864, 312e12, 2.039e12,
    "NVIDIA A100 data sheet (312 TFLOP/s dense bf16, 2039 GB/s); memory: XLA's a100_sxm_80 target spec",
  ),
}  # fmt: skip
"""Chip name -> ``Chip``. TPU memory in GiB as Google's pages give it (the runtime reserves a little
of it); GPU memory as XLA's target specs (``xla/backends/gpu/target_config/specs``) give it."""


@dataclass(frozen=True)
class Target:
  """A compile target: ``chips`` chips of ``CHIPS[chip]``; ``topology`` the name
  ``get_topology_desc`` takes (TPU ``v5e:2x4``; GPU ``1x1x<n>``: slices x hosts x devices)."""

  name: str
  chip: str
  topology: str
  chips: int

  @property
  def spec(self) -> Chip:
    return CHIPS[self.chip]


def _tpu_targets() -> dict[str, Target]:
  out = {}
  for chip in ("v5e", "v6e"):  # one TensorCore per chip: v5e-8 is 8 chips
    for shape in ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"):
      a, b = map(int, shape.split("x"))
      out[f"{chip}-{a * b}"] = Target(f"{chip}-{a * b}", chip, f"{chip}:{shape}", a * b)
  for chip in ("v5p", "v4"):  # named by TensorCores, two per chip: v5p-8 is 4 chips
    for shape in ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4"):
      a, b, c = map(int, shape.split("x"))
      out[f"{chip}-{2 * a * b * c}"] = Target(f"{chip}-{2 * a * b * c}", chip, f"{chip}:{shape}", a * b * c)
  return out


def _gpu_targets() -> dict[str, Target]:
  out = {}
  for chip in ("h100", "h200", "a100"):
    out[chip] = Target(chip, chip, "1x1x1", 1)
    out[f"{chip}-8"] = Target(f"{chip}-8", chip, "1x1x8", 8)
  return out


TARGETS = {**_tpu_targets(), **_gpu_targets()}
"""Target name -> ``Target`` (``v5e-8``, ``v6e-4``, ``v5p-8``, ``v4-8``, ``h100``, ``h100-8``, ...)."""

TPU_ENVIRONMENT = {
  "TPU_SKIP_MDS_QUERY": "1",  # no GCE metadata server to ask what this host is
  "TPU_ACCELERATOR_TYPE": "v5litepod-8",  # quiets libtpu's host probing (any known type does)
  "TPU_WORKER_HOSTNAMES": "localhost",
  "TPU_WORKER_ID": "0",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # several processes (xdist workers) may load libtpu at once
}
"""Environment libtpu reads when it loads (the first ``get_topology_desc``); set where unset."""

_GPU_INFO = {  # per card: XLA's target specs (xla/backends/gpu/target_config/specs/*.txtpb); the
  # compute capability and shared memory per block: jaxpe.attention.gpu_cards (one table)
  "h100": dict(
    smem_core=233472, cores=132, fpus=128, bandwidth=3352320000000, l2=52428800, clock=1.98,
    memory=84929347584, name="NVIDIA H100 80GB HBM3",
  ),
  "h200": dict(
    smem_core=233472, cores=132, fpus=128, bandwidth=4800000000000, l2=52428800, clock=1.98,
    memory=151397597184, name="NVIDIA H200 141GB HBM3e",
  ),
  "a100": dict(
    smem_core=167936, cores=108, fpus=64, bandwidth=2039040000000, l2=41943040, clock=1.41,
    memory=85100068864, name="NVIDIA A100-SXM4-80GB",
  ),
}  # fmt: skip


def gpu_target_config(chip: str) -> str:
  """The ``GpuTargetConfigProto`` text of GPU ``chip`` (``h100``, ``h200``, ``a100``) that
  ``get_topology_desc(platform="cuda", target_config=...)`` compiles for (cuDNN 9.8, CUDA 12.8: what
  jax 0.10's CUDA plugin ships). Raises KeyError for another chip."""
  g = _GPU_INFO[chip]
  cc = gpu_cards.CARDS[chip]
  smem = gpu_cards.shared_memory(cc)
  return (
    "gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
    f"shared_memory_per_core: {g['smem_core']} threads_per_core_limit: 2048 core_count: {g['cores']} "
    f"fpus_per_core: {g['fpus']} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 "
    f"block_dim_limit_z: 65535 memory_bandwidth: {g['bandwidth']} l2_cache_size: {g['l2']} "
    f"clock_rate_ghz: {g['clock']} device_memory_size: {g['memory']} "
    f"shared_memory_per_block_optin: {smem} cuda_compute_capability {{ major: {cc[0]} minor: {cc[1]} }} "
    "registers_per_core_limit: 65536 registers_per_block_limit: 65536 } "
    'platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 } '
    f'runtime_version {{ major: 12 minor: 8 patch: 0 }} device_description_str: "{g["name"]}"'
  )


def target(name: str) -> Target:
  """The ``Target`` called ``name``. Raises ValueError naming the known targets."""
  if name not in TARGETS:
    raise ValueError(f"--target must be one of {', '.join(TARGETS)}; got {name!r}")
  return TARGETS[name]


def check_compiler(t: Target) -> None:
  """Raises ``MissingExtraError`` when the compiler of ``t``'s platform is not installed, naming
  the pip command: libtpu for TPU, jax's CUDA plugin (``jax_cuda12_plugin``) for GPU."""
  if t.spec.platform == "tpu" and importlib.util.find_spec("libtpu") is None:
    err = MissingExtraError(
      f"target {t.name} needs libtpu, the TPU compiler (not installed): "
      f'pip install "jax[tpu]=={jax.__version__}" (or jaxpe\'s test extra: pip install "jaxpe[test]")'
    )
    err.name = "libtpu"
    raise err
  if t.spec.platform == "cuda" and importlib.util.find_spec("jax_cuda12_plugin") is None:
    err = MissingExtraError(
      f"target {t.name} needs jax's CUDA plugin, the GPU compiler (not installed; several GB): "
      f'pip install "jaxpe[gpu-compile]" (that is: pip install "jax[cuda12]=={jax.__version__}")'
    )
    err.name = "jax_cuda12_plugin"
    raise err


def compile_devices(t: Target) -> list:
  """Compile-only devices of target ``t`` (``get_topology_desc``), in the topology's order.

  TPU v4 and v5p topologies hold one device per TensorCore (two per chip: ``v4-8`` gives 8 devices
  of half a chip's memory each); v5e and v6e one per chip.

  Raises:
    MissingExtraError: the platform's compiler is not installed (``check_compiler``).
  """
  from jax.experimental import topologies  # noqa: PLC0415

  check_compiler(t)
  if t.spec.platform == "tpu":
    for key, value in TPU_ENVIRONMENT.items():
      os.environ.setdefault(key, value)
    return list(topologies.get_topology_desc(platform="tpu", topology_name=t.topology).devices)
  return list(
    topologies.get_topology_desc(
      platform="cuda", target_config=gpu_target_config(t.chip), topology=t.topology
    ).devices
  )


@contextlib.contextmanager
def cuda_target(t: Target):
  """While active, jax's cuDNN attention rule (``jax.nn.dot_product_attention(implementation="cudnn")``)
  checks shapes for GPU target ``t``'s compute capability instead of this host's (a CPU host has none,
  and jax then applies the pre-Hopper limits: head dims <= 128 where Hopper takes 256), and jaxpe's
  GPU kernels size their blocks for that card (``jaxpe.attention.gpu_cards.building_for``: shared
  memory per block, cuDNN's head-dim limit). A host whose default backend is a GPU, and a TPU
  target, keep jax's own check (the blocks still follow the target). Patches the private
  ``jax._src.cudnn.fused_attention_stablehlo.check_compute_capability`` (and its ``..._equal``)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415

  if t.spec.platform != "cuda":
    yield
    return
  cc = gpu_cards.CARDS[t.chip]
  if jax.default_backend() == "gpu":
    with gpu_cards.building_for(cc):
      yield
    return
  real = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
  fa.check_compute_capability = lambda c: cc >= tuple(int(x) for x in c.split("."))
  fa.is_cuda_compute_capability_equal = lambda c: cc == tuple(int(x) for x in c.split("."))
  try:
    with gpu_cards.building_for(cc):
      yield
  finally:
    fa.check_compute_capability, fa.is_cuda_compute_capability_equal = real


def device_memory(t: Target, devices: list) -> int:
  """HBM bytes of one of ``devices`` (``compile_devices(t)``): the chip's memory shared by the
  devices of one chip (v4 and v5p: two TensorCores)."""
  return t.spec.hbm_bytes * t.chips // len(devices)
