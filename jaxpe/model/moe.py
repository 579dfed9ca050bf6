"""The mixture-of-experts MLP of ``mlp_type='moe'`` (issue 47: gpt-oss): ``MoEMLP`` and its two
exact forms, ``ragged_experts`` (grouped matmuls over the tokens sorted by expert) and
``dense_experts`` (every expert on every token, the top-k weights zero elsewhere).

Routing (``moe_routing``): router logits ``x @ W_r + b_r`` ``[.., E]`` and the top ``k`` of them
(``torch.topk``); ``softmax`` as transformers' ``GptOssTopKRouter`` / ``GptOssMLP``
(``models/gpt_oss/modeling_gpt_oss.py``): a softmax over those k logits (Mixtral's softmax over all
E renormalised over the top k is the same weights), output ``sum_j w_j expert_{e_j}(x)``;
``sigmoid_input`` as ``Llama4Router`` / ``Llama4TextMoe`` (``models/llama4/modeling_llama4.py``):
``w_j = sigmoid(logit_j)`` scales the expert's input, ``sum_j expert_{e_j}(w_j x)``, plus with
``moe_shared_expert`` a gated MLP of F on every token (``shared_expert``). Every token goes to its
k experts: no capacity, no dropped tokens, so a token's output depends on its own row only
(padding changes nothing elsewhere).

Experts (``GptOssExperts``; Shazeer, arXiv 2002.05202 for the GLU): ``down(act(gate(x), up(x)))``
with biases (``mlp_bias``), ``act`` gpt-oss's clamped SwiGLU with ``swiglu_limit`` (gate clamped
to ``<= limit``, up to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``),
else ``hidden_act(gate) * up``. gpt-oss stores ``gate_up_proj [E, D, 2F]`` with gate and up
interleaved (columns ``0::2`` / ``1::2``); jaxpe keeps ``gate`` and ``up`` apart
(``jaxpe.model.hf_weights`` splits them).

Cost, per token, in multiply-adds (M = B T tokens): the router ``D E``; ``ragged_experts`` ``3 k D
F`` (only the k chosen experts: the grouped matmul ``jax.lax.ragged_dot``, native on GPU (cuBLAS
grouped GEMM / Triton) and TPU) plus gathers of ``M k`` rows; ``dense_experts`` ``3 E D F`` (E / k
times the FLOPs, ``[M, E, F]`` temporaries). XLA:CPU has no grouped matmul: its ``ragged_dot`` is a
masked dense product over all E groups for each of the ``M k`` sorted rows (``3 k E D F``, k times
``dense_experts``), so ``MoEMLP`` runs ``dense_experts`` on CPU and ``ragged_experts`` elsewhere
(``jaxpe.attention.platforms.per_platform``: the platform the program is lowered for).

Shape alphabet: B batch, T tokens, D model dim, F expert MLP dim, E experts, k experts per token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.attention.platforms import per_platform
from jaxpe.model import initializers
from jaxpe.model.config import ModelConfig
from jaxpe.model.llama_layers import ACTIVATIONS, GatedMLP
from jaxpe.model.primitives import dense

__all__ = ["MoEMLP", "dense_experts", "ragged_experts", "route"]


def route(logits: jax.Array, k: int, routing: str = "softmax") -> tuple[jax.Array, jax.Array]:
  """``(weights [.., k] float32, experts [.., k] int32)``: the top ``k`` of router ``logits [.., E]``
  (largest first) and their weights: ``softmax`` over those k logits (``GptOssTopKRouter``), or
  ``sigmoid_input`` each logit's sigmoid (``Llama4Router``)."""
  top, experts = jax.lax.top_k(logits.astype(jnp.float32), k)
  weights = jax.nn.sigmoid(top) if routing == "sigmoid_input" else jax.nn.softmax(top, axis=-1)
  return weights, experts.astype(jnp.int32)


def _act(cfg: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
  """The experts' GLU: gpt-oss's clamped SwiGLU (``swiglu_limit``), else ``hidden_act(gate) * up``."""
  if cfg.swiglu_limit is None:
    return ACTIVATIONS[cfg.hidden_act or "silu"](gate) * up
  limit = jnp.asarray(cfg.swiglu_limit, gate.dtype)
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(gate * jnp.asarray(cfg.swiglu_alpha, gate.dtype)))


def dense_experts(cfg: ModelConfig, x, weights, experts, params) -> jax.Array:
  """Every expert on every token, summed with the top-k weights (zero for the other experts).

  Args:
    cfg: the model's config (``num_local_experts``, the activation keys).
    x: ``[M, D]`` tokens, in the compute dtype.
    weights, experts: ``[M, k]`` from ``route``.
    params: ``(gate [E, D, F], up [E, D, F], down [E, F, D], gate_bias [E, F] | None, up_bias,
      down_bias [E, D] | None)`` in the compute dtype.

  Returns:
    ``[M, D]`` of x's dtype; ``3 E D F`` multiply-adds per token, ``[M, E, F]`` temporaries.
  """
  gate, up, down, gate_b, up_b, down_b = params
  chosen = jnp.sum(jax.nn.one_hot(experts, cfg.num_local_experts), axis=-2)  # [M, E] 0 / 1
  combine = jnp.sum(jax.nn.one_hot(experts, cfg.num_local_experts) * weights[..., None], axis=-2)  # [M, E]
  if cfg.moe_routing == "sigmoid_input":  # Llama 4: each expert sees x times its weight
    xe = x[:, None, :] * combine[:, :, None].astype(x.dtype)
    g, u = jnp.einsum("MED,EDF->MEF", xe, gate), jnp.einsum("MED,EDF->MEF", xe, up)
  else:
    g, u = jnp.einsum("MD,EDF->MEF", x, gate), jnp.einsum("MD,EDF->MEF", x, up)
  if gate_b is not None:
    g, u = g + gate_b[None], u + up_b[None]
  y = jnp.einsum("MEF,EFD->MED", _act(cfg, g, u), down)
  if down_b is not None:
    y = y + down_b[None]
  scale = chosen if cfg.moe_routing == "sigmoid_input" else combine
  return jnp.einsum("MED,ME->MD", y.astype(jnp.float32), scale).astype(x.dtype)


def ragged_experts(cfg: ModelConfig, x, weights, experts, params) -> jax.Array:
  """Each token's k experts only: the ``M k`` (token, expert) rows sorted by expert, two grouped
  matmuls (``jax.lax.ragged_dot``, group sizes the experts' row counts), each row weighted, and the
  k rows of a token summed in the tokens' order (a gather, no scatter-add: deterministic).

  Args and returns: as ``dense_experts``; ``3 k D F`` multiply-adds per token where the platform
  has a grouped matmul (GPU, TPU).
  """
  gate, up, down, gate_b, up_b, down_b = params
  m, k = experts.shape
  flat = experts.reshape(-1)  # [M k], row r = token r // k
  order = jnp.argsort(flat, stable=True)
  sorted_e = flat[order]
  rows = x[order // k]  # [M k, D]
  w_sorted = weights.reshape(-1)[order][:, None]
  if cfg.moe_routing == "sigmoid_input":  # Llama 4: each expert sees x times its weight
    rows = rows * w_sorted.astype(rows.dtype)
  sizes = jnp.bincount(flat, length=cfg.num_local_experts).astype(jnp.int32)
  g = jax.lax.ragged_dot(rows, gate, sizes)
  u = jax.lax.ragged_dot(rows, up, sizes)
  if gate_b is not None:
    g, u = g + gate_b[sorted_e], u + up_b[sorted_e]
  y = jax.lax.ragged_dot(_act(cfg, g, u), down, sizes)
  if down_b is not None:
    y = y + down_b[sorted_e]
  y = y.astype(jnp.float32) * (1.0 if cfg.moe_routing == "sigmoid_input" else w_sorted)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(m * k, dtype=order.dtype))
  return jnp.sum(y[inverse].reshape(m, k, -1), axis=1).astype(x.dtype)


class MoEMLP(nnx.Module):
  """``mlp_type='moe'``: ``x [B, T, D] -> [B, T, D]`` (the module docstring's routing and experts).

  Parameters (float32; logical names in brackets; ``experts`` has no ``LogicalRules`` key: replicated):
  ``router`` an ``nnx.Einsum`` ``[D, E]`` (bias ``[E]`` with ``mlp_bias`` / ``use_bias``;
  Normal(0, ``init_std``) as HF's ``GptOssPreTrainedModel._init_weights``), ``gate``, ``up`` ``[E,
  D, F]`` (experts, embed, mlp), ``down`` ``[E, F, D]`` (Normal(0, ``init_std / sqrt(2 L)``)), with
  ``mlp_bias`` / ``use_bias`` ``gate_bias``, ``up_bias`` ``[E, F]`` and ``down_bias`` ``[E, D]``
  (zeros); with ``moe_shared_expert`` ``shared_expert``, a ``GatedMLP``. Runs ``dense_experts`` on
  CPU, ``ragged_experts`` on other platforms (the same values to rounding).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, f, e = cfg.d_model, cfg.mlp_size, cfg.num_local_experts
    biased = cfg.use_bias or cfg.mlp_bias
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.router = dense(
      cfg, "BTD,DE->BTE", (d, e), (e,), ("embed", "experts"), cfg.init_std, rngs, bias=biased
    )

    def param(init, shape, names):
      return nnx.Param(init(names)(rngs.params(), shape, jnp.float32))

    normal = lambda std: lambda names: initializers.normal(std, names)  # noqa: E731
    self.gate = param(normal(cfg.init_std), (e, d, f), ("experts", "embed", "mlp"))
    self.up = param(normal(cfg.init_std), (e, d, f), ("experts", "embed", "mlp"))
    self.down = param(normal(out_std), (e, f, d), ("experts", "mlp", "embed"))
    if biased:
      self.gate_bias = param(initializers.zeros, (e, f), ("experts", "mlp"))
      self.up_bias = param(initializers.zeros, (e, f), ("experts", "mlp"))
      self.down_bias = param(initializers.zeros, (e, d), ("experts", "embed"))
    if cfg.moe_shared_expert:  # Llama 4: a dense gated MLP of F on every token
      self.shared_expert = GatedMLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    batch, t_len, d = x.shape
    x = x.astype(dtype)
    weights, experts = route(self.router(x), cfg.num_experts_per_tok, cfg.moe_routing)
    names = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
    params = tuple(getattr(self, n)[...].astype(dtype) if hasattr(self, n) else None for n in names)
    args = (x.reshape(-1, d), weights.reshape(batch * t_len, -1), experts.reshape(batch * t_len, -1), params)
    out = per_platform({"cpu": lambda: dense_experts(cfg, *args)}, default=lambda: ragged_experts(cfg, *args))
    out = out.reshape(batch, t_len, d)
    return out + self.shared_expert(x) if cfg.moe_shared_expert else out
