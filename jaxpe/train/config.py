"""The training run's configuration (``TrainConfig``: data, mesh, optimizer, schedule, checkpoints)
and how it is read: YAML files and ``key=value`` overrides.

Frozen pydantic models like ``jaxpe.model.config.ModelConfig`` (unknown keys forbidden, strict types, ints
accepted for floats), so a YAML typo or a wrong type is an error naming the key. YAML files in ``configs/``
are read by ``load_config`` (a key given twice is refused); ``key=value`` overrides use dotted keys
(``model.d_model=64``) and YAML value syntax (an empty value or a value YAML would cut at a `` #`` comment
is refused; the command lines also refuse a key given twice); ``--data`` sets ``data.path`` verbatim
(``with_data_path``). ``check_fits_memory`` (``jaxpe.train.memory_check``) refuses a run too large for the
devices. The contract of every key: docs/contracts.md.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic

from jaxpe.model import partitioning
from jaxpe.model.config import LogicalRules, ModelConfig, StrictConfig
from jaxpe.model.strict import Length, Steps
from jaxpe.train import tasks
from jaxpe.train.data_config import DataConfig, TaskConfig  # noqa: F401 (TaskConfig: re-exported)
from jaxpe.train.yaml_text import load_yaml_file, parse_value


class DistributedConfig(StrictConfig):
  """Multi-process (multi-host) runs through ``jax.distributed.initialize``.

  Unset values come from the environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID``; what is still unset is left to JAX's cluster detection (SLURM, Open MPI,
  Kubernetes, Cloud TPU).
  """

  enabled: bool | None = pydantic.Field(
    None,
    description="None = initialise when a coordinator address is configured or JAX_COORDINATOR_ADDRESS "
    "is set; true = always (cluster auto-detection); false = never",
  )
  coordinator_address: str | None = pydantic.Field(None, description="host:port of process 0")
  num_processes: int | None = pydantic.Field(None, gt=0, description="processes in the job")
  process_id: int | None = pydantic.Field(None, ge=0, description="this process's index, 0..num_processes-1")
  cpu_collectives: Literal["gloo", "mpi"] = pydantic.Field(
    "gloo", description="collectives between processes on the CPU backend"
  )
  initialization_timeout: int = pydantic.Field(
    60,
    gt=0,
    le=86_400,
    description="seconds to wait for all processes to join (and for a dead peer's heartbeat) before "
    "failing with a message naming what is missing",
  )


class TrainConfig(StrictConfig):
  """One training run."""

  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  workdir: str = pydantic.Field("runs/default", min_length=1, description="run directory (not empty)")
  seed: int = pydantic.Field(0, ge=0, le=2**63 - 1, description="initialisation, batch and sampling seed")
  seq_len: Length = pydantic.Field(256, gt=1, description="tokens (bytes) per training sequence")
  batch_size: int = pydantic.Field(32, gt=0, description="global batch, split over devices")
  num_steps: Steps = pydantic.Field(2000, gt=0, description="optimizer steps of the schedule")
  learning_rate: float = pydantic.Field(3e-3, gt=0, description="peak AdamW learning rate")
  warmup_steps: Steps = pydantic.Field(100, ge=0, description="linear warmup steps")
  min_lr_ratio: float = pydantic.Field(0.1, ge=0, le=1, description="cosine floor, a share of the peak")
  weight_decay: float = pydantic.Field(0.1, ge=0, description="AdamW decoupled weight decay")
  b1: float = pydantic.Field(0.9, ge=0, lt=1, description="Adam beta1")
  b2: float = pydantic.Field(0.95, ge=0, lt=1, description="Adam beta2")
  grad_clip: float = pydantic.Field(1.0, gt=0, description="global-norm gradient clipping")
  eval_every: int = pydantic.Field(500, gt=0, description="held-out evaluation period (steps)")
  eval_batches: int = pydantic.Field(16, gt=0, description="held-out batches per evaluation")
  checkpoint_every: int = pydantic.Field(500, gt=0, description="checkpoint period (steps); also at the end")
  keep_checkpoints: int = pydantic.Field(2, gt=0, description="newest checkpoints kept")
  mesh_shape: tuple[int, int, int, int] = pydantic.Field(
    (-1, 1, 1, 1),
    description="(data, fsdp, tensor, context) mesh axis sizes; one may be -1 = all remaining devices. "
    "(data, fsdp, tensor) is read with context 1, the old (data, model) form as (data, 1, model, 1). "
    "context > 1 splits each sequence over that many devices (seq_len must divide by 2 x context)",
  )
  cpu_devices: Annotated[int, pydantic.Field(ge=1)] | Literal["auto"] = pydantic.Field(
    "auto",
    description="jaxpe-train on CPU: XLA devices the host's cores become, run in parallel by the mesh "
    "(jaxpe.train.host_devices); auto = the most cores the mesh and micro-batch fit, or a fixed mesh's size",
  )
  logical_rules: LogicalRules = LogicalRules()
  grad_accum_steps: int = pydantic.Field(
    1, gt=0, description="micro-batches per optimizer step (batch_size / grad_accum_steps rows each)"
  )
  async_checkpoints: bool = pydantic.Field(
    False,
    description="write checkpoints in the background while the next steps run (a write failure is "
    "then reported at the next save or at the end, not at once)",
  )
  distributed: DistributedConfig = DistributedConfig()
  sample_len: int = pydantic.Field(200, ge=0, description="bytes generated at the end, <= max(max_len, 4096)")
  sample_prompt: str = pydantic.Field("def ", description="prompt of the sample at the end")
  max_seconds: float | None = pydantic.Field(
    None, gt=0, description="stop early (with a checkpoint) after this much training time"
  )
  stop_at: Steps | None = pydantic.Field(None, gt=0, description="stop (with a checkpoint) after this step")
  skip_nonfinite: int = pydantic.Field(
    0,
    ge=0,
    description="steps with a non-finite loss, gradient or update to skip (not applied, batch dropped) "
    "before the run stops; 0 = stop at the first",
  )
  init_from: str | None = pydantic.Field(
    None,
    min_length=1,
    description="workdir of another run (finished, or stopped early) whose latest intact checkpoint's model "
    "parameters start this run when it starts fresh (optimizer, step and schedule fresh; a resume uses the "
    "run's own checkpoint; compared on resume as a directory, however written); null = random init",
  )

  @pydantic.model_serializer(mode="wrap")
  def _omit_unset_init_from(self, handler: Any) -> dict[str, Any]:
    # init_from: null is left out of config.json, checkpoint metadata and every dump, so the configs
    # (and the study's cache keys) of runs without it stay byte-identical to those written before the key.
    out = handler(self)
    if self.init_from is None:
      out.pop("init_from", None)
    return out

  @pydantic.model_validator(mode="before")
  @classmethod
  def _old_mesh_shape(cls, data: Any) -> Any:
    if isinstance(data, dict) and isinstance(data.get("mesh_shape"), (list, tuple)):
      shape = tuple(data["mesh_shape"])
      if len(shape) not in (2, 3, 4):
        raise ValueError(
          "mesh_shape takes 4 sizes (data, fsdp, tensor, context), 3 (data, fsdp, tensor) or the old 2 "
          f"(data, model), got {list(shape)}"
        )
      # (data, model): tensor parallelism as model; (data, fsdp, tensor): context 1.
      shape = (shape[0], 1, shape[1]) if len(shape) == 2 else shape
      data = {**data, "mesh_shape": (*shape, 1) if len(shape) == 3 else shape}
    return data

  @pydantic.model_validator(mode="after")
  def _check_init_from(self) -> TrainConfig:
    if self.init_from is not None and os.path.realpath(self.init_from) == os.path.realpath(self.workdir):
      raise ValueError(
        f"init_from {self.init_from!r} is this run's own workdir: give the workdir of another, finished run "
        "(a run resumes from its own checkpoints without init_from)"
      )
    return self

  @pydantic.model_validator(mode="after")
  def _check_context(self) -> TrainConfig:
    if sum(1 for s in self.mesh_shape if s == -1) > 1 or any(s == 0 or s < -1 for s in self.mesh_shape):
      raise ValueError(
        "mesh_shape (data, fsdp, tensor, context) takes positive sizes and at most one -1, got "
        f"{list(self.mesh_shape)}"
      )
    split = partitioning.sequence_split_size(self.mesh_shape, self.logical_rules)
    if split > 1 and self.seq_len % (2 * split):
      raise ValueError(
        f"seq_len ({self.seq_len}) must be divisible by 2 x {split} = {2 * split} (mesh_shape "
        f"{list(self.mesh_shape)}, logical_rules.length={self.logical_rules.length!r}): context "
        "parallelism cuts each sequence into 2 zig-zag chunks per device"
      )
    if split > 1 and self.model.attn_implementation != "xla":
      raise ValueError(
        f"mesh_shape {list(self.mesh_shape)} splits the sequence over {split} devices, whose attention runs "
        "on the xla backend (jaxpe.attention.context); set model.attn_implementation=xla, got "
        f"{self.model.attn_implementation!r}"
      )
    if self.batch_size % self.grad_accum_steps:
      raise ValueError(
        f"batch_size ({self.batch_size}) must be divisible by grad_accum_steps ({self.grad_accum_steps})"
      )
    m, task = self.model, self.data.task
    if self.data.packing is not None and split > 1:
      raise ValueError(
        f"data.packing runs without context parallelism (mesh_shape {list(self.mesh_shape)}): packed "
        "segment ids are not split over the context axis"
      )
    if task is None and self.data.tokens is None and m.vocab_size < 256:
      raise ValueError(
        f"model.vocab_size ({m.vocab_size}) must be >= 256: the training data is bytes (token ids 0..255)"
      )
    if task is not None:
      tasks.check_task_run(task, vocab_size=m.vocab_size, seq_len=self.seq_len, sample_len=self.sample_len)
      if split > 1:
        raise ValueError(f"data.task runs without context parallelism (mesh_shape {list(self.mesh_shape)})")
    if m.pos_encoding == "learned" and self.seq_len > m.max_len:
      raise ValueError(
        f"seq_len ({self.seq_len}) must be <= model.max_len ({m.max_len}) for learned positions"
      )
    if m.pos_encoding == "rope_alibi" and self.seq_len > (m.rope_alibi_context or m.max_len):
      raise ValueError(
        f"seq_len ({self.seq_len}) must be <= model.rope_alibi_context (or model.max_len when unset) "
        f"= {m.rope_alibi_context or m.max_len} for pos_encoding='rope_alibi': the emulation phase is "
        "bounded only inside that context"
      )
    if m.rope_alibi_in_projection:
      raise ValueError(
        "model.rope_alibi_in_projection=True cannot be trained: its fixed q/k bias vectors and zero "
        "kernel columns are ordinary trainable, weight-decayed parameters and would drift (the form is "
        "for converted checkpoints); train with model.pos_encoding=rope_alibi and "
        "model.rope_alibi_in_projection=false"
      )
    if self.sample_len > (cap := max(m.max_len, 4096)):  # decoding is O(len^2): the context or 4096
      raise ValueError(f"sample_len ({self.sample_len}) must be <= max(model.max_len, 4096) = {cap}")
    if self.sample_len > 0 and not self.sample_prompt:
      raise ValueError("sample_prompt must be non-empty when sample_len > 0 (set sample_len=0 for no sample)")
    if self.sample_len > 0 and m.pos_encoding == "learned" and len(self.sample_prompt.encode()) >= m.max_len:
      raise ValueError(
        f"sample_prompt ({len(self.sample_prompt.encode())} bytes) must be shorter than model.max_len "
        f"({m.max_len}) for learned positions (the sample is clipped to fit max_len)"
      )
    context = m.rope_alibi_context or m.max_len
    if self.sample_len > 0 and m.pos_encoding == "rope_alibi" and len(self.sample_prompt.encode()) >= context:
      raise ValueError(
        f"sample_prompt ({len(self.sample_prompt.encode())} bytes) must be shorter than "
        f"model.rope_alibi_context (or model.max_len when unset) = {context} for pos_encoding='rope_alibi' "
        "(the sample is clipped to fit it)"
      )
    return self


def _set_dotted(tree: dict[str, Any], key: str, value: Any, *, unique: bool) -> None:
  parts = key.split(".")
  if any(not part for part in parts):
    raise ValueError(f"override key {key!r} has an empty part (keys look like model.d_model)")
  node = tree
  for i, part in enumerate(parts[:-1]):
    child = node.setdefault(part, {})
    if not isinstance(child, dict):
      if unique:
        raise ValueError(
          f"override {key!r}: {'.'.join(parts[: i + 1])!r} is already given as a value; give each key once"
        )
      raise ValueError(f"override {key!r}: {part!r} is not a section")
    node = child
  if unique and parts[-1] in node:
    raise ValueError(f"override {key!r} is given twice (or inside a section given twice); give each key once")
  node[parts[-1]] = value


def parse_overrides(overrides: list[str], *, unique: bool = False) -> dict[str, Any]:
  """Turns ``["a.b=1", "c=x"]`` into a nested dict; values use YAML syntax (``jaxpe.train.yaml_text.parse_value``).

  Args:
    overrides: ``key=value`` strings, dotted keys.
    unique: refuse a key given twice (``a=1 a=2``, or ``model={d_model: 64} model.d_model=32``), as
      the command lines do; otherwise (the library default, so scripts can layer overrides) a later
      value replaces an earlier one.

  Raises:
    TypeError: an override that is not a string.
    ValueError: an override without ``=``, with an empty key or key part (``a..b``), with an empty
      value (write ``key=null`` for null), whose value is not valid YAML, repeats a key inside a
      mapping value, or holds a YAML comment (`` #`` outside quotes: quote the value); with
      ``unique``, a key given twice.
  """
  if isinstance(overrides, str):
    raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
  tree: dict[str, Any] = {}
  for item in overrides:
    if not isinstance(item, str):
      raise TypeError(f"overrides must be strings 'key=value', got {type(item).__name__} {item!r}")
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
      raise ValueError(f"override must look like key=value, got {item!r}")
    _set_dotted(tree, key.strip(), parse_value(raw, key.strip()), unique=unique)
  return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
  out = dict(base)
  for key, value in extra.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = _merge(out[key], value)
    else:
      out[key] = value
  return out


def with_data_path(
  raw: dict[str, Any], data_path: str | None, *, section: tuple[str, ...] = ()
) -> dict[str, Any]:
  """``raw`` with ``data.path`` (under ``section``, e.g. ``("train",)`` for a study) set to
  ``data_path`` verbatim (``--data``: never YAML-parsed, so ``null``, ``~`` or ``a #2.txt`` are
  file names). None leaves ``raw`` unchanged.

  Raises:
    TypeError: ``data_path`` is not a string.
    ValueError: ``data_path`` is empty, or ``data.path`` is also given as an override.
    FileNotFoundError: nothing exists at ``data_path`` (named).
  """
  if data_path is None:
    return raw
  if not isinstance(data_path, str):
    raise TypeError(f"--data takes a path string, got {type(data_path).__name__}")
  if not data_path:
    raise ValueError(
      "--data got an empty path; give a text file or a directory (leave --data out for the default)"
    )
  if not Path(data_path).exists():
    raise FileNotFoundError(f"--data: data path {data_path!r} does not exist")
  return _merge(raw, _nest((*section, "data"), {"path": data_path}))


def _nest(keys: tuple[str, ...], leaf: dict[str, Any]) -> dict[str, Any]:
  for key in reversed(keys):
    leaf = {key: leaf}
  return leaf


def _renamed_model_keys(tree: dict[str, Any]) -> dict[str, Any]:
  """``model.attention_impl`` (the old key) read as ``model.attn_implementation`` within one source
  (a file or the overrides), so an old key given as an override still wins over a file that sets
  the new one; both in one source are ``ModelConfig``'s error."""
  model = tree.get("model") if isinstance(tree, dict) else None
  if not isinstance(model, dict) or "attention_impl" not in model or "attn_implementation" in model:
    return tree
  warnings.warn(
    "ModelConfig key attention_impl is renamed attn_implementation (HF's name); the old key will be removed",
    FutureWarning,
    stacklevel=3,
  )
  renamed = {("attn_implementation" if k == "attention_impl" else k): v for k, v in model.items()}
  return {**tree, "model": renamed}


def load_config(
  path: str | Path | None = None,
  overrides: list[str] = (),
  *,
  data_path: str | None = None,
  unique_overrides: bool = False,
) -> TrainConfig:
  """Reads a YAML config (or the defaults), applies ``key=value`` overrides and ``data_path``, and validates.

  Args:
    path: a YAML file of ``TrainConfig`` keys, or None for the defaults.
    overrides: ``key=value`` strings (``parse_overrides``), applied over the file.
    data_path: ``--data``: sets ``data.path`` verbatim (``with_data_path``); cannot be combined
      with a ``data.path=`` override.
    unique_overrides: refuse a key given twice in ``overrides`` (the command line); else a later
      override replaces an earlier one.

  Raises:
    FileNotFoundError: ``path`` or ``data_path`` does not exist.
    ValueError: an unknown key, a wrong type or an out-of-range value (pydantic's
      ``ValidationError``, a ``ValueError``, names the dotted key); a file that is not UTF-8, not valid YAML or
      gives a key twice (named with the line); a bad override (``parse_overrides``).
  """
  raw: dict[str, Any] = load_yaml_file(path) if path is not None else {}
  if isinstance(overrides, str):
    raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
  extra = parse_overrides(list(overrides), unique=unique_overrides)
  if data_path is not None and isinstance(extra.get("data"), dict) and "path" in extra["data"]:
    raise ValueError("--data and the override data.path= both set the data path; give one")
  raw, extra = _renamed_model_keys(raw), _renamed_model_keys(extra)
  raw = with_data_path(_merge(raw, extra), data_path)
  # YAML lists become the schema's tuples in TrainConfig's and LogicalRules' "before" validators.
  return TrainConfig.model_validate(raw)
