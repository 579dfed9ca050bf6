"""Typed, validated configuration: the model (``ModelConfig``) and the training run (``TrainConfig``).

Both are frozen pydantic models that forbid unknown keys and coerce nothing silently (strict
types, ints accepted for floats), so a YAML typo or a wrong type is an error naming the key.
YAML files in ``configs/`` are read by ``load_config`` (a key given twice is refused);
``key=value`` overrides use dotted keys (``model.d_model=64``) and YAML value syntax (an empty value
or a value YAML would cut at a `` #`` comment is refused; the command lines also refuse a key given
twice); ``--data`` sets ``data.path`` verbatim (``with_data_path``). ``check_fits_memory`` refuses
a run too large for the devices. The contract of every key: docs/contracts.md.
"""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

PosEncoding = Literal["none", "learned", "sinusoidal", "rope", "xpos", "alibi", "rope_alibi"]
POS_ENCODINGS: tuple[str, ...] = typing.get_args(PosEncoding)
DType = Literal["float32", "bfloat16", "float16"]
AttentionImpl = Literal["xla", "cudnn", "splash", "pallas_gpu", "auto"]
Remat = Literal["none", "full", "dots_saveable"]
MeshAxis = Literal["data", "fsdp", "tensor"]
MESH_AXES: tuple[str, ...] = typing.get_args(MeshAxis)


class _Strict(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class RopeScalingConfig(_Strict):
  """HF-style ``rope_scaling`` / ``rope_parameters`` entry; see ``jaxpe.rope_scaling.rope_frequencies``.

  A YAML mapping with HF's keys, spelled as transformers v4 (``rope_scaling``, ``type``) or v5
  (``rope_parameters`` with ``rope_theta`` and ``partial_rotary_factor`` inside). The spelling is
  settled by ``jaxpe.rope_scaling.normalize_rope_parameters`` (``type`` -> ``rope_type``, legacy
  ``"su"`` -> ``"longrope"``, unknown keys and types refused); values are checked by
  ``rope_frequencies`` when ``ModelConfig`` validates. Lists become tuples so the config stays
  hashable. Unset keys are left out of ``as_dict()``.
  """

  rope_type: str = "default"
  rope_theta: float | None = pydantic.Field(None, gt=0, description="overrides ModelConfig.rope_theta")
  partial_rotary_factor: float | None = pydantic.Field(
    None, gt=0, le=1, description="rotary_dim = int(head_dim * partial_rotary_factor)"
  )
  factor: float | None = pydantic.Field(None, gt=0)
  original_max_position_embeddings: int | None = pydantic.Field(None, gt=0)
  attention_factor: float | None = pydantic.Field(None, gt=0)
  beta_fast: float | None = None
  beta_slow: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  short_factor: tuple[float, ...] | None = None
  long_factor: tuple[float, ...] | None = None

  @pydantic.model_validator(mode="before")
  @classmethod
  def _from_hf_dict(cls, data: Any) -> Any:
    if isinstance(data, dict):
      from jaxpe.ops.rope_scaling import normalize_rope_parameters

      kind = data.get("rope_type", data.get("type"))
      if kind is not None and not isinstance(kind, str):
        raise ValueError(f"rope_type must be a string such as 'linear' or 'yarn', got {kind!r}")
      data = normalize_rope_parameters(data)
      data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return data

  def as_dict(self) -> dict[str, Any]:
    """The HF-style dict (set keys only) for ``jaxpe.rope_scaling.rope_frequencies``."""
    return {
      k: (list(v) if isinstance(v, tuple) else v) for k, v in self.model_dump().items() if v is not None
    }


class ModelConfig(_Strict):
  """Decoder hyper-parameters. Shape letters: V vocab, D model dim, N heads, K kv heads, H head
  dim, F MLP dim, L layers."""

  vocab_size: int = pydantic.Field(256, gt=0, description="V; 256 for byte-level text")
  d_model: int = pydantic.Field(128, gt=0, description="D")
  num_layers: int = pydantic.Field(4, gt=0, description="L")
  num_heads: int = pydantic.Field(4, gt=0, description="N query heads")
  num_kv_heads: int | None = pydantic.Field(None, gt=0, description="K; default N (MHA)")
  head_dim: int | None = pydantic.Field(None, gt=0, description="H; default D // N")
  mlp_dim: int | None = pydantic.Field(None, gt=0, description="F; default 4 D")
  max_len: int = pydantic.Field(256, gt=0, description="longest context in tokens")
  pos_encoding: PosEncoding = "rope"
  rope_theta: float = pydantic.Field(10000.0, gt=0, description="RoPE base")
  rotary_dim: int | None = pydantic.Field(None, gt=0, description="rotating dims; default H")
  rope_layout: Literal["interleaved", "half"] = "interleaved"
  alibi_heads: int | None = pydantic.Field(
    None,
    gt=0,
    description="alibi only: the first k heads get ALiBi (slopes of a k-head model), the rest none",
  )
  rope_scaling: RopeScalingConfig | None = pydantic.Field(
    None,
    description="HF-style rope_scaling dict for rope/xpos; length-dependent types (dynamic, longrope) "
    "are evaluated at seq_len = max_len",
  )
  rope_alibi_max_phase: float = pydantic.Field(
    0.1, gt=0, lt=math.pi / 2, description="largest emulation phase over rope_alibi_context"
  )
  rope_alibi_context: int | None = pydantic.Field(
    None, gt=0, description="context the emulation is tuned for; default max_len"
  )
  rope_alibi_order: int = pydantic.Field(
    1, ge=1, le=8, description="k emulation pairs at theta..k theta (jaxpe.emulation); 1 = published form"
  )
  rope_alibi_in_projection: bool = pydantic.Field(
    False,
    description="rope_alibi with the two extra dims realised by the q/k projections (H + 2 outputs per "
    "head: zero kernel columns, biases carry the fixed vectors); needs use_bias and float32",
  )
  attention_impl: AttentionImpl = pydantic.Field(
    "xla",
    description="attention backend (jaxpe.kernels): xla (einsum reference), cudnn (cuDNN flash attention, "
    "NVIDIA GPU), splash (TPU), pallas_gpu (Triton), auto (splash on TPU, cudnn on GPU, else xla); "
    "KV-cache decoding always runs on xla",
  )
  attention_interpret: bool = pydantic.Field(
    False, description="run the Pallas kernels (splash, pallas_gpu) in interpret mode (CPU tests)"
  )
  alibi_emulation: Literal["exact", "rotated"] = pydantic.Field(
    "exact",
    description="how pos_encoding='alibi' reaches bias-free kernels: exact (augmented form in bf16-exact "
    "parts, 18 extra dims up to 65536 positions) or rotated (order rope_alibi_order, theta from "
    "rope_alibi_max_phase / rope_alibi_context, 18 k extra dims, the solver's bound)",
  )
  use_bias: bool = False
  embed_layernorm: bool = False
  layernorm_eps: float = pydantic.Field(1e-5, gt=0)
  gelu_approximate: bool = False
  tie_embeddings: bool = True
  dtype: DType = "float32"
  init_std: float = pydantic.Field(0.02, gt=0)
  scan_layers: bool = pydantic.Field(
    False,
    description="one compiled block run by nnx.scan over parameters stacked on a leading 'layers' axis "
    "(compile time independent of num_layers); the same parameters as the loop, stacked",
  )
  remat: Remat = pydantic.Field(
    "none",
    description="rematerialise each block in the backward pass: none (keep activations), full (keep "
    "only block inputs) or dots_saveable (keep matmul outputs, recompute the rest)",
  )

  @pydantic.model_validator(mode="before")
  @classmethod
  def _rope_theta_from_scaling(cls, data: Any) -> Any:
    """One base: a ``rope_scaling`` dict's ``rope_theta`` (transformers v5) becomes ``rope_theta``
    when that is not given, so ``cfg.rope_theta`` is the base the model uses and a dumped config
    validates again (the two are checked to agree after validation)."""
    if isinstance(data, dict) and data.get("rope_theta") is None:
      scaling = data.get("rope_scaling")
      theta = scaling.get("rope_theta") if isinstance(scaling, dict) else getattr(scaling, "rope_theta", None)
      if theta is not None:
        data = {**data, "rope_theta": theta}
    return data

  @pydantic.model_validator(mode="after")
  def _check_sizes(self) -> ModelConfig:
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
        f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}) unless head_dim is given"
      )
    if self.num_heads % self.kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads})")
    if self.pos_encoding in ("rope", "rope_alibi") and self.head_size % 2:
      raise ValueError(f"head_dim must be even for pos_encoding={self.pos_encoding!r}, got {self.head_size}")
    if self.rope_alibi_in_projection and (
      self.pos_encoding != "rope_alibi" or not self.use_bias or self.dtype != "float32"
    ):
      raise ValueError(
        "rope_alibi_in_projection=True needs pos_encoding='rope_alibi', use_bias=True and dtype='float32', "
        f"got pos_encoding={self.pos_encoding!r}, use_bias={self.use_bias}, dtype={self.dtype!r}"
      )
    if self.rope_alibi_in_projection and self.rope_alibi_order != 1:
      raise ValueError(f"rope_alibi_in_projection=True needs rope_alibi_order=1, got {self.rope_alibi_order}")
    if self.rotary_dim is not None and self.pos_encoding not in ("rope", "xpos"):
      raise ValueError(
        f"rotary_dim is only used by pos_encoding 'rope' or 'xpos', got rotary_dim={self.rotary_dim} "
        f"with pos_encoding={self.pos_encoding!r} (leave rotary_dim unset)"
      )
    if self.pos_encoding in ("rope", "xpos") and self.rotary_dim is not None:
      if self.rotary_dim % 2 or self.rotary_dim > self.head_size:
        raise ValueError(f"rotary_dim must be even and <= head_dim ({self.head_size}), got {self.rotary_dim}")
    if self.pos_encoding == "xpos" and self.head_size % 2:
      raise ValueError(f"head_dim must be even for pos_encoding='xpos', got {self.head_size}")
    if self.pos_encoding == "sinusoidal" and self.d_model % 2:
      raise ValueError(f"d_model must be even for pos_encoding='sinusoidal', got {self.d_model}")
    if self.alibi_heads is not None and (self.pos_encoding != "alibi" or self.alibi_heads > self.num_heads):
      raise ValueError(
        f"alibi_heads needs pos_encoding='alibi' and must be <= num_heads ({self.num_heads}), "
        f"got alibi_heads={self.alibi_heads} with pos_encoding={self.pos_encoding!r}"
      )
    if self.rope_scaling is not None:
      if self.pos_encoding not in ("rope", "xpos"):
        raise ValueError(f"rope_scaling needs pos_encoding 'rope' or 'xpos', got {self.pos_encoding!r}")
      theta = self.rope_scaling.rope_theta
      if theta is not None and "rope_theta" in self.model_fields_set and theta != self.rope_theta:
        raise ValueError(
          f"rope_theta ({self.rope_theta}) and rope_scaling.rope_theta ({theta}) differ; set one of them"
        )
      self.rope_frequencies()  # validates the scaling keys (ValueError naming them)
      kind = self.rope_scaling.rope_type
      orig = self.rope_scaling.original_max_position_embeddings
      if kind in ("dynamic", "longrope") and (orig is None or orig >= self.max_len):
        # The decoder evaluates these length-dependent types at seq_len = max_len, so they change
        # the frequencies only when the pretraining length is below max_len.
        raise ValueError(
          f"rope_scaling.original_max_position_embeddings must be set and < max_len ({self.max_len}) "
          f"for rope_type={kind!r} (evaluated at seq_len = max_len), got {orig}"
        )
    if self.alibi_emulation == "rotated" and self.alibi_heads is not None:
      raise ValueError(
        "alibi_emulation='rotated' needs ALiBi on every head (slopes > 0); use alibi_emulation='exact' "
        f"with alibi_heads={self.alibi_heads}"
      )
    if self.pos_encoding == "xpos" and self.max_len > 65536:
      # xPos scales zeta^((p - offset) / scale_base) with offset = max_len // 2 overflow float32
      # beyond |p - offset| ~ 35,000.
      raise ValueError(f"max_len must be <= 65536 for pos_encoding='xpos', got {self.max_len}")
    return self

  def rope_frequencies(self):
    """``(inv_freq [R/2] float32, attention_factor)`` for rope/xpos, from ``rope_scaling``.

    ``max_position_embeddings`` and ``seq_len`` are ``max_len``, so the frequencies are fixed for a
    model (cached decoding equals the full forward pass).
    """
    from jaxpe.ops.rope_scaling import rope_frequencies

    return rope_frequencies(
      None if self.rope_scaling is None else self.rope_scaling.as_dict(),
      head_dim=self.head_size,
      rope_theta=self.rope_theta,
      rotary_dim=self.rotary_dim,
      max_position_embeddings=self.max_len,
      seq_len=self.max_len,
    )

  @property
  def head_size(self) -> int:
    """H."""
    return self.head_dim or self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    """K."""
    return self.num_kv_heads or self.num_heads

  @property
  def mlp_size(self) -> int:
    """F."""
    return self.mlp_dim or 4 * self.d_model


class DataConfig(_Strict):
  """Byte-level text data."""

  path: str | None = pydantic.Field(
    None,
    min_length=1,
    description="text file or directory of text files, taken verbatim (no ~ expansion); None = Python "
    "stdlib sources. ``--data PATH`` sets it without YAML parsing",
  )
  max_bytes: int = pydantic.Field(
    16_000_000,
    gt=0,
    description="cap on corpus bytes read: eval_fraction of it held-out, the rest training (each side's "
    "files in sorted order)",
  )
  eval_fraction: float = pydantic.Field(
    0.05, gt=0, lt=1, description="held-out share of files (by path hash) or of a single file's bytes"
  )
  allow_changed: bool = pydantic.Field(
    False,
    description="resume although the data's bytes changed since the checkpoint (its fingerprint "
    "differs); the batch stream then differs from the saved run's. false = refuse such a resume",
  )


Axes = MeshAxis | tuple[MeshAxis, ...] | None


class LogicalRules(_Strict):
  """Where each logical axis of parameters and activations goes on the mesh ``(data, fsdp, tensor)``.

  A value is one mesh axis, a list of them (the dimension is split over their product) or null
  (replicated). Within one array a mesh axis is used once: a later dimension whose axis is already
  taken is replicated (activations ``[B, T, D]`` are ``(batch, length, embed)``, so with the
  defaults B is split over ``data`` x ``fsdp`` and D, whose ``fsdp`` is taken, is not). Defaults:
  data parallelism over ``data``, FSDP over ``fsdp`` (parameters and optimizer state split along D,
  the batch over ``data`` x ``fsdp``), tensor parallelism over ``tensor`` (heads, MLP, vocab).
  """

  batch: Axes = ("data", "fsdp")
  length: Axes = None
  embed: Axes = "fsdp"
  heads: Axes = "tensor"
  kv_heads: Axes = "tensor"
  head_dim: Axes = None
  mlp: Axes = "tensor"
  vocab: Axes = "tensor"
  pos: Axes = None
  layers: Axes = None

  @pydantic.model_validator(mode="before")
  @classmethod
  def _lists_to_tuples(cls, data: Any) -> Any:
    if isinstance(data, dict):
      data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return data

  @pydantic.model_validator(mode="after")
  def _check_repeats(self) -> LogicalRules:
    for name, axes in self.as_tuple():
      if axes == ():
        raise ValueError(f"logical_rules.{name} is an empty list; write null for a replicated dimension")
      if isinstance(axes, tuple) and len(set(axes)) != len(axes):
        raise ValueError(f"logical_rules.{name} names a mesh axis twice: {list(axes)}")
    return self

  def as_tuple(self) -> tuple[tuple[str, Any], ...]:
    """``((logical name, mesh axes or None), ...)`` in field order."""
    return tuple((name, getattr(self, name)) for name in type(self).model_fields)


class DistributedConfig(_Strict):
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
  num_processes: int | None = pydantic.Field(None, gt=0)
  process_id: int | None = pydantic.Field(None, ge=0)
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


class TrainConfig(_Strict):
  """One training run."""

  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  workdir: str = pydantic.Field("runs/default", min_length=1, description="run directory (not empty)")
  seed: int = pydantic.Field(0, ge=0, le=2**63 - 1, description="initialisation, batch and sampling seed")
  seq_len: int = pydantic.Field(256, gt=1)
  batch_size: int = pydantic.Field(32, gt=0, description="global batch, split over devices")
  num_steps: int = pydantic.Field(2000, gt=0)
  learning_rate: float = pydantic.Field(3e-3, gt=0)
  warmup_steps: int = pydantic.Field(100, ge=0)
  min_lr_ratio: float = pydantic.Field(0.1, ge=0, le=1)
  weight_decay: float = pydantic.Field(0.1, ge=0)
  b1: float = pydantic.Field(0.9, ge=0, lt=1)
  b2: float = pydantic.Field(0.95, ge=0, lt=1)
  grad_clip: float = pydantic.Field(1.0, gt=0)
  eval_every: int = pydantic.Field(500, gt=0)
  eval_batches: int = pydantic.Field(16, gt=0)
  checkpoint_every: int = pydantic.Field(500, gt=0)
  keep_checkpoints: int = pydantic.Field(2, gt=0)
  mesh_shape: tuple[int, int, int] = pydantic.Field(
    (-1, 1, 1),
    description="(data, fsdp, tensor) mesh axis sizes; one may be -1 = all remaining devices. The old "
    "(data, model) form is read as (data, 1, model)",
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
  sample_len: int = pydantic.Field(200, ge=0, description="bytes generated at the end")
  sample_prompt: str = "def "
  max_seconds: float | None = pydantic.Field(
    None, gt=0, description="stop early (with a checkpoint) after this much training time"
  )
  stop_at: int | None = pydantic.Field(
    None, gt=0, description="stop (with a checkpoint) after this step; rerun to resume"
  )
  skip_nonfinite: int = pydantic.Field(
    0,
    ge=0,
    description="steps with a non-finite loss, gradient or update to skip (not applied, batch dropped) "
    "before the run stops; 0 = stop at the first",
  )

  @pydantic.model_validator(mode="before")
  @classmethod
  def _old_mesh_shape(cls, data: Any) -> Any:
    if isinstance(data, dict) and isinstance(data.get("mesh_shape"), (list, tuple)):
      shape = tuple(data["mesh_shape"])
      if len(shape) not in (2, 3):
        raise ValueError(
          f"mesh_shape takes 3 sizes (data, fsdp, tensor) or the old 2 (data, model), got {list(shape)}"
        )
      # (data, model) from configs and checkpoints before the fsdp axis: model is tensor parallelism.
      data = {**data, "mesh_shape": (shape[0], 1, shape[1]) if len(shape) == 2 else shape}
    return data

  @pydantic.model_validator(mode="after")
  def _check_context(self) -> TrainConfig:
    if sum(1 for s in self.mesh_shape if s == -1) > 1 or any(s == 0 or s < -1 for s in self.mesh_shape):
      raise ValueError(
        f"mesh_shape (data, fsdp, tensor) takes positive sizes and at most one -1, got {list(self.mesh_shape)}"
      )
    if self.batch_size % self.grad_accum_steps:
      raise ValueError(
        f"batch_size ({self.batch_size}) must be divisible by grad_accum_steps ({self.grad_accum_steps})"
      )
    m = self.model
    if m.vocab_size < 256:
      raise ValueError(
        f"model.vocab_size ({m.vocab_size}) must be >= 256: the training data is bytes (token ids 0..255)"
      )
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
  """Turns ``["a.b=1", "c=x"]`` into a nested dict; values use YAML syntax (``_parse_value``).

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
    _set_dotted(tree, key.strip(), _parse_value(raw, key.strip()), unique=unique)
  return tree


class _UniqueKeyLoader(yaml.SafeLoader):
  """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML keeps the last)."""

  def construct_mapping(self, node, deep=False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=True)
      line = key_node.start_mark.line + 1
      if key in seen:
        raise yaml.constructor.ConstructorError(
          None, None, f"duplicate key {key!r} (first given on line {seen[key]})", key_node.start_mark
        )
      seen[key] = line
    return super().construct_mapping(node, deep=deep)


def _read_text(path: Path, source: str) -> str:
  """``path``'s UTF-8 text.

  Raises:
    ValueError: bytes that are not UTF-8, naming ``source``, the line and the byte.
  """
  data = path.read_bytes()
  try:
    return data.decode()
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise ValueError(f"{source} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None


def _load_yaml(text: str, source: str) -> Any:
  """Parses YAML ``text``; errors name ``source`` (a file or an override) and the line.

  Raises:
    ValueError: invalid YAML or a duplicate key.
  """
  try:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e)
    raise ValueError(f"{source}{where}: {problem}") from None


def _parse_value(raw: str, key: str = "") -> Any:
  """YAML value syntax, plus unquoted numbers YAML 1.1 reads as strings (``1e-2``); quoted values
  (``'1e3'``) stay strings. The value's type is then checked by the schema (strict: ``workdir=1e3``
  or ``sample_prompt=yes`` are refused, not turned into strings).

  Raises:
    ValueError: an empty value, invalid YAML, or text after the value that YAML would drop as a
      comment (``path=my text #2.txt`` would read ``my text``).
  """
  where = f"override {key}={raw!r}" if key else f"override value {raw!r}"
  if not raw.strip():
    raise ValueError(
      f"{where} has no value; write {key or 'key'}=null for null or quote an empty string ('')"
    )
  value = _load_yaml(raw, where)
  try:
    node = yaml.compose(raw, Loader=yaml.SafeLoader)
  except yaml.YAMLError:  # pragma: no cover (parsed above)
    node = None
  if node is None or raw[node.end_mark.index :].strip():
    raise ValueError(
      f"{where}: YAML reads the text after ' #' as a comment and drops it; quote the value "
      f"({key or 'key'}='...') to keep it"
    )
  if isinstance(value, str) and raw.strip()[:1] not in ("'", '"'):
    try:
      return float(value)
    except ValueError:
      pass
  return value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
  out = dict(base)
  for key, value in extra.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = _merge(out[key], value)
    else:
      out[key] = value
  return out


def load_yaml_file(path: str | Path, what: str = "config file") -> dict[str, Any]:
  """The mapping in the YAML file ``path`` (``{}`` for an empty file).

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: a directory, not UTF-8, not valid YAML, a key given twice in one mapping (named with its line),
      or not a mapping at the top.
  """
  path = Path(path)
  source = f"{what} {str(path)!r}"
  if path.is_dir():
    raise ValueError(f"{source} is a directory; give a YAML file")
  if not path.is_file():
    raise FileNotFoundError(f"{source} does not exist")
  raw = _load_yaml(_read_text(path, source), source)
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ValueError(f"{source} must hold a mapping, got {type(raw).__name__}")
  return raw


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
  raw = with_data_path(_merge(raw, extra), data_path)
  # YAML lists become the schema's tuples in TrainConfig's and LogicalRules' "before" validators.
  return TrainConfig.model_validate(raw)
