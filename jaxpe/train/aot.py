"""Ahead-of-time compilation of a training run for a target accelerator (``jaxpe.train.targets``),
from any host: the run's real sharded train step and its sample's generation, compiled by the
target's own compiler over compile-only devices, with the memory and FLOPs the compiler reports
per device. ``jaxpe-compile`` (``jaxpe.train.compile_cli``) prints it.

The train step is the one ``jaxpe-train`` runs (``jaxpe.train.loop``): ``steps.make_train_step`` of
the state ``state.abstract_state`` builds for the config (the model, AdamW and its schedule), with
the state's and the batch's ``NamedSharding`` on ``sharding.make_mesh(cfg.mesh_shape, devices)``,
``grad_accum_steps`` and the logical rules; its input state is donated. Generation is the program
the run's end-of-run sample runs (``jaxpe.model.generate``: prefill and the decode loop, with the
sample's prompt, length and sampling) on one device, as the trainer runs it.

Per device, ``memory_analysis()``: arguments, outputs, the outputs that alias donated arguments,
temporaries and generated code; the memory a program needs is ``arguments + outputs - aliased +
temporaries + generated code`` (the buffers XLA holds at once at most; XLA:TPU keeps small buffers
in VMEM, not counted). ``cost_analysis()``: the compiled program's FLOPs and bytes accessed per
device; XLA counts a ``while`` loop's body once (``model.scan_layers``, ``grad_accum_steps`` > 1,
the decode loop) and a kernel's custom call as the cost the kernel declares, so the roofline also
takes the model FLOPs (``flops.train_flops_per_token``). Roofline: the step takes at least
``max(FLOPs / peak FLOP/s, bytes accessed / HBM bandwidth)`` (Williams et al., "Roofline", CACM
2009); the MFU estimate is the model FLOPs over that time at the chip's peak, an upper bound.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpe.model.decoder import Decoder
from jaxpe.train import flops, input_pipeline, sharding, steps, targets
from jaxpe.train import state as state_lib
from jaxpe.train.config import TrainConfig
from jaxpe.train.steps import next_token_loss_sum

__all__ = ["ProgramReport", "compile_run", "custom_calls"]

_KERNELS = {
  "tpu_custom_call": "Mosaic TPU kernel",
  "__gpu$xla.gpu.triton": "Triton kernel",
  "triton_kernel_call": "Triton kernel",
  "cudnn$fmha": "cuDNN fused attention",
  "mosaic_gpu": "Mosaic GPU kernel",
  "__cublas$": "cuBLAS",
  "__cudnn$": "cuDNN",
}


def custom_calls(text: str) -> tuple[str, ...]:
  """The distinct custom-call targets of a lowered module's text (StableHLO), sorted."""
  names = re.findall(r'call_target_name = "([^"]+)"', text)
  names += re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  return tuple(sorted(set(names)))


def describe_call(name: str) -> str:
  """``name`` with what it is when known (``tpu_custom_call (Mosaic TPU kernel)``)."""
  for key, what in _KERNELS.items():
    if key in name:
      return f"{name} ({what})"
  return name


@dataclass
class ProgramReport:
  """One compiled program on one device of the target (bytes, FLOPs, seconds)."""

  name: str
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int
  capacity: int  # the device's HBM
  flops: float  # the compiled program's, per device (XLA's count)
  bytes_accessed: float
  calls: tuple[str, ...]
  compile_seconds: float
  model_flops: float | None = None  # per device per step (train step only)
  peak_flops: float = 0.0
  bandwidth: float = 0.0
  notes: list[str] = field(default_factory=list)
  refused: bool = False  # the compiler refused it for memory: only ``temporaries`` and ``capacity`` are known

  @property
  def needed(self) -> int:
    """Bytes the program holds at most: arguments + outputs - aliased + temporaries + code."""
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  @property
  def fits(self) -> bool:
    return self.needed <= self.capacity

  remat_factor: float = 1.0  # hardware FLOPs per model FLOP: 4/3 with remat=full (the forward again)

  @property
  def loop_scale(self) -> float:
    """How many times XLA's count misses the work: model FLOPs / compiled FLOPs when the compiled
    count is the smaller (a while loop's body counted once: ``scan_layers``, micro-batches), else 1.
    The compiled bytes accessed are scaled by it too (the loop body's traffic taken to scale with its
    FLOPs: an estimate)."""
    if self.model_flops and 0 < self.flops < self.model_flops:
      return self.model_flops / self.flops
    return 1.0

  @property
  def step_seconds(self) -> float:
    """Roofline lower bound of the program's time: max(compute, HBM traffic), the compute at least
    the model FLOPs times ``remat_factor``, both counts scaled by ``loop_scale``."""
    work = max(self.flops * self.loop_scale, (self.model_flops or 0.0) * self.remat_factor)
    return max(work / self.peak_flops, self.bytes_accessed * self.loop_scale / self.bandwidth)

  @property
  def mfu(self) -> float | None:
    """Model FLOPs / (peak x roofline time): an upper bound of the MFU (None without model FLOPs)."""
    if not self.model_flops or not self.step_seconds:
      return None
    return self.model_flops / (self.peak_flops * self.step_seconds)

  def as_dict(self) -> dict:
    keys = ("name", "arguments", "outputs", "aliased", "temporaries", "code", "capacity", "flops")
    out = {k: getattr(self, k) for k in keys}
    out.update(
      bytes_accessed=self.bytes_accessed, calls=list(self.calls), compile_seconds=self.compile_seconds,
      model_flops=self.model_flops, needed=self.needed, fits=self.fits, step_seconds=self.step_seconds,
      mfu=self.mfu, notes=self.notes, refused=self.refused, remat_factor=self.remat_factor,
      peak_flops=self.peak_flops, bandwidth=self.bandwidth,
    )  # fmt: skip
    return out


def _compile(name, lowered, t: targets.Target, capacity: int, start: float) -> ProgramReport:
  try:
    return _compiled_report(name, lowered, t, capacity, start)
  except Exception as err:
    report = refused_for_memory(name, err, t, capacity)
    if report is None:
      raise
    report.compile_seconds = time.perf_counter() - start
    return report


def _compiled_report(name, lowered, t: targets.Target, capacity: int, start: float) -> ProgramReport:
  text = lowered.as_text()
  compiled = lowered.compile()
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list | tuple):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  calls = set(custom_calls(text))
  try:  # the compiled program's own calls (cuBLAS, cuDNN); a multi-device TPU executable has no text
    calls.update(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))
  except Exception:  # noqa: BLE001,S110
    pass
  notes = []
  moved = float(cost.get("bytes accessed", 0.0))
  if not cost:  # XLA:GPU's compiled programs report no cost analysis
    moved = mem.argument_size_in_bytes + mem.output_size_in_bytes
    notes.append(
      "this compiler reports no cost analysis: the roofline takes the model FLOPs and, as bytes "
      "accessed, the arguments read and the outputs written once (a floor)"
    )
  return ProgramReport(
    name=name,
    arguments=int(mem.argument_size_in_bytes),
    outputs=int(mem.output_size_in_bytes),
    aliased=int(mem.alias_size_in_bytes),
    temporaries=int(mem.temp_size_in_bytes),
    code=int(mem.generated_code_size_in_bytes),
    capacity=capacity,
    flops=float(cost.get("flops", 0.0)),
    bytes_accessed=moved,
    calls=tuple(sorted(calls)),
    compile_seconds=time.perf_counter() - start,
    peak_flops=t.spec.peak_flops,
    bandwidth=t.spec.hbm_bandwidth,
    notes=notes,
  )


_OUT_OF_MEMORY = re.compile(
  r"RESOURCE_EXHAUSTED: Ran out of memory in memory space (?:hbm|HBM)|"
  r"RESOURCE_EXHAUSTED: .*?required for ([^(]+?) \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refused_for_memory(name: str, err: Exception, t: targets.Target, capacity: int) -> ProgramReport | None:
  """A ``ProgramReport`` of a program the compiler refused because it does not fit the device's
  HBM (XLA:TPU: ``RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
  temporaries (101.84G) exceeds available HBM (15.75G)``): the sizes the message gives (the
  available HBM as the compiler counts it), ``needed`` above ``capacity``; None for another error."""
  text = str(err)
  match = _OUT_OF_MEMORY.search(text)
  if "RESOURCE_EXHAUSTED" not in text or ("memory" not in text.lower()) or "Shared memory" in text:
    return None
  need, have = capacity + 1, capacity
  if match and match.group(2):
    need = int(float(match.group(2)) * _UNITS[match.group(3)])
    have = int(float(match.group(4)) * _UNITS[match.group(5)])
  first = next((line for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line), text)[:300]
  return ProgramReport(
    name=name, arguments=0, outputs=0, aliased=0, temporaries=need, code=0, capacity=have, flops=0.0,
    bytes_accessed=0.0, calls=(), compile_seconds=0.0, peak_flops=t.spec.peak_flops,
    bandwidth=t.spec.hbm_bandwidth, notes=[f"the compiler refused it: {first.strip()}"], refused=True,
  )  # fmt: skip


def report_from_dict(d: dict) -> ProgramReport:
  """The ``ProgramReport`` of its ``as_dict()`` (the derived keys are recomputed)."""
  derived = ("needed", "fits", "step_seconds", "mfu")
  return ProgramReport(
    **{k: v for k, v in d.items() if k not in derived and k != "calls"}, calls=tuple(d["calls"])
  )


def batch_struct(cfg: TrainConfig, batch_sharding) -> jax.ShapeDtypeStruct:
  """The global batch the train step takes (``input_pipeline.batch_maker``'s shape): ``[B, T + 1]``
  int32 tokens, ``[B, 3, T + 1]`` packed rows (``data.packing``) or ``[B, 2, T + 1]`` for a synthetic
  task (tokens and the answer mask: ``jaxpe.train.tasks``)."""
  shape = input_pipeline.batch_maker(cfg, None)[1]
  return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)


def lower_train_step(cfg: TrainConfig, mesh: jax.sharding.Mesh):
  """The run's train step lowered over ``mesh`` (``jax.stages.Lowered``), as ``jaxpe.train.loop``
  builds it. Raises ValueError for sizes that do not divide the mesh (``sharding.check_divisible``)."""
  micro_batch = cfg.batch_size // cfg.grad_accum_steps
  sharding.check_divisible(cfg.model, mesh, micro_batch, seq_len=cfg.seq_len, rules=cfg.logical_rules)
  graphdef, abstract = state_lib.abstract_state(cfg, mesh)
  state_shardings = jax.tree.map(lambda x: x.sharding, abstract)
  batch_sharding = sharding.batch_sharding(mesh, cfg.logical_rules)
  step = steps.make_train_step(
    graphdef,
    grad_accum_steps=cfg.grad_accum_steps,
    loss_fn=next_token_loss_sum,
    mesh=mesh,
    rules=cfg.logical_rules,
    state_shardings=state_shardings,
    batch_sharding=batch_sharding,
  )
  return step.lower(abstract, batch_struct(cfg, batch_sharding))


def sample_length(cfg: TrainConfig) -> int:
  """The bytes the run's end-of-run sample generates (``evaluation.sample_text``: ``sample_len``,
  clipped to the context learned positions and ``rope_alibi`` can serve)."""
  prompt = len(cfg.sample_prompt.encode())
  m = cfg.model
  limit = {"learned": m.max_len, "rope_alibi": m.rope_alibi_context or m.max_len}.get(m.pos_encoding)
  return cfg.sample_len if limit is None else max(min(cfg.sample_len, limit - prompt), 0)


def lower_generation(cfg: TrainConfig, device):
  """The run's sample (``jaxpe.model.generate``'s program: one prompt row, ``sample_length``
  tokens, temperature 0.8, top-k 40) lowered for one ``device``, or None when the run samples
  nothing."""
  from jaxpe.model import generate as generate_lib  # noqa: PLC0415

  length = sample_length(cfg)
  if length < 1:
    return None
  one = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.asarray([device]), ("chip",)), jax.sharding.PartitionSpec()
  )
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))))
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)  # noqa: E731
  state = jax.tree.map(place, abstract)
  prompt_len = len(cfg.sample_prompt.encode())
  prompt = jax.ShapeDtypeStruct((1, prompt_len), jnp.int32, sharding=one)
  mask = jax.ShapeDtypeStruct((1, prompt_len), jnp.bool_, sharding=one)
  rng = place(jax.eval_shape(lambda: jax.random.key(0)))
  sampling = (0.8, min(40, cfg.model.vocab_size), None)
  return generate_lib._generate.lower(graphdef, state, prompt, mask, rng, length, sampling, None)


def compile_run(
  cfg: TrainConfig, target_name: str, *, generation: bool = True, log=None
) -> list[ProgramReport]:
  """Compiles ``cfg``'s train step (sharded over ``cfg.mesh_shape`` on the target's devices) and,
  with ``generation``, its sample for target ``target_name`` (``targets.TARGETS``).

  Returns:
    one ``ProgramReport`` per program (``train step``, ``generate``), per device of the target.

  Raises:
    ValueError: an unknown target; a mesh the target's devices cannot form (``mesh_shape``) or sizes
      that do not divide it.
    MissingExtraError: the target's compiler is not installed (``targets.check_compiler``).
    Whatever the compiler raises for a program it cannot compile (``MosaicError``, a Triton or
    XLA error: ``RESOURCE_EXHAUSTED`` for shared memory, ...).
  """
  t = targets.target(target_name)
  devices = targets.compile_devices(t)
  capacity = targets.device_memory(t, devices)
  mesh = sharding.make_mesh(cfg.mesh_shape, devices)
  log = log or (lambda _msg: None)
  reports = []
  start = time.perf_counter()
  log(f"compiling the train step for {t.name} ...")
  with targets.cuda_target(t):  # jax's cuDNN rule answers for the target card, not this host
    lowered = lower_train_step(cfg, mesh)
  report = _compile("train step", lowered, t, capacity, start)
  tokens = cfg.batch_size * cfg.seq_len
  report.model_flops = flops.train_flops_per_token(cfg.model, cfg.seq_len) * tokens / len(devices)
  report.remat_factor = 4 / 3 if cfg.model.remat == "full" else 1.0
  if report.loop_scale > 1:
    report.notes.append(
      f"XLA counted {1 / report.loop_scale:.0%} of the model FLOPs (a while loop's body once): the roofline "
      f"scales its FLOPs and bytes by {report.loop_scale:.2f}"
    )
  reports.append(report)
  if generation:
    start = time.perf_counter()
    with targets.cuda_target(t):
      lowered = lower_generation(cfg, devices[0])
    if lowered is not None:
      log(f"compiling the sample's generation for {t.name} ...")
      report = _compile("generate", lowered, t, capacity, start)
      report.notes.append("one prompt row on one device; XLA counts the decode loop's body once")
      reports.append(report)
  return reports
