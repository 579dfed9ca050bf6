"""The model's typed, validated configuration: ``ModelConfig`` (with ``RopeScalingConfig``) and the
logical axis rules (``LogicalRules``) that place its parameters and activations on a mesh.

Frozen pydantic models that forbid unknown keys and coerce nothing silently (strict types, ints
accepted for floats), so a typo or a wrong type is an error naming the key. The training run's
configuration and the YAML / ``key=value`` loading are ``jaxpe.train.config``'s. The contract of
every key: docs/contracts.md.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import pydantic
from pydantic_core import PydanticCustomError

from jaxpe.model import bias_options, pattern_options, rope_options
from jaxpe.model.config_sections import (  # noqa: F401 (re-exported: their historical home)
  MESH_AXES,
  Axes,
  LogicalRules,
  MeshAxis,
  RopeScalingConfig,
)
from jaxpe.model.strict import EMULATION_MAX_POSITION, MAX_DIM, MAX_POSITION, StrictConfig
from jaxpe.ops import rope_scaling as rope_scaling_lib

POS_ENCODINGS: tuple[str, ...] = (
  *("none", "learned", "sinusoidal", "rope", "xpos", "alibi", "rope_alibi"),
  *("cope", "t5", "kerple_log", "kerple_power", "fire"),
)
"""The built-in encodings, in the order ``jaxpe/model/encodings/`` registers them (tests check it)."""
ENCODINGS: dict[str, Any] = {}
"""``pos_encoding`` name -> encoding class (``jaxpe.model.encodings.REGISTRY`` is this dict; its
``register`` fills it, ``ModelConfig`` reads it: the registry imports the config, not the reverse)."""
PosEncoding = Literal[POS_ENCODINGS]
"""The names in ``POS_ENCODINGS`` as a type."""
DType = Literal["float32", "bfloat16", "float16"]
AttentionImpl = Literal["xla", "cudnn", "splash", "pallas_gpu", "flash", "auto"]
Remat = Literal["none", "full", "dots_saveable"]
LayerType = Literal["full_attention", "sliding_attention", "chunked_attention"]
"""HF's ``layer_types`` entries (``jaxpe.model.pattern_options``)."""


class ModelConfig(StrictConfig):
  """Decoder hyper-parameters. Shape letters: V vocab, D model dim, N heads, K kv heads, H head
  dim, F MLP dim, L layers."""

  omit_at_default = ("param_dtype",)  # added later: older configs and cache keys unchanged
  vocab_size: int = pydantic.Field(256, gt=0, description="V; 256 for byte-level text")
  d_model: int = pydantic.Field(128, le=MAX_DIM, gt=0, description="D")
  num_layers: int = pydantic.Field(4, gt=0, description="L")
  num_heads: int = pydantic.Field(4, le=MAX_DIM, gt=0, description="N query heads")
  num_kv_heads: int | None = pydantic.Field(None, le=MAX_DIM, gt=0, description="K; default N (MHA)")
  head_dim: int | None = pydantic.Field(None, le=MAX_DIM, gt=0, description="H; default D // N")
  mlp_dim: int | None = pydantic.Field(None, gt=0, description="F; default 4 D")
  max_len: int = pydantic.Field(256, le=MAX_POSITION, gt=0, description="longest context in tokens")
  pos_encoding: str = pydantic.Field(
    "rope",
    description="a registered positional encoding (jaxpe.model.encodings.REGISTRY): none, learned, "
    "sinusoidal, rope, xpos, alibi, rope_alibi, cope, t5, kerple_log, kerple_power, fire",
  )
  rope_theta: float = pydantic.Field(10000.0, gt=0, description="RoPE base")
  rotary_dim: int | None = pydantic.Field(None, le=MAX_DIM, gt=0, description="rotating dims; default H")
  rope_layout: Literal["interleaved", "half"] = pydantic.Field("interleaved", description="pairs' layout")
  alibi_heads: int | None = pydantic.Field(
    None,
    le=MAX_DIM,
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
    None, le=EMULATION_MAX_POSITION, gt=0, description="context the emulation is tuned for; default max_len"
  )
  rope_alibi_order: int = pydantic.Field(
    1, ge=1, le=8, description="k emulation pairs at theta..k theta (jaxpe.emulation); 1 = published form"
  )
  rope_alibi_content_rope: bool = pydantic.Field(
    False,
    description="rope_alibi: the content dims also rotate, at rope_frequencies() (rope_theta, rotary_dim, "
    "rope_scaling, rope_proportion, rope_layout): RoPE and emulated ALiBi in one head; False = content at "
    "frequency 0 (the published form)",
  )
  no_rope_layers: tuple[int, ...] | None = pydantic.Field(
    None,
    description="per-layer RoPE schedule (HF Llama 4 / SmolLM3): num_layers entries, 1 = the layer rotates "
    "q and k, 0 = NoPE layer; for rope, xpos and rope_alibi with rope_alibi_content_rope; default all rotate",
  )
  no_rope_layer_interval: int | None = pydantic.Field(
    None,
    gt=0,
    description="every n-th layer NoPE: layer i rotates iff (i + 1) % n != 0 (transformers' default "
    "no_rope_layers of Llama4TextConfig / SmolLM3Config); not with no_rope_layers",
  )
  rope_proportion: float | None = pydantic.Field(
    None,
    gt=0,
    le=1,
    description="p-RoPE (arXiv 2410.06205, gemma's name): the highest int(p * H // 2) frequencies rotate "
    "(rope_theta ** (-2i / H)), the rest are 0; rope or the rope_alibi hybrid; with rope_scaling only "
    "'linear' (gemma's scale_factor), never with rotary_dim",
  )
  rope_alibi_in_projection: bool = pydantic.Field(
    False,
    description="rope_alibi with the two extra dims realised by the q/k projections (H + 2 outputs per "
    "head: zero kernel columns, biases carry the fixed vectors); needs use_bias and float32",
  )
  attn_implementation: AttentionImpl = pydantic.Field(
    "xla",
    description="attention backend (jaxpe.attention.kernels; HF's word; old key attention_impl: a DeprecationWarning): "
    "xla (blockwise XLA), cudnn (NVIDIA GPU), splash (TPU), pallas_gpu (Triton), flash (jaxpe's Pallas kernel, "
    "native ALiBi), auto (per lowering platform: splash/flash on TPU, cudnn/flash on GPU, xla on CPU and for "
    "what a kernel refuses); KV-cache decoding runs on xla",
  )
  attention_interpret: bool = pydantic.Field(
    False, description="run the Pallas kernels (splash, pallas_gpu, flash) in interpret mode (CPU tests)"
  )
  alibi_emulation: Literal["lean", "exact", "rotated"] = pydantic.Field(
    "lean",
    description="how pos_encoding='alibi' reaches bias-free kernels: lean (m_h (j - j0), ALiBi up to a "
    "per-row constant; keys carry positions shared by every kv head; 2..6 bf16-exact extra dims up to "
    "65536 positions), exact (augmented form in bf16-exact "
    "parts, 18 extra dims up to 65536 positions) or rotated (order rope_alibi_order, theta from "
    "rope_alibi_max_phase / rope_alibi_context, 18 k extra dims, the solver's bound)",
  )
  attention_sinks: bool = pydantic.Field(
    False,
    description="a learned sink logit per head and layer in the softmax denominator (gpt-oss; arXiv "
    "2309.17453; jaxpe.attention.sinks), with any pos_encoding; runs on xla, splash and flash",
  )
  cope_npos_max: int | None = pydantic.Field(
    None,
    le=MAX_POSITION,
    gt=0,
    description="cope only: P, the number of integer CoPE positions (counts clamp at P - 1); default max_len",
  )
  relative_attention_num_buckets: int = pydantic.Field(
    32, le=MAX_DIM, ge=2, description="t5 only: buckets of the causal relative bias (HF T5's key; T5 uses 32)"
  )
  relative_attention_max_distance: int = pydantic.Field(
    128,
    le=MAX_POSITION,
    gt=0,
    description="t5 only: distance from which positions share the last bucket (HF T5's key)",
  )
  fire_mlp_width: int = pydantic.Field(32, gt=0, description="fire only: the MLP's hidden width (paper: 32)")
  fire_init_c: float = pydantic.Field(
    0.1, gt=0, description="fire only: initial c of log(c x + 1) (paper: 0.1)"
  )
  fire_init_L: float = pydantic.Field(
    512.0, gt=0, description="fire only: the threshold L in tokens, times a learned multiplier (paper: 512)"
  )
  use_bias: bool = pydantic.Field(False, description="biases on every linear layer (BLOOM: true)")
  embed_layernorm: bool = pydantic.Field(False, description="LayerNorm after the embedding (BLOOM: true)")
  layernorm_eps: float = pydantic.Field(1e-5, gt=0, description="LayerNorm epsilon")
  gelu_approximate: bool = pydantic.Field(False, description="tanh GELU (BLOOM: true), else erf")
  tie_embeddings: bool = pydantic.Field(True, description="the output head shares the embedding matrix")
  dtype: DType = pydantic.Field("float32", description="activation dtype")
  param_dtype: Literal["float32", "bfloat16"] = pydantic.Field(
    "float32", description="parameter dtype; bfloat16: float32 master weights in training (docs/training.md)"
  )
  init_std: float = pydantic.Field(0.02, gt=0, description="normal init std (output projections / sqrt(2L))")
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
  context_attention: Literal["all_gather", "ring"] = pydantic.Field(
    "all_gather",
    description="attention across the context mesh axis (when the sequence is split over it, "
    "jaxpe.attention.context): all_gather (every shard gathers all keys and values, then attends its "
    "queries) or ring (keys and values pass from shard to shard with ppermute, merged by the online "
    "softmax: each shard holds T / context keys at a time); the same result either way",
  )
  # -- attention patterns and the llama / gemma architecture (jaxpe.model.pattern_options; issue 47) --
  layer_types: tuple[LayerType, ...] | None = pydantic.Field(
    None,
    description="per-layer attention (HF's key): num_layers entries of full_attention, sliding_attention "
    "(sliding_window) or chunked_attention (attention_chunk_size); default all full, or all sliding / "
    "chunked when only sliding_window / attention_chunk_size is set; not with sliding_window_pattern",
  )
  sliding_window_pattern: int | None = pydantic.Field(
    None, gt=0, description="Gemma 3: layer i is full_attention iff (i + 1) % n == 0, else sliding (6: 5 : 1)"
  )
  sliding_window: int | None = pydantic.Field(
    None,
    gt=0,
    lt=MAX_POSITION,
    description="HF's sliding window in tokens, counting the query: key j seen from query i iff "
    "i - w < j <= i (local_window_size (w - 1, 0)); sliding_attention layers' KV cache is a ring of w - 1 slots",
  )
  attention_chunk_size: int | None = pydantic.Field(
    None,
    gt=0,
    lt=MAX_POSITION,
    description="Llama 4: chunked_attention layers see keys of their query's chunk",
  )
  attn_logit_softcapping: float | None = pydantic.Field(
    None, gt=0, description="Gemma 2: attention scores s become cap * tanh(s / cap) (before mask and bias)"
  )
  final_logit_softcapping: float | None = pydantic.Field(
    None, gt=0, description="Gemma 2: the output logits z become cap * tanh(z / cap)"
  )
  rope_local_base_freq: float | None = pydantic.Field(
    None,
    gt=0,
    description="Gemma 3: sliding_attention layers rotate at this base, unscaled (rope_scaling and "
    "rope_theta are the full_attention layers'); default: every layer rope_theta with rope_scaling",
  )
  attn_temperature_tuning: bool = pydantic.Field(
    False,
    description="Llama 4: NoPE layers (no_rope_layers) scale q by log1p(floor((slot + 1) / floor_scale)) "
    "* attn_scale + 1",
  )
  floor_scale: float = pydantic.Field(
    8192.0, gt=0, description="Llama 4's temperature tuning: slots per step"
  )
  attn_scale: float = pydantic.Field(0.1, gt=0, description="Llama 4's temperature tuning: the log's weight")
  norm_type: Literal["layernorm", "rmsnorm", "gemma_rmsnorm"] = pydantic.Field(
    "layernorm",
    description="layernorm (GPT / BLOOM), rmsnorm (Llama: x / rms(x) * w), gemma_rmsnorm (x / rms(x) * (1 + w))",
  )
  mlp_type: Literal["mlp", "gated", "moe"] = pydantic.Field(
    "mlp", description="mlp: down(act(up(x))); gated (GLU): down(act(gate(x)) * up(x)); moe: jaxpe.model.moe"
  )
  hidden_act: Literal["silu", "gelu", "gelu_pytorch_tanh"] | None = pydantic.Field(
    None,
    description="gated / moe experts' activation (HF's key): silu (default), gelu (erf), gelu_pytorch_tanh",
  )
  num_local_experts: int | None = pydantic.Field(None, gt=0, le=MAX_DIM, description="E: experts (moe)")
  num_experts_per_tok: int | None = pydantic.Field(None, gt=0, le=MAX_DIM, description="k <= E (moe)")
  swiglu_limit: float | None = pydantic.Field(
    None, gt=0, description="moe: gpt-oss's clamped SwiGLU (7.0; jaxpe.model.moe); None: act(gate) * up"
  )
  swiglu_alpha: float = pydantic.Field(1.702, gt=0, description="gpt-oss's SwiGLU: sigmoid(alpha gate)")
  attention_bias: bool = pydantic.Field(False, description="biases on q, k, v, o (HF's key)")
  mlp_bias: bool = pydantic.Field(False, description="biases on MLP / moe projections (HF's key)")
  moe_routing: Literal["softmax", "sigmoid_input"] = pydantic.Field("softmax", description="jaxpe.model.moe")
  moe_shared_expert: bool = pydantic.Field(False, description="moe: + a gated MLP of F (Llama 4)")
  use_qk_norm: bool = pydantic.Field(False, description="Llama 4: RoPE layers' q, k / rms(.) after RoPE")
  qk_norm: bool = pydantic.Field(
    False, description="Qwen3 / Gemma 3: a norm (norm_type) over H on q and k of each head, before RoPE"
  )
  sandwich_norm: bool = pydantic.Field(
    False, description="Gemma 2/3: a norm also after attention and after the MLP, before each residual add"
  )
  scale_embeddings: bool = pydantic.Field(False, description="Gemma: token embeddings times sqrt(D)")
  query_pre_attn_scalar: float | None = pydantic.Field(
    None, gt=0, description="Gemma: attention scale query_pre_attn_scalar ** -0.5; default H ** -0.5"
  )

  @pydantic.field_validator("pos_encoding", mode="before")
  @classmethod
  def _registered_encoding(cls, name: Any) -> Any:
    """A name of ``ENCODINGS`` (read now: a later registration counts); else a literal error."""
    if not (isinstance(name, str) and name in ENCODINGS):
      names = [repr(n) for n in ENCODINGS]
      expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
      raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name

  @pydantic.model_validator(mode="before")
  @classmethod
  def _old_attention_impl(cls, data: Any) -> Any:
    """``attention_impl`` (the key before ``attn_implementation``, in YAML files, overrides, and the
    saved configs of older runs and checkpoints) is read as ``attn_implementation``, with a
    FutureWarning (shown by default: a config key is an end user's, not only a programmer's); both
    keys at once are refused."""
    if isinstance(data, dict) and "attention_impl" in data:
      if "attn_implementation" in data:
        raise ValueError(
          "attention_impl is the old name of attn_implementation; give attn_implementation only, "
          f"got both (attention_impl={data['attention_impl']!r}, "
          f"attn_implementation={data['attn_implementation']!r})"
        )
      warnings.warn(
        "ModelConfig key attention_impl is renamed attn_implementation (HF's name); the old key will be removed",
        FutureWarning,
        stacklevel=2,
      )
      data = {("attn_implementation" if k == "attention_impl" else k): v for k, v in data.items()}
    return data

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

  @pydantic.model_validator(mode="before")
  @classmethod
  def _schedule_list(cls, data: Any) -> Any:
    """``no_rope_layers`` / ``layer_types`` from a YAML / JSON list become tuples (hashable config)."""
    for key in ("no_rope_layers", "layer_types"):
      if isinstance(data, dict) and isinstance(data.get(key), list):
        data = {**data, key: tuple(data[key])}
    return data

  @classmethod
  def from_hf_config(cls, config: Any, **overrides: Any) -> ModelConfig:
    """The config of a transformers decoder config (``MistralConfig``, ``Qwen3Config``,
    ``Gemma2Config``, ``Gemma3TextConfig``, ``GptOssConfig``) or its ``config.json`` dict, ``overrides`` last
    (``jaxpe.model.hf_decoder.config_dict_from_hf``: its errors name what the decoder lacks)."""
    from jaxpe.model import hf_decoder

    return cls(**hf_decoder.config_dict_from_hf(config, **overrides))

  def layer_pattern(self, layer: int) -> pattern_options.LayerPattern:
    """Layer ``layer``'s attention type, window, chunk and RoPE (``pattern_options.layer_pattern``)."""
    return pattern_options.layer_pattern(self, layer)

  @property
  def rotates(self) -> bool:
    """Whether the encoding rotates q and k at ``rope_frequencies()`` (rope, xpos, the hybrid)."""
    return self.pos_encoding in ("rope", "xpos") or (
      self.pos_encoding == "rope_alibi" and self.rope_alibi_content_rope
    )

  def rope_layers(self) -> tuple[bool, ...] | None:
    """``[L]`` whether each layer rotates (``rope_options.rope_layers``); None: every layer rotates."""
    return rope_options.rope_layers(self)

  @pydantic.model_validator(mode="after")
  def _check_sizes(self) -> ModelConfig:
    rope_options.check_rope_options(self)
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
    if self.rotary_dim is not None and not self.rotates:
      raise ValueError(
        f"rotary_dim is only used by pos_encoding 'rope' or 'xpos' (or the rope_alibi hybrid), got "
        f"rotary_dim={self.rotary_dim} with pos_encoding={self.pos_encoding!r} (leave rotary_dim unset)"
      )
    if self.rotary_dim is not None:
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
      if not self.rotates:
        raise ValueError(
          "rope_scaling needs pos_encoding 'rope' or 'xpos' (or 'rope_alibi' with rope_alibi_content_rope=True), "
          f"got {self.pos_encoding!r}"
        )
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
        "alibi_emulation='rotated' needs ALiBi on every head (slopes > 0); use alibi_emulation='lean' or 'exact' "
        f"with alibi_heads={self.alibi_heads}"
      )
    bias_options.check_bias_options(self)
    pattern_options.check_pattern_options(self)
    return self

  def rope_frequencies(self):
    """``(inv_freq [R/2] float64 numpy, attention_factor)`` for rope/xpos (and the rope_alibi hybrid's
    content), from ``rope_scaling`` and ``rotary_dim``, or p-RoPE's ``[H/2]`` with ``rope_proportion``;
    float64 so that the exact phases are exact at every position (a float32 table is not).

    ``max_position_embeddings`` and ``seq_len`` are ``max_len``, so the frequencies are fixed for a
    model (cached decoding equals the full forward pass).
    """
    if self.rope_proportion is not None:  # p-RoPE; a linear rope_scaling is gemma's scale_factor
      factor = 1.0 if self.rope_scaling is None else self.rope_scaling.factor
      p, theta = self.rope_proportion, self.rope_theta
      return rope_scaling_lib.p_rope_inv_freq(
        self.head_size, proportion=p, rope_theta=theta, factor=factor, dtype="float64"
      ), 1.0
    return rope_scaling_lib.rope_frequencies(
      None if self.rope_scaling is None else self.rope_scaling.as_dict(),
      head_dim=self.head_size,
      rope_theta=self.rope_theta,
      rotary_dim=self.rotary_dim,
      max_position_embeddings=self.max_len,
      seq_len=self.max_len,
      dtype="float64",
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
