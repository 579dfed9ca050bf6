"""Hugging Face decoder weights -> jaxpe (issue 47): the state dict of a transformers Mistral,
Qwen3, Gemma 2, Gemma 3 (text), gpt-oss or Llama 4 (text) causal LM as ``Decoder`` parameters (``params_from_hf``),
and a ``Decoder`` from a transformers model (``from_hf_model``). Configs: ``jaxpe.model.hf_decoder``.

Layouts: HF's ``nn.Linear`` weight ``[out, in]``; jaxpe's q/k/v kernels ``[D, N|K, H]``, the output
projection ``[N, H, D]``, MLP kernels ``[D, F]`` / ``[F, D]``, the head ``[D, V]``. Norm weights map
as they are (Gemma's ``(1 + w)`` is ``norm_type='gemma_rmsnorm'``). Names: Llama-style
``post_attention_layernorm`` is the norm before the MLP (``mlp_norm``); Gemma 2/3's is the norm
after attention (``post_attn_norm``), ``pre_feedforward_layernorm`` the one before the MLP.
``attention_bias``: q/k/v biases ``[N|K * H]`` -> ``[N|K, H]``, o's ``[D]``. gpt-oss
(``GptOssExperts``, stored ``[E, in, out]`` as jaxpe's): ``self_attn.sinks [N]`` -> ``attn.sinks``;
``mlp.router.weight [E, D]`` / ``bias [E]`` -> ``mlp.router``; ``mlp.experts.gate_up_proj [E, D, 2F]``
and its bias ``[E, 2F]``, gate and up interleaved (``gate_up[..., ::2]``, ``[..., 1::2]``) ->
``mlp.gate`` / ``mlp.up`` ``[E, D, F]`` and ``mlp.gate_bias`` / ``mlp.up_bias`` ``[E, F]``;
``down_proj [E, F, D]`` / ``down_proj_bias [E, D]`` as they are. Llama 4 (``Llama4TextMoe``):
``feed_forward.router.weight`` -> ``mlp.router``, ``feed_forward.experts.gate_up_proj [E, D, 2F]``
gate then up (``chunk(2)``) -> ``mlp.gate`` / ``mlp.up``, ``down_proj`` -> ``mlp.down``,
``feed_forward.shared_expert.*_proj`` -> ``mlp.shared_expert``.
torch is imported only to read tensors (``jaxpe.bloom.hf_import._to_numpy``'s rule: float32).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxpe.errors import CheckpointError
from jaxpe.model.build import build_model, key_listing
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder

__all__ = ["from_hf_model", "params_from_hf"]


def _np(value) -> np.ndarray:
  if hasattr(value, "detach"):
    value = value.detach().to("cpu").float().numpy()
  return np.asarray(value, np.float32)


def params_from_hf(state_dict: Mapping[str, Any], cfg: ModelConfig, model_type: str) -> dict[str, np.ndarray]:
  """Dotted jaxpe parameter path -> float32 array, from a causal LM's ``state_dict`` (keys with
  ``model.`` and ``lm_head.``).

  Raises:
    CheckpointError: a key the model needs is missing, or a key is left over (a piece the config
      does not describe).
  """
  sd = {k.removeprefix("model.language_model.").removeprefix("model."): v for k, v in state_dict.items()}
  used: set[str] = set()

  def take(name: str) -> np.ndarray:
    if name not in sd:
      raise CheckpointError(f"state dict has no {name!r} (model_type {model_type!r})")
    used.add(name)
    return _np(sd[name])

  d, n, kv, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size
  gemma = model_type.startswith("gemma")
  out = {"embed.embedding": take("embed_tokens.weight"), "final_norm.scale": take("norm.weight")}
  for i in range(cfg.num_layers):
    p, b = f"layers.{i}.", f"blocks.{i}."
    out[b + "attn.q.kernel"] = take(p + "self_attn.q_proj.weight").T.reshape(d, n, h)
    out[b + "attn.k.kernel"] = take(p + "self_attn.k_proj.weight").T.reshape(d, kv, h)
    out[b + "attn.v.kernel"] = take(p + "self_attn.v_proj.weight").T.reshape(d, kv, h)
    out[b + "attn.o.kernel"] = take(p + "self_attn.o_proj.weight").T.reshape(n, h, d)
    if cfg.attention_bias:
      out[b + "attn.q.bias"] = take(p + "self_attn.q_proj.bias").reshape(n, h)
      out[b + "attn.k.bias"] = take(p + "self_attn.k_proj.bias").reshape(kv, h)
      out[b + "attn.v.bias"] = take(p + "self_attn.v_proj.bias").reshape(kv, h)
      out[b + "attn.o.bias"] = take(p + "self_attn.o_proj.bias")
    if cfg.attention_sinks:
      out[b + "attn.sinks"] = take(p + "self_attn.sinks")
    if cfg.qk_norm:
      out[b + "attn.q_norm.scale"] = take(p + "self_attn.q_norm.weight")
      out[b + "attn.k_norm.scale"] = take(p + "self_attn.k_norm.weight")
    out[b + "attn_norm.scale"] = take(p + "input_layernorm.weight")
    if gemma:
      out[b + "post_attn_norm.scale"] = take(p + "post_attention_layernorm.weight")
      out[b + "mlp_norm.scale"] = take(p + "pre_feedforward_layernorm.weight")
      out[b + "post_mlp_norm.scale"] = take(p + "post_feedforward_layernorm.weight")
    else:
      out[b + "mlp_norm.scale"] = take(p + "post_attention_layernorm.weight")
    if cfg.mlp_type == "moe":
      out.update(
        _llama4_experts(take, p, b, cfg.mlp_size) if cfg.moe_shared_expert else _gpt_oss_experts(take, p, b)
      )
      continue
    for name in ("gate", "up", "down"):
      out[f"{b}mlp.{name}.kernel"] = take(f"{p}mlp.{name}_proj.weight").T
  if not cfg.tie_embeddings:
    out["lm_head.kernel"] = take("lm_head.weight").T
  left = sorted(set(sd) - used - {"lm_head.weight"} - {k for k in sd if k.endswith("rotary_emb.inv_freq")})
  if left:
    raise CheckpointError(
      f"state dict keys not read (a piece the config does not describe): {key_listing(left)}"
    )
  return out


def _gpt_oss_experts(take, p: str, b: str) -> dict[str, np.ndarray]:
  """Layer ``p``'s ``GptOssMLP`` (router and experts) as ``MoEMLP`` parameters under ``b``."""
  gate_up, gate_up_bias = take(p + "mlp.experts.gate_up_proj"), take(p + "mlp.experts.gate_up_proj_bias")
  return {
    b + "mlp.router.kernel": take(p + "mlp.router.weight").T,
    b + "mlp.router.bias": take(p + "mlp.router.bias"),
    b + "mlp.gate": gate_up[..., ::2],
    b + "mlp.up": gate_up[..., 1::2],
    b + "mlp.gate_bias": gate_up_bias[..., ::2],
    b + "mlp.up_bias": gate_up_bias[..., 1::2],
    b + "mlp.down": take(p + "mlp.experts.down_proj"),
    b + "mlp.down_bias": take(p + "mlp.experts.down_proj_bias"),
  }


def _llama4_experts(take, p: str, b: str, f: int) -> dict[str, np.ndarray]:
  """Layer ``p``'s ``Llama4TextMoe`` (router, experts, shared expert) as ``MoEMLP`` parameters under ``b``."""
  gate_up = take(p + "feed_forward.experts.gate_up_proj")  # [E, D, 2F], gate then up (chunk)
  out = {
    b + "mlp.router.kernel": take(p + "feed_forward.router.weight").T,
    b + "mlp.gate": gate_up[..., :f],
    b + "mlp.up": gate_up[..., f:],
    b + "mlp.down": take(p + "feed_forward.experts.down_proj"),
  }
  for name in ("gate", "up", "down"):
    out[f"{b}mlp.shared_expert.{name}.kernel"] = take(f"{p}feed_forward.shared_expert.{name}_proj.weight").T
  return out


def from_hf_model(model: Any, **overrides: Any) -> Decoder:
  """A ``Decoder`` holding the weights of a transformers causal LM (``MistralForCausalLM``,
  ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, ``GptOssForCausalLM``, ``Llama4ForCausalLM``), its config read by
  ``ModelConfig.from_hf_config(model.config, **overrides)``.

  Raises:
    ValueError: an unsupported family or config (``jaxpe.model.hf_decoder``).
    CheckpointError: the state dict does not match (``params_from_hf``).
  """
  cfg = ModelConfig.from_hf_config(model.config, **overrides)
  kind = model.config.get_text_config().model_type if hasattr(model.config, "get_text_config") else None
  kind = "gemma3_text" if kind == "gemma3" else kind or model.config.model_type
  return build_model(cfg, params_from_hf(model.state_dict(), cfg, kind))
