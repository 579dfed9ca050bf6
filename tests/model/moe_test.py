"""``mlp_type='moe'`` (``jaxpe.model.moe``, issue 47: gpt-oss): both exact forms (the grouped-matmul
``ragged_experts`` and the all-experts ``dense_experts``) and the module against a numpy float64
reference written from transformers' ``GptOssTopKRouter`` / ``GptOssExperts`` (a loop over tokens and
their chosen experts), the clamp acting; their gradients agree; the config's refusals name the key;
the FLOP count counts k experts and the router (closed form). Whole-model parity with transformers:
``hf_gpt_oss_parity_test``."""

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from flax import nnx

from jaxpe.model import moe
from jaxpe.model.config import ModelConfig

E, K, D, F, M = 4, 2, 8, 6, 10
BASE = dict(d_model=D, mlp_dim=F, num_layers=1, num_heads=2, vocab_size=16, init_std=0.8)
GPT_OSS = dict(
  BASE, mlp_type="moe", num_local_experts=E, num_experts_per_tok=K, swiglu_limit=1.5, mlp_bias=True
)
PLAIN = dict(
  BASE, mlp_type="moe", num_local_experts=E, num_experts_per_tok=K
)  # Mixtral-style: silu(gate) * up


def _reference(cfg, x, p):
  """float64 loop: per token, softmax over its top-k router logits, each chosen expert's GLU."""
  x = x.astype(np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    logits = x[t] @ p["router"] + p.get("router_bias", 0.0)
    top = np.argsort(-logits)[: cfg.num_experts_per_tok]
    w = np.exp(logits[top] - logits[top].max())
    w /= w.sum()
    for j, e in zip(w, top):
      g = x[t] @ p["gate"][e] + p.get("gate_bias", np.zeros((E, F)))[e]
      u = x[t] @ p["up"][e] + p.get("up_bias", np.zeros((E, F)))[e]
      if cfg.swiglu_limit is None:
        h = g / (1 + np.exp(-g)) * u
      else:
        g, u = np.minimum(g, cfg.swiglu_limit), np.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
        h = (u + 1) * g / (1 + np.exp(-cfg.swiglu_alpha * g))
      out[t] += j * (h @ p["down"][e] + p.get("down_bias", np.zeros((E, D)))[e])
  return out


def _module(keys):
  cfg = ModelConfig(**keys)
  with nnx.use_eager_sharding(False):  # as Decoder builds its layers: no mesh needed
    mlp = moe.MoEMLP(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  for name in ("gate_bias", "up_bias", "down_bias"):  # zeros at init: move them so they matter
    if hasattr(mlp, name):
      getattr(mlp, name)[...] = rng.normal(size=getattr(mlp, name).shape).astype(np.float32)
  if mlp.router.bias is not None:
    mlp.router.bias[...] = rng.normal(size=(E,)).astype(np.float32)
  p = {
    n: np.asarray(getattr(mlp, n)[...])
    for n in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
    if hasattr(mlp, n)
  }
  p["router"] = np.asarray(mlp.router.kernel[...])
  if mlp.router.bias is not None:
    p["router_bias"] = np.asarray(mlp.router.bias[...])
  return cfg, mlp, p


@pytest.mark.parametrize("keys", [GPT_OSS, PLAIN], ids=["gpt_oss", "silu"])
def test_both_forms_and_the_module_match_a_float64_loop(keys):
  cfg, mlp, p = _module(keys)
  x = np.random.default_rng(1).normal(size=(M, D)).astype(np.float32)
  want = _reference(cfg, x, p)
  graphdef, state = nnx.split(mlp)
  out = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))(state, jnp.asarray(x)[None])
  assert np.abs(np.asarray(out)[0] - want).max() < 1e-4  # on CPU: dense_experts
  logits = jnp.asarray(x) @ p["router"] + p.get("router_bias", np.zeros(E, np.float32))[None]
  weights, experts = moe.route(logits, K)
  names = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
  params = tuple(jnp.asarray(p[n]) if n in p else None for n in names)
  for form in (moe.dense_experts, moe.ragged_experts):
    got = jax.jit(lambda *a, form=form: form(cfg, *a))(jnp.asarray(x), weights, experts, params)
    assert np.abs(np.asarray(got) - want).max() < 1e-4, form.__name__
  if cfg.swiglu_limit is not None:  # the clamp acts at these weights: without it the loop differs
    unclamped = _reference(cfg.model_copy(update={"swiglu_limit": 1e3}), x, p)
    assert np.abs(unclamped - want).max() > 1e-2


def test_the_ragged_form_has_the_dense_forms_gradients():
  """``jax.lax.ragged_dot`` (the form GPUs and TPUs run) differentiates to the all-experts form's
  gradients, router included (through the top-k softmax weights)."""
  cfg, mlp, p = _module(GPT_OSS)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(M, D)), jnp.float32)
  names = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
  params = tuple(jnp.asarray(p[n]) for n in names)

  def loss(form, router, params):
    weights, experts = moe.route(x @ router + p["router_bias"][None], K)
    return jnp.sum(jnp.sin(form(cfg, x, weights, experts, params)))

  both = jax.jit(
    lambda *a: [jax.grad(loss, argnums=(1, 2))(f, *a) for f in (moe.dense_experts, moe.ragged_experts)]
  )
  grads = both(jnp.asarray(p["router"]), params)  # one compile for the two
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4)
  assert np.abs(np.asarray(grads[0][0])).max() > 1e-3  # the router learns


@pytest.mark.parametrize(
  "keys, match",
  [
    (dict(mlp_type="moe"), "num_local_experts"),
    (dict(mlp_type="moe", num_local_experts=2, num_experts_per_tok=3), "k in \\[1, E\\]"),
    (dict(num_local_experts=4), "num_local_experts is a key of mlp_type='moe'"),
    (dict(mlp_type="gated", swiglu_limit=7.0), "swiglu_limit is a key of mlp_type='moe'"),
    (dict(PLAIN, swiglu_limit=7.0, hidden_act="gelu"), "not with hidden_act"),
    (dict(mlp_type="moe", num_local_experts=0, num_experts_per_tok=1), "greater than 0"),
  ],
)
def test_bad_moe_keys_are_refused_naming_the_key(keys, match):
  with pytest.raises(pydantic.ValidationError, match=match):
    ModelConfig(**keys)


def test_flops_count_the_router_and_k_experts():
  from jaxpe.train.flops import train_flops_per_token

  gated = train_flops_per_token(ModelConfig(**BASE, mlp_type="gated"), 16)
  routed = train_flops_per_token(ModelConfig(**PLAIN), 16)
  assert routed - gated == pytest.approx(6 * (D * E + (K - 1) * 3 * D * F))
  shared = train_flops_per_token(
    ModelConfig(**PLAIN, moe_routing="sigmoid_input", moe_shared_expert=True), 16
  )
  assert shared - routed == pytest.approx(6 * 3 * D * F)  # Llama 4's shared expert: one more gated MLP


@pytest.mark.parametrize(
  "key, extra",
  [
    ("mlp_type", dict(mlp_type="moe", num_local_experts=E, num_experts_per_tok=K)),
    ("attention_bias", dict(attention_bias=True)),
    ("mlp_bias", dict(mlp_bias=True)),
    ("attention_sinks", dict(attention_sinks=True)),  # before: exported, the sinks silently dropped
  ],
)
def test_bloom_export_refuses_the_gpt_oss_keys_by_name(key, extra):
  from jaxpe.bloom.config import check_bloom_compatible

  bloom = dict(pos_encoding="alibi", use_bias=True, embed_layernorm=True, gelu_approximate=True)
  check_bloom_compatible(ModelConfig(**bloom))
  with pytest.raises(ValueError, match=key):
    check_bloom_compatible(ModelConfig(**bloom, **extra))


def test_gpus_and_tpus_get_the_grouped_matmul_and_cpus_the_dense_form():
  """The platform the program is lowered for picks the form (a CPU host lowering for cuda / tpu):
  ``chlo.ragged_dot`` and no ``[M, E, F]`` product on cuda and tpu, the all-experts einsums on cpu."""
  cfg, mlp, _ = _module(GPT_OSS)
  graphdef, state = nnx.split(mlp)
  traced = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).trace(state, jnp.ones((1, M, D)))
  for platform in ("cuda", "tpu", "cpu"):
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    dense = f"tensor<{M}x{E}x{F}xf32>" in text
    assert ("chlo.ragged_dot" in text, dense) == ((False, True) if platform == "cpu" else (True, False)), (
      platform
    )
