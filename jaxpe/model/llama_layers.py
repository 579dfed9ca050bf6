"""The llama / gemma pieces of the decoder (issue 47): ``RMSNorm`` (``norm_type`` ``rmsnorm`` and
``gemma_rmsnorm``), the gated MLP (``mlp_type='gated'``), the norm factory the blocks use
(``make_norm``), and the soft-cap ``soft_cap``.

Sources: RMSNorm (Zhang and Sennrich, arXiv 1910.07467) as transformers' ``LlamaRMSNorm`` (``w * x /
sqrt(mean(x^2) + eps)``) and ``Gemma2RMSNorm`` / ``Gemma3RMSNorm`` (``(1 + w) * ...``, w initialised
to 0); GLU MLPs (Shazeer, arXiv 2002.05202) as ``LlamaMLP`` / ``GemmaMLP``: ``down(act(gate(x)) *
up(x))``; soft-capping as Gemma 2 (``cap * tanh(z / cap)``, arXiv 2408.00118).

Shape alphabet: B batch, T tokens, D model dim, F MLP dim, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.model import initializers
from jaxpe.model.config import ModelConfig

ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
  "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}
"""``hidden_act`` -> the function (HF's ``ACT2FN`` names)."""


class RMSNorm(nnx.Module):
  """``x [..., dim] -> [..., dim]`` float32: ``x / sqrt(mean(x^2) + eps) * w`` (``gemma``:
  ``* (1 + w)``); ``scale [dim]`` float32 (ones, or zeros for gemma), logical name ``names``."""

  def __init__(self, dim: int, *, eps: float, gemma: bool, names: tuple[str, ...], rngs: nnx.Rngs):
    del rngs
    init = initializers.zeros(names) if gemma else initializers.ones(names)
    self.scale = nnx.Param(init(jax.random.key(0), (dim,), jnp.float32))
    self.eps, self.gemma = float(eps), gemma

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + jnp.float32(self.eps))
    w = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
    return y * ((1.0 + w) if self.gemma else w)


def make_norm(cfg: ModelConfig, rngs: nnx.Rngs, dim: int | None = None, names=("embed",)) -> nnx.Module:
  """The model's norm over ``dim`` (default D): ``norm_type`` layernorm (``layers.layer_norm``),
  rmsnorm or gemma_rmsnorm, epsilon ``layernorm_eps`` (HF's ``rms_norm_eps``)."""
  if cfg.norm_type == "layernorm":
    from jaxpe.model.primitives import layer_norm

    return layer_norm(cfg, rngs, dim, names)
  dim = cfg.d_model if dim is None else dim
  return RMSNorm(dim, eps=cfg.layernorm_eps, gemma=cfg.norm_type == "gemma_rmsnorm", names=names, rngs=rngs)


class GatedMLP(nnx.Module):
  """``mlp_type='gated'``: ``x [B, T, D] -> down(act(gate(x)) * up(x)) [B, T, D]`` with ``act`` =
  ``hidden_act``; ``gate``, ``up`` ``[D, F]``, ``down`` ``[F, D]`` (biases with ``use_bias`` or
  ``mlp_bias``)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    from jaxpe.model.primitives import dense

    self.cfg = cfg
    d, f = cfg.d_model, cfg.mlp_size
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    b = cfg.mlp_bias
    self.gate = dense(cfg, "BTD,DF->BTF", (d, f), (f,), ("embed", "mlp"), cfg.init_std, rngs, bias=b)
    self.up = dense(cfg, "BTD,DF->BTF", (d, f), (f,), ("embed", "mlp"), cfg.init_std, rngs, bias=b)
    self.down = dense(cfg, "BTF,FD->BTD", (f, d), (d,), ("mlp", "embed"), out_std, rngs, bias=b)

  def __call__(self, x: jax.Array) -> jax.Array:
    act = ACTIVATIONS[self.cfg.hidden_act or "silu"]
    return self.down(act(self.gate(x)) * self.up(x))


def weightless_qk_norm(q: jax.Array, k: jax.Array, use_rope, eps: float) -> tuple[jax.Array, jax.Array]:
  """Llama 4's ``use_qk_norm`` (transformers' ``Llama4TextWeightlessRMSNorm``, ``Llama4TextAttention``):
  q ``[B, T, N, H]`` and k ``[B, S, K, H]`` each ``x / sqrt(mean(x^2) + eps)`` over H in float32,
  back in their dtype, on RoPE layers only (``use_rope``: None = every layer rotates, a bool, or a
  traced flag under ``scan_layers``); applied after RoPE (with its attention factor) as transformers."""

  def norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + jnp.float32(eps))).astype(
      x.dtype
    )

  if use_rope is None or use_rope is True:
    return norm(q), norm(k)
  if use_rope is False:
    return q, k
  flag = jnp.asarray(use_rope)
  return jnp.where(flag, norm(q), q), jnp.where(flag, norm(k), k)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
  """``cap * tanh(x / cap)`` (Gemma 2's soft-capping), or ``x`` for ``cap`` None."""
  if cap is None:
    return x
  return jnp.float32(cap) * jnp.tanh(x / jnp.float32(cap))


def temperature_scale(slots: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
  """Llama 4's attention temperature ``[B, T, 1, 1]`` float32 of query ``slots [B, T]`` int (the
  tokens' indices in the sequence, ``cache_position``): ``log1p(floor((slot + 1) / floor_scale)) *
  attn_scale + 1`` (transformers' ``Llama4TextAttention``)."""
  s = jnp.floor((slots.astype(jnp.float32) + 1.0) / jnp.float32(floor_scale))
  return (jnp.log1p(s) * jnp.float32(attn_scale) + 1.0)[..., None, None]
