"""The declarative BLOOM weight-name map: every HF key, the jaxpe parameters it feeds, and a pair of
pure numpy transforms (HF -> jaxpe and back), as maxtext's checkpoint converters keep a name map
apart from per-key transform hooks.

``weight_rules`` expands the map over a config's layers; the importer (``jaxpe.bloom.hf_import``)
and the exporter (``jaxpe.bloom.hf_export``) both walk it, so any BLOOM size (560m to 7b1, 176b)
maps the same way. The reference is HF transformers' ``models/bloom/modeling_bloom.py``.

Shapes (HF ``[out, in]`` linear weights; jaxpe einsum kernels), with D model dim, N heads, H head
dim (D / N), F = 4 D MLP dim, V vocab:

====================================================  ==============================================
HF key (``transformer.`` prefix optional)             jaxpe path
====================================================  ==============================================
``word_embeddings.weight [V, D]``                     ``embed.embedding [V, D]``
``word_embeddings_layernorm.{weight,bias} [D]``       ``embed_norm.{scale,bias}``
``h.{i}.input_layernorm.{weight,bias} [D]``           ``blocks.{i}.attn_norm.{scale,bias}``
``h.{i}.self_attention.query_key_value.weight``       ``blocks.{i}.attn.{q,k,v}.kernel [D, N, H]``
``  [3 D, D]``, rows ordered (head, q/k/v, dim)
``h.{i}.self_attention.query_key_value.bias [3 D]``   ``blocks.{i}.attn.{q,k,v}.bias [N, H]``
``h.{i}.self_attention.dense.weight [D, D]``, bias    ``blocks.{i}.attn.o.kernel [N, H, D]``, bias
``h.{i}.post_attention_layernorm.{weight,bias}``      ``blocks.{i}.mlp_norm.{scale,bias}``
``h.{i}.mlp.dense_h_to_4h.weight [F, D]``, bias       ``blocks.{i}.mlp.up.kernel [D, F]``, bias
``h.{i}.mlp.dense_4h_to_h.weight [D, F]``, bias       ``blocks.{i}.mlp.down.kernel [F, D]``, bias
``ln_f.{weight,bias} [D]``                            ``final_norm.{scale,bias}``
``lm_head.weight [V, D]`` (only when untied)          ``lm_head.kernel [D, V]`` (bias held at 0)
====================================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxpe.model.config import ModelConfig

__all__ = ["GLOBAL_RULES", "LAYER_RULES", "LM_HEAD_RULE", "Dims", "Rule", "weight_rules"]


@dataclass(frozen=True)
class Dims:
  """Sizes the transforms need: D model dim, N heads, H head dim, F MLP dim, V vocab, L layers."""

  d: int
  n: int
  h: int
  f: int
  v: int
  layers: int

  @classmethod
  def of(cls, cfg: ModelConfig) -> Dims:
    return cls(cfg.d_model, cfg.num_heads, cfg.head_size, cfg.mlp_size, cfg.vocab_size, cfg.num_layers)


def _same(x, dims):
  return (x,)


def _same_back(x, dims):
  return x


def _linear(w, dims):  # HF [out, in] -> jaxpe [in, out]
  return (w.T,)


def _linear_back(k, dims):
  return k.T


def _qkv_weight(w, dims):
  # HF splits the fused output as view(N, 3, H): row r = n * 3H + j * H + h, j = 0 q, 1 k, 2 v.
  w = w.reshape(dims.n, 3, dims.h, dims.d)
  return tuple(np.ascontiguousarray(np.transpose(w[:, j], (2, 0, 1))) for j in range(3))  # [D, N, H]


def _qkv_weight_back(q, k, v, dims):
  stacked = np.stack([np.transpose(x, (1, 2, 0)) for x in (q, k, v)], axis=1)  # [N, 3, H, D]
  return stacked.reshape(3 * dims.d, dims.d)


def _qkv_bias(b, dims):
  b = b.reshape(dims.n, 3, dims.h)
  return tuple(np.ascontiguousarray(b[:, j]) for j in range(3))  # [N, H]


def _qkv_bias_back(q, k, v, dims):
  return np.stack([q, k, v], axis=1).reshape(3 * dims.d)


def _o_weight(w, dims):  # [D_out, N*H] -> [N, H, D]
  return (w.T.reshape(dims.n, dims.h, dims.d),)


def _o_weight_back(o, dims):
  return o.reshape(dims.n * dims.h, dims.d).T


def _lm_head(w, dims):  # BLOOM's untied head has no bias; jaxpe's (use_bias) is held at zero
  return w.T, np.zeros((dims.v,), w.dtype)


def _lm_head_back(kernel, bias, dims):
  if np.any(bias != 0):
    raise ValueError("lm_head.bias must be zero to export to BLOOM (its output head has no bias)")
  return kernel.T


@dataclass(frozen=True)
class Rule:
  """One HF key and the jaxpe parameters it maps to.

  Attributes:
    hf: HF key without the ``transformer.`` prefix; ``{i}`` is the layer index.
    jax: dotted jaxpe parameter paths (``{i}`` = layer) the key feeds, in the order ``to_jax``
      returns them.
    hf_shape: the HF tensor's shape from ``Dims``.
    to_jax: ``(hf_array, dims) -> tuple of jaxpe arrays``.
    to_hf: ``(*jaxpe_arrays, dims) -> hf_array``.
  """

  hf: str
  jax: tuple[str, ...]
  hf_shape: Callable[[Dims], tuple[int, ...]]
  to_jax: Callable[..., tuple[np.ndarray, ...]]
  to_hf: Callable[..., np.ndarray]


def _vec(name):
  return lambda d: (getattr(d, name),)


def _norm(hf: str, jax: str) -> list[Rule]:
  return [
    Rule(f"{hf}.weight", (f"{jax}.scale",), _vec("d"), _same, _same_back),
    Rule(f"{hf}.bias", (f"{jax}.bias",), _vec("d"), _same, _same_back),
  ]


def _attn_paths(kind: str) -> tuple[str, ...]:
  return tuple(f"blocks.{{i}}.attn.{p}.{kind}" for p in "qkv")


LAYER_RULES: tuple[Rule, ...] = (
  *_norm("h.{i}.input_layernorm", "blocks.{i}.attn_norm"),
  Rule(
    "h.{i}.self_attention.query_key_value.weight",
    _attn_paths("kernel"),
    lambda d: (3 * d.d, d.d),
    _qkv_weight,
    _qkv_weight_back,
  ),
  Rule(
    "h.{i}.self_attention.query_key_value.bias",
    _attn_paths("bias"),
    lambda d: (3 * d.d,),
    _qkv_bias,
    _qkv_bias_back,
  ),
  Rule(
    "h.{i}.self_attention.dense.weight",
    ("blocks.{i}.attn.o.kernel",),
    lambda d: (d.d, d.d),
    _o_weight,
    _o_weight_back,
  ),
  Rule("h.{i}.self_attention.dense.bias", ("blocks.{i}.attn.o.bias",), _vec("d"), _same, _same_back),
  *_norm("h.{i}.post_attention_layernorm", "blocks.{i}.mlp_norm"),
  Rule(
    "h.{i}.mlp.dense_h_to_4h.weight",
    ("blocks.{i}.mlp.up.kernel",),
    lambda d: (d.f, d.d),
    _linear,
    _linear_back,
  ),
  Rule("h.{i}.mlp.dense_h_to_4h.bias", ("blocks.{i}.mlp.up.bias",), _vec("f"), _same, _same_back),
  Rule(
    "h.{i}.mlp.dense_4h_to_h.weight",
    ("blocks.{i}.mlp.down.kernel",),
    lambda d: (d.d, d.f),
    _linear,
    _linear_back,
  ),
  Rule("h.{i}.mlp.dense_4h_to_h.bias", ("blocks.{i}.mlp.down.bias",), _vec("d"), _same, _same_back),
)
GLOBAL_RULES: tuple[Rule, ...] = (
  Rule("word_embeddings.weight", ("embed.embedding",), lambda d: (d.v, d.d), _same, _same_back),
  *_norm("word_embeddings_layernorm", "embed_norm"),
  *_norm("ln_f", "final_norm"),
)
LM_HEAD_RULE = Rule(
  "lm_head.weight", ("lm_head.kernel", "lm_head.bias"), lambda d: (d.v, d.d), _lm_head, _lm_head_back
)


def weight_rules(cfg: ModelConfig) -> list[Rule]:
  """The name map of ``cfg``'s model, expanded over its layers (``{i}`` filled in)."""
  dims = Dims.of(cfg)
  rules = list(GLOBAL_RULES)
  for i in range(dims.layers):
    rules += [
      Rule(r.hf.format(i=i), tuple(p.format(i=i) for p in r.jax), r.hf_shape, r.to_jax, r.to_hf)
      for r in LAYER_RULES
    ]
  if not cfg.tie_embeddings:
    rules.append(LM_HEAD_RULE)
  return rules
