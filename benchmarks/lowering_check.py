r"""Lower every attention backend and the whole model for GPU and TPU from any host (no device needed).

  python benchmarks/lowering_check.py              # the full table (attention and model), both platforms
  python benchmarks/lowering_check.py --quick      # one dtype, fewer encodings
  python benchmarks/lowering_check.py --no-compile # lower only, also where libtpu / the CUDA plugin are installed
  python benchmarks/lowering_check.py --gpu        # the cuda matrix: backend x ALiBi x H 64..256, compiled for an H100
  python benchmarks/accelerator_check.py --lower   # the same command

``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))`` (what ``jax.export.export(...,
platforms=...)`` runs) lowers a program for ``cuda`` or ``tpu`` on a CPU-only machine: every Pallas
lowering rule (Triton, Mosaic TPU), jax's cuDNN attention rule and the sharding of a mesh of
abstract devices (``jax.sharding.AbstractMesh`` with an ``AbstractDevice`` of the platform) run; the
Triton / Mosaic / cuDNN compilers themselves do not (Mosaic does where libtpu is installed: below;
only a device runs the kernels: their speed and numerics on the matmul units). Each row prints ``lowered`` and the custom calls the
program holds (``triton``, ``mosaic_tpu``, ``cudnn_fmha``, ``cpu_flash``: the CPU kernel, never in a
GPU or TPU program), or the first line of the error (``refused``: a backend the platform cannot run,
refused with its message).

Where libtpu is installed (``pip install "jax[tpu]==<jax version>"``; the ``test`` extra installs it
on Linux x86_64) the TPU column is also COMPILED, by XLA:TPU and Mosaic, for one generation
(``--tpu-chip``, default v5e; ``--no-compile`` lowers only): compile-only devices of a deviceless
topology (``tpu_devices``, ``compile_tpu``), the attention programs and the model's forward and
generation on one device, its train step sharded over 8. Those rows say ``compiled for <chip>`` and
a column gives the largest per-device HBM temporaries of the row (``memory_analysis()``: XLA:TPU keeps
small buffers in VMEM, not counted); elsewhere rows say ``lowered``.

Where jax's CUDA plugin is installed (``pip install "jaxpe[gpu-compile]"``, ``jax[cuda12]``) the cuda column
is COMPILED likewise, for one card (``--gpu-chip``, default h100; ``compile_gpu``): XLA:GPU, Triton
and ptxas run, with their shared-memory limits; the model's train step over 8 GPUs of one host.
Rows say ``compiled for h100`` and a column gives the per-device temporaries.

cuDNN: jax reads the cuDNN version from its CUDA plugin when it traces ``implementation="cudnn"``; on a
host without the plugin ``assumed_cudnn`` stands in a version (``CUDNN_VERSION``) while lowering, so
the rule is checked for the shapes as a pre-Hopper GPU would be (head dims <= 128).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpe  # noqa: E402
from jaxpe.attention import AlibiSpec, AttentionMask, RopeSpec, attention, backends  # noqa: E402

PLATFORMS = ("cuda", "tpu")
DEVICE_KINDS = {"cuda": "NVIDIA H100 80GB HBM3", "tpu": "TPU v5 lite", "cpu": "cpu"}
"""The abstract device of each platform's mesh (``jax.sharding.AbstractMesh``)."""
CUDNN_VERSION = 90800
KINDS = {
  "triton": r"triton",
  "mosaic_tpu": r"^tpu_custom_call$",
  "mosaic_gpu": r"mosaic_gpu",
  "cudnn_fmha": r"cudnn\$fmha",
  "cpu_flash": r"^jaxpe_cpu_flash",
}
"""Custom-call kind -> the pattern of its ``call_target_name``."""
ENCODINGS = ("none", "rope", "alibi", "rope_alibi")
EXPECTED = {  # backend -> platform -> the custom-call kind its program must hold (None: refused)
  "xla": {"cuda": (), "tpu": ()},
  "auto": {"cuda": ("cudnn_fmha",), "tpu": ("mosaic_tpu",)},
  "cudnn": {"cuda": ("cudnn_fmha",), "tpu": None},
  "pallas_gpu": {"cuda": ("triton",), "tpu": None},
  "splash": {"cuda": None, "tpu": ("mosaic_tpu",)},
  "flash": {"cuda": ("triton",), "tpu": ("mosaic_tpu",)},
}


def custom_calls(text: str) -> tuple[str, ...]:
  """The distinct custom-call targets of a lowered module's text, sorted."""
  names = re.findall(r'call_target_name = "([^"]+)"', text)
  names += re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  return tuple(sorted(set(names)))


def call_kinds(text: str) -> tuple[str, ...]:
  """The ``KINDS`` present in a lowered module's text."""
  calls = custom_calls(text)
  return tuple(kind for kind, pat in KINDS.items() if any(re.search(pat, c) for c in calls))


@contextlib.contextmanager
def assumed_cudnn(version: int = CUDNN_VERSION):
  """While active, jax's cuDNN attention traces on a host without its CUDA plugin (the version check
  answers ``version``); a host with cuDNN keeps its own."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415

  real = fa.check_cudnn_version
  try:
    real()
  except RuntimeError:
    pass
  else:  # cuDNN found (the CUDA plugin): its own version; an error of the body propagates as it is
    yield
    return
  fa.check_cudnn_version = lambda: version
  try:
    yield
  finally:
    fa.check_cudnn_version = real


def lower(fn, args, platforms=PLATFORMS) -> dict[str, str | Exception]:
  """``{platform: lowered module text or the exception}``: ``fn`` traced once, lowered per platform."""
  out: dict[str, str | Exception] = {}
  with assumed_cudnn():
    try:
      traced = jax.jit(fn).trace(*args)
    except Exception as err:  # noqa: BLE001  (reported in the table)
      return dict.fromkeys(platforms, err)
    for platform in platforms:
      try:
        out[platform] = traced.lower(lowering_platforms=(platform,)).as_text()
      except Exception as err:  # noqa: BLE001
        out[platform] = err
  return out


# ---------------------------------------------------------------- compiling for a TPU without one

TPU_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x4", "v5p": "v5p:2x2x2", "v6e": "v6e:2x4"}
"""TPU generation -> a topology of 8 devices ``jax.experimental.topologies.get_topology_desc``
builds compile-only devices of (the attention programs use one, the model's train step all 8)."""
TPU_ENVIRONMENT = {
  "TPU_SKIP_MDS_QUERY": "1",  # no GCE metadata server to ask what this host is
  "TPU_ACCELERATOR_TYPE": "v5litepod-8",  # quiets libtpu's host probing (any known type does)
  "TPU_WORKER_HOSTNAMES": "localhost",
  "TPU_WORKER_ID": "0",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # several processes (xdist workers) may load libtpu at once
}
"""Environment libtpu reads when it loads (the first ``get_topology_desc``); set where unset. Without
``ALLOW_MULTIPLE_LIBTPU_LOAD`` a second process fails on ``/tmp/libtpu_lockfile`` ("ABORTED:
Internal error when accessing libtpu multi-process lockfile")."""


def libtpu_installed() -> bool:
  """Whether the ``libtpu`` package (``pip install "jax[tpu]==<jax version>"``) is importable: the
  TPU compiler and Mosaic, which compile for a TPU generation on a host without one."""
  import importlib.util  # noqa: PLC0415

  return importlib.util.find_spec("libtpu") is not None


def tpu_devices(chip: str):
  """Compile-only devices of TPU generation ``chip`` (a key of ``TPU_TOPOLOGIES``), with
  ``TPU_ENVIRONMENT`` set where unset. ``JAX_PLATFORMS=cpu`` (the tests') does not stop it: the
  TPU plugin is loaded here for the topology, not as a backend.

  Raises:
    ValueError: ``chip`` not a key of ``TPU_TOPOLOGIES``.
    ImportError: libtpu is not installed.
  """
  import os  # noqa: PLC0415

  from jax.experimental import topologies  # noqa: PLC0415

  if chip not in TPU_TOPOLOGIES:
    raise ValueError(f"chip must be one of {sorted(TPU_TOPOLOGIES)}, got {chip!r}")
  if not libtpu_installed():
    raise ImportError('libtpu is not installed: pip install "jax[tpu]==<the installed jax>"')
  for name, value in TPU_ENVIRONMENT.items():
    os.environ.setdefault(name, value)
  return topologies.get_topology_desc(platform="tpu", topology_name=TPU_TOPOLOGIES[chip]).devices


def compile_tpu(fn, args, chip: str):
  """``(lowered StableHLO text, compiled executable)`` of ``jax.jit(fn)`` for one TPU of generation
  ``chip`` on any host: ``args`` (a pytree of ``ShapeDtypeStruct``) replicated on a one-device mesh
  of ``tpu_devices(chip)``; XLA:TPU and Mosaic compile every kernel, ``memory_analysis()`` answers
  for that device (temporaries: HBM only; XLA:TPU may place small buffers in VMEM, not counted).

  Raises: ``tpu_devices``' errors, and whatever the lowering or the compilers raise (Mosaic:
  ``MosaicError``).
  """
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

  mesh = Mesh(tpu_devices(chip)[:1], ("chip",))
  replicated = NamedSharding(mesh, PartitionSpec())
  structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), args)
  lowered = jax.jit(fn).lower(*structs)
  return lowered.as_text(), lowered.compile()


class Compiled(str):
  """A lowered module's text whose program also compiled for one TPU generation: ``chip``, and
  ``temp`` the per-device HBM temporaries in bytes (``memory_analysis()``)."""

  def __new__(cls, text: str, chip: str, temp: int):
    self = super().__new__(cls, text)
    self.chip, self.temp = chip, temp
    return self


def compiled_row(fn, args, chip: str, *, sharded: bool = False):
  """``Compiled`` of ``fn`` for ``chip`` (a TPU generation of ``TPU_TOPOLOGIES``: ``compile_tpu``; a
  GPU, ``h100``: ``compile_gpu``; ``sharded``: ``fn`` is jitted with its shardings already, ``args``
  placed on the chip's compile-only devices), or the exception raised."""
  from jaxpe.train import targets  # noqa: PLC0415

  try:
    if sharded:
      gpu = chip not in TPU_TOPOLOGIES
      with assumed_cudnn(), targets.cuda_target(targets.target(chip)) if gpu else contextlib.nullcontext():
        lowered = fn.lower(*args)
      text, compiled = lowered.as_text(), lowered.compile()
    elif chip in TPU_TOPOLOGIES:
      text, compiled = compile_tpu(fn, args, chip)
    else:
      with assumed_cudnn():
        text, compiled = compile_gpu(fn, args, chip)
    return Compiled(text, chip, compiled.memory_analysis().temp_size_in_bytes)
  except Exception as err:  # noqa: BLE001  (reported in the table)
    return err


def model_compiling(model_cfg, chip: str, **kw) -> dict[str, Compiled | Exception]:
  """``{program: Compiled or exception}`` of ``model_programs`` compiled for ``chip`` (a TPU
  generation, or a GPU: ``h100``): the train step sharded over 8 compile-only devices (TPU: of
  ``tpu_devices(chip)``; GPU: one host of 8, ``<chip>-8``), the others on one."""
  from jaxpe.train import targets  # noqa: PLC0415

  if chip in TPU_TOPOLOGIES:
    platform, devices = "tpu", tpu_devices(chip)
  else:
    platform, devices = "cuda", targets.compile_devices(targets.target(f"{chip}-8"))
  programs = model_programs(model_cfg, platform, devices=devices, **kw)
  return {
    name: compiled_row(fn, args, chip, sharded=name == "train step") for name, (fn, args) in programs.items()
  }


# ---------------------------------------------------------------- compiling for a GPU without one


def gpu_plugin_installed() -> bool:
  """Whether jax's CUDA plugin (``pip install "jaxpe[gpu-compile]"``: ``jax[cuda12]``) is importable:
  XLA:GPU, Triton, ptxas and cuDNN, which compile for an NVIDIA card on a host without one."""
  import importlib.util  # noqa: PLC0415

  return importlib.util.find_spec("jax_cuda12_plugin") is not None


def compile_gpu(fn, args, chip: str = "h100"):
  """``(lowered StableHLO text, compiled executable)`` of ``jax.jit(fn)`` for one NVIDIA ``chip``
  (``h100``, ``h200``, ``a100``: ``jaxpe.train.targets``) on any host with the CUDA plugin: ``args``
  placed on a compile-only device of that card (``get_topology_desc(platform="cuda",
  target_config=...)``); jax's cuDNN rule answers for the card (``targets.cuda_target``).

  Raises: ``MissingExtraError`` without the plugin, and whatever the lowering or the compilers raise.
  """
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

  from jaxpe.train import targets  # noqa: PLC0415

  t = targets.target(chip)
  mesh = Mesh(targets.compile_devices(t)[:1], ("chip",))
  replicated = NamedSharding(mesh, PartitionSpec())
  structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), args)
  with targets.cuda_target(t):
    lowered = jax.jit(fn).lower(*structs)
    return lowered.as_text(), lowered.compile()


# ---------------------------------------------------------------- attention


def attention_case(
  backend: str, encoding: str, dtype, *, grad: bool, batch=2, length=200, heads=4, kv=2, dim=64
):
  """``(fn, args)``: ``attention(implementation=backend)`` with ``encoding`` (none, rope: a RopeSpec,
  alibi: an AlibiSpec, rope_alibi: 2 float32 emulation dims), causal with a left-padded row,
  grouped-query heads, T not a multiple of the kernels' blocks; ``grad``: the gradient of a scalar
  of it in q, k and v."""
  positions = np.maximum(np.arange(length)[None, :] - np.array([[0], [7]]), 0).astype(np.int32)
  valid = np.arange(length)[None, :] >= np.array([[0], [7]])
  mask = AttentionMask(valid=jnp.asarray(valid), causal=True)
  slopes = np.asarray(jaxpe.alibi_slopes(heads), np.float64)
  extra = 2 if encoding == "rope_alibi" else 0
  q = jax.ShapeDtypeStruct((batch, length, heads, dim + extra), dtype)
  k = jax.ShapeDtypeStruct((batch, length, kv, dim + extra), dtype)
  v = jax.ShapeDtypeStruct((batch, length, kv, dim), dtype)

  def fwd(q, k, v):
    pos = jnp.asarray(positions)
    kw = dict(scale=dim**-0.5, mask=mask, implementation=backend, precise_dims=extra)
    if encoding == "rope":
      kw["rope_spec"] = RopeSpec(jaxpe.rope_inv_freq(dim), pos, pos, layout="half")
    elif encoding == "alibi":
      kw["alibi_spec"] = AlibiSpec(slopes, pos, pos, max_position=65536)
    return attention(q, k, v, **kw)

  if not grad:
    return fwd, (q, k, v)
  return jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)), (q, k, v)


def attention_backends() -> tuple[str, ...]:
  """The backends of the table: ``EXPECTED``'s, and the optional ones installed here (``tokamax``)."""
  return (*EXPECTED, *(b for b in backends.OPTIONAL_BACKENDS if b in backends.BACKENDS))


HEAD_DIMS = (64, 80, 96, 128, 256)
"""The head sizes models use (issue 45): the GPU compile matrix's."""
GPU_BACKENDS = ("xla", "cudnn", "pallas_gpu", "flash", "auto")


def gpu_compile_row(
  backend: str, encoding: str, dim: int, *, grad: bool, chip: str = "h100", dtype=jnp.bfloat16
):
  """``Compiled`` (for ``chip``) or the exception of ``attention_case(backend, encoding, dtype,
  grad=grad, dim=dim)`` at B 2, T 256, N 4, K 2, compiled for one NVIDIA ``chip`` (``compile_gpu``)."""
  fn, args = attention_case(backend, encoding, dtype, grad=grad, length=256, dim=dim)
  try:
    with assumed_cudnn():
      text, compiled = compile_gpu(fn, args, chip)
    return Compiled(text, chip, compiled.memory_analysis().temp_size_in_bytes)
  except Exception as err:  # noqa: BLE001  (reported in the table)
    return err


def gpu_head_dim_table(
  chip: str = "h100", dims=HEAD_DIMS, backends=GPU_BACKENDS, encodings=("none", "alibi")
):
  """Markdown rows: every backend x encoding x head dim, forward and gradient, compiled for ``chip``."""
  lines = [
    f"| backend | encoding | H | forward ({chip}) | gradient ({chip}) |",
    "| --- | --- | --- | --- | --- |",
  ]
  for backend in backends:
    for enc in encodings:
      for dim in dims:
        cells = []
        for grad in (False, True):
          got = gpu_compile_row(backend, enc, dim, grad=grad, chip=chip)
          cell = describe(got)
          if isinstance(got, Compiled):
            cell += f", temp {got.temp / 2**20:.2f} MiB"
          cells.append(cell)
        print(f"| {backend} | {enc} | {dim} | {' | '.join(cells)} |", flush=True)
        lines.append(f"| {backend} | {enc} | {dim} | {' | '.join(cells)} |")
  return lines


# ---------------------------------------------------------------- the model


def model_programs(
  model_cfg, platform: str, *, mesh_shape=(2, 2, 2, 1), batch=8, seq=32, generate=True, devices=None
):
  """``{"forward" | "train step" | "generate": (fn, args)}`` of a decoder on ``platform``: the train
  step (loss, grad, AdamW) as ``jaxpe.train`` builds it, sharded over an abstract mesh of
  ``mesh_shape`` (data, fsdp, tensor, context) devices of that platform, or over ``devices`` (as
  many as the mesh has: compile-only TPU devices, ``tpu_devices``); the forward and KV-cache
  generation unsharded."""
  from flax import nnx  # noqa: PLC0415

  from jaxpe.model import Decoder  # noqa: PLC0415
  from jaxpe.model.generate import generate as generate_fn
  from jaxpe.train import sharding, steps  # noqa: PLC0415
  from jaxpe.train import state as state_lib
  from jaxpe.train.config import TrainConfig

  device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[platform], num_cores=None, platform=platform)
  axes = ("data", "fsdp", "tensor", "context")
  if devices is None:
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), axes, abstract_device=device)
  else:
    grid = np.array(list(devices)[: int(np.prod(mesh_shape))]).reshape(mesh_shape)
    mesh = jax.sharding.Mesh(grid, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  tcfg = TrainConfig(model=model_cfg, batch_size=batch, seq_len=seq, mesh_shape=tuple(mesh_shape))
  graphdef, abstract = state_lib.abstract_state(tcfg, mesh)
  shardings = jax.tree.map(lambda x: x.sharding, abstract)
  batch_sharding = sharding.batch_sharding(mesh, tcfg.logical_rules)
  step = steps.make_train_step(
    graphdef, mesh=mesh, rules=tcfg.logical_rules, state_shardings=shardings, batch_sharding=batch_sharding
  )
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=batch_sharding)
  programs = {"train step": (step, (abstract, tokens))}
  model = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
  mgraph, mstate = nnx.split(model)
  prompt = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  programs["forward"] = (lambda s, t: nnx.merge(mgraph, s)(t), (mstate, prompt))
  if generate:
    programs["generate"] = (
      lambda s, t: generate_fn(nnx.merge(mgraph, s), t, max_new_tokens=4),
      (mstate, prompt),
    )
  return programs


def model_lowering(model_cfg, platform: str, **kw) -> dict[str, str | Exception]:
  """``{program: lowered text or exception}`` of ``model_programs`` for ``platform``."""
  out = {}
  for name, (fn, args) in model_programs(model_cfg, platform, **kw).items():
    if name == "train step":  # already jitted with its shardings
      with assumed_cudnn():
        try:
          with jax.sharding.use_abstract_mesh(_mesh_of(args)):
            traced = fn.trace(*args)
          out[name] = traced.lower(lowering_platforms=(platform,)).as_text()
        except ValueError as err:
          if "AbstractMesh cannot be used" not in str(err):
            out[name] = err
            continue
          # jax's cuDNN attention partitions itself (custom_partitioning), which needs real devices
          # to lower: on an abstract mesh only the unsharded step can be checked
          step, step_args = unsharded_train_step(model_cfg, **kw)
          result = lower(step, step_args, (platform,))[platform]
          out[name] = result if isinstance(result, Exception) else Noted(result, UNSHARDED)
        except Exception as err:  # noqa: BLE001
          out[name] = err
    else:
      out[name] = lower(fn, args, (platform,))[platform]
  return out


def unsharded_train_step(model_cfg, *, batch=8, seq=32, **_):
  """``(step, args)``: the train step of ``model_programs`` with no mesh (one device)."""
  from jaxpe.train import state as state_lib  # noqa: PLC0415
  from jaxpe.train import steps  # noqa: PLC0415
  from jaxpe.train.config import TrainConfig  # noqa: PLC0415

  tcfg = TrainConfig(model=model_cfg, batch_size=batch, seq_len=seq, mesh_shape=(1, 1, 1, 1))
  mesh = jax.sharding.AbstractMesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "context"))
  graphdef, abstract = state_lib.abstract_state(tcfg, mesh)
  plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  step = steps.make_train_step(graphdef)
  return step, (plain, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32))


def _mesh_of(args):
  """The abstract mesh of the first sharded leaf of ``args``."""
  for x in jax.tree.leaves(args):
    sharding = getattr(x, "sharding", None)
    if sharding is not None and hasattr(sharding, "mesh"):
      return sharding.mesh
  raise ValueError("no sharded argument")


def model_backends(encoding: str) -> tuple[str, ...]:
  """The backends a config of ``encoding`` allows (``jaxpe.model.bias_options``): xla, auto, and flash
  unless the encoding is a bias only xla computes."""
  from jaxpe.model import bias_options  # noqa: PLC0415

  return ("xla", "auto") if encoding in bias_options.XLA_ONLY_ENCODINGS else ("xla", "auto", "flash")


def tiny_model(encoding: str, backend: str):
  from jaxpe.model.config import ModelConfig  # noqa: PLC0415

  kw = dict(vocab_size=256, d_model=64, num_layers=1, num_heads=2, max_len=64, pos_encoding=encoding)
  kw["attn_implementation"] = backend
  if encoding == "rope_alibi":
    kw["rope_alibi_context"] = 64
  return ModelConfig(**kw)


# ---------------------------------------------------------------- the table


UNSHARDED = "unsharded: cuDNN's own partitioning needs devices"


class Noted(str):
  """A lowered module's text with a note for the table (how it was lowered)."""

  def __new__(cls, text: str, note: str):
    self = super().__new__(cls, text)
    self.note = note
    return self


def describe(result) -> str:
  if isinstance(result, Exception):
    first = (str(result).strip().splitlines() or [type(result).__name__])[0]
    if "is not available on platform" in first:
      return "refused (" + first.split(" (interpret", 1)[0].removeprefix("attention implementation ") + ")"
    return f"error: {type(result).__name__}: {first[:160]}"
  kinds = call_kinds(result)
  note = getattr(result, "note", None)
  done = f"compiled for {result.chip}" if isinstance(result, Compiled) else "lowered"
  return done + (f" ({', '.join(kinds)})" if kinds else "") + (f" ({note})" if note else "")


def _temp(results) -> str:
  """The largest per-device HBM temporaries (MiB) of the ``Compiled`` among ``results``, or "-"."""
  temps = [r.temp for r in results if isinstance(r, Compiled)]
  return f"{max(temps) / 2**20:.2f}" if temps else "-"


def _short(dtype) -> str:
  return {"bfloat16": "bf16", "float32": "f32"}.get(jnp.dtype(dtype).name, jnp.dtype(dtype).name)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="float32 only, two encodings, no model rows")
  parser.add_argument("--no-model", action="store_true", help="attention rows only")
  parser.add_argument(
    "--no-compile", action="store_true", help="lower only, also where libtpu or the CUDA plugin is installed"
  )
  parser.add_argument(
    "--tpu-chip",
    default="v5e",
    choices=sorted(TPU_TOPOLOGIES),
    help="the TPU generation the TPU rows compile for where libtpu is installed (default v5e)",
  )
  parser.add_argument(
    "--gpu-chip",
    default="h100",
    choices=("h100", "h200", "a100"),
    help="the GPU the cuda rows compile for where jax's CUDA plugin is installed (default h100)",
  )
  parser.add_argument(
    "--gpu",
    action="store_true",
    help="only the cuda head-dim matrix (every backend, ALiBi or not, H 64..256)",
  )
  args = parser.parse_args(argv)
  start = time.time()
  chips = {
    "tpu": None if args.no_compile or not libtpu_installed() else args.tpu_chip,
    "cuda": None if args.no_compile or not gpu_plugin_installed() else args.gpu_chip,
  }
  if args.gpu:
    if not chips["cuda"]:
      print('the cuda matrix compiles: install jax\'s CUDA plugin (pip install "jaxpe[gpu-compile]")')
      return 2
    print("\n".join(gpu_head_dim_table(chips["cuda"])))
    return 0
  dtypes = (jnp.float32,) if args.quick else (jnp.bfloat16, jnp.float32)
  encs = ("none", "alibi") if args.quick else ENCODINGS
  compiled = [p for p in PLATFORMS if chips[p]]
  memory = "".join(f" {p} temp MiB ({chips[p]}) |" for p in compiled)
  dashes = " --- |" * len(compiled)
  print("| backend | encoding | pass, dtype | " + " | ".join(PLATFORMS) + f" |{memory}")
  print("| --- | --- | --- | " + " | ".join("---" for _ in PLATFORMS) + " |" + dashes)
  for backend in attention_backends():
    for enc in encs:
      rows: dict[str, list] = {}  # cells -> the (pass, dtype) labels and compiled results that gave them
      for grad in (False, True):
        for dtype in dtypes:
          fn, fargs = attention_case(backend, enc, dtype, grad=grad)
          got = lower(fn, fargs)
          for p in compiled:
            if not isinstance(got[p], Exception):
              got[p] = compiled_row(fn, fargs, chips[p])
          cells = " | ".join(describe(got[p]) for p in PLATFORMS)
          label = f"{'grad' if grad else 'fwd'} {_short(dtype)}"
          rows.setdefault(cells, []).append((label, got))
      for cells, found in rows.items():
        every = len(found) == 2 * len(dtypes)
        labels = "all" if every else ", ".join(label for label, _ in found)
        extra = "".join(f" {_temp(g[p] for _, g in found)} |" for p in compiled)
        print(f"| {backend} | {enc} | {labels} | {cells} |{extra}")
  if not (args.quick or args.no_model):
    from jaxpe.model import encodings as registry  # noqa: PLC0415

    print()
    print("| backend | program | encodings | " + " | ".join(PLATFORMS) + f" |{memory}")
    print("| --- | --- | --- | " + " | ".join("---" for _ in PLATFORMS) + " |" + dashes)
    rows: dict[tuple[str, str, str], list] = {}  # (backend, program, cells) -> encodings, results
    for enc in sorted(registry.REGISTRY):
      for backend in model_backends(enc):
        cfg = tiny_model(enc, backend)
        per = {p: model_lowering(cfg, p) for p in PLATFORMS if not chips[p]}
        for p in compiled:
          per[p] = model_compiling(cfg, chips[p])
        for program in per[PLATFORMS[0]]:
          cells = " | ".join(describe(per[p][program]) for p in PLATFORMS)
          rows.setdefault((backend, program, cells), []).append(
            (enc, {p: per[p][program] for p in PLATFORMS})
          )
    for (backend, program, cells), found in sorted(rows.items()):
      extra = "".join(f" {_temp(g[p] for _, g in found)} |" for p in compiled)
      print(f"| {backend} | {program} | {', '.join(e for e, _ in found)} | {cells} |{extra}")
  why = {"tpu": "libtpu not installed", "cuda": "jax's CUDA plugin not installed (the gpu-compile extra)"}
  how = "; ".join(
    f"{p} rows compiled for {chips[p]}"
    if chips[p]
    else f"{p} rows lowered only (" + ("--no-compile" if args.no_compile else why[p]) + ")"
    for p in PLATFORMS
  )
  print(
    f"\n{time.time() - start:.0f} s on {jax.devices()[0].platform}, jax {jax.__version__}; {how} "
    "(temp: the largest per-device temporaries of the row, memory_analysis())"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
