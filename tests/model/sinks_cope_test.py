"""The decoder's attention sinks (ModelConfig.attention_sinks) and CoPE (pos_encoding='cope'): one
attention layer against a float64 numpy transcription, cached / padded / packed decoding with learned
values in the tables, scan_layers, a few training steps, and the config checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydantic
import pytest
from decoder_pe_test import TINY, Jitted, check_cache_padding_and_packing  # tests/model/decoder_pe_test.py
from flax import nnx

from jaxpe.attention import masks
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder


def _randomise(model, seed=0):
  """Learned-looking sinks and CoPE tables (CoPE's start at zeros, the paper's init)."""
  rng = np.random.default_rng(seed)
  blocks = model.blocks if model.cfg.scan_layers else list(model.blocks)
  for block in [blocks] if model.cfg.scan_layers else blocks:
    attn = block.attn
    for name in ("sinks", "cope_pos_emb"):
      if hasattr(attn, name):
        param = getattr(attn, name)
        param[...] = jnp.asarray(rng.normal(size=param.shape), jnp.float32)
  return model


def _numpy_layer(attn, x, npos_max):
  """One Attention layer in float64 numpy: CoPE bias (the paper's formula) + sink logits + softmax."""
  f = lambda a: np.asarray(a, np.float64)  # noqa: E731
  q, k, v = f(attn.q(x)), f(attn.k(x)), f(attn.v(x))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  t = q.shape[1]
  z = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[3])
  causal = np.tril(np.ones((t, t), bool))
  gates = np.where(causal, 1 / (1 + np.exp(-z)), 0.0)
  pos = np.minimum(np.cumsum(gates[..., ::-1], axis=-1)[..., ::-1], npos_max - 1)
  table = np.einsum("btnh,hp->bntp", q, f(attn.cope_pos_emb[...]))
  lo, hi = np.floor(pos).astype(int), np.ceil(pos).astype(int)
  at = lambda i: np.take_along_axis(table, i, axis=-1)  # noqa: E731
  logits = np.where(causal, z + at(hi) * (pos - lo) + at(lo) * (1 - pos + lo), -np.inf)
  sink = np.broadcast_to(f(attn.sinks[...])[None, :, None, None], (*logits.shape[:3], 1))
  full = np.concatenate([logits, sink], axis=-1)
  p = np.exp(full - full.max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True))[..., :-1]
  out = np.einsum("bnts,bsnh->btnh", p, v)
  return np.einsum("btnh,nhd->btd", out, f(attn.o.kernel[...]))


COPE_SINKS = dict(pos_encoding="cope", attention_sinks=True, num_kv_heads=2, cope_npos_max=5)


def test_attention_layer_matches_numpy():
  # npos_max 5 < T 12: counts clamp
  model = _randomise(Decoder(ModelConfig(**{**TINY, **COPE_SINKS}), rngs=nnx.Rngs(0)))
  attn = model.blocks[0].attn
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, TINY["d_model"])), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  out, _ = nnx.jit(lambda a, x: a(x, pos, masks.AttentionMask(causal=True), kv_positions=pos))(attn, x)
  np.testing.assert_allclose(np.asarray(out), _numpy_layer(attn, x, 5), atol=2e-5, rtol=1e-5)


def test_cope_with_sinks_cache_padding_packing():
  check_cache_padding_and_packing(
    Jitted(_randomise(Decoder(ModelConfig(**{**TINY, **COPE_SINKS}), rngs=nnx.Rngs(0))))
  )


def test_scan_layers_equal_the_loop():
  tokens = jnp.asarray(np.random.default_rng(2).integers(1, 64, (2, 12)), jnp.int32)
  loop = Decoder(ModelConfig(**{**TINY, **COPE_SINKS}), rngs=nnx.Rngs(0))
  scan = Decoder(ModelConfig(**{**TINY, **COPE_SINKS, "scan_layers": True}), rngs=nnx.Rngs(0))
  assert scan.blocks.attn.sinks.shape == (2, 4) and scan.blocks.attn.cope_pos_emb.shape == (2, 8, 5)
  np.testing.assert_allclose(
    np.asarray(scan.blocks.attn.sinks[...][1]), np.asarray(loop.blocks[1].attn.sinks[...])
  )
  np.testing.assert_allclose(
    nnx.jit(lambda m, t: m(t))(scan, tokens), nnx.jit(lambda m, t: m(t))(loop, tokens), atol=2e-5
  )


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize(
  "overrides",
  [dict(pos_encoding="cope", cope_npos_max=8), dict(pos_encoding="rope", attention_sinks=True)],
  ids=["cope", "rope-sinks"],
)
def test_a_few_training_steps(overrides):
  model = Decoder(ModelConfig(**{**TINY, "init_std": 0.02, **overrides}), rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = jnp.asarray(np.random.default_rng(3).integers(1, 64, (4, 16)), jnp.int32)

  @nnx.jit
  def step(model, opt, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss, grads

  losses = []
  for _ in range(6):
    loss, grads = step(model, opt, tokens)
    losses.append(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
  assert losses[-1] < losses[0] - 0.1, losses
  attn_grads = grads["blocks"][0]["attn"]
  name = "cope_pos_emb" if overrides["pos_encoding"] == "cope" else "sinks"
  assert float(jnp.abs(attn_grads[name][...]).max()) > 0  # the learned part is trained


def test_config_checks():
  with pytest.raises(pydantic.ValidationError, match="cope_npos_max needs pos_encoding='cope'"):
    ModelConfig(pos_encoding="rope", cope_npos_max=8)
  with pytest.raises(
    pydantic.ValidationError,
    match="pos_encoding='cope' is an additive bias that only the xla backend computes",
  ):
    ModelConfig(pos_encoding="cope", attn_implementation="splash")
  with pytest.raises(pydantic.ValidationError, match="attention_sinks runs on"):
    ModelConfig(attention_sinks=True, attn_implementation="cudnn")
  ModelConfig(attention_sinks=True, attn_implementation="splash", pos_encoding="alibi")


@pytest.mark.parametrize(
  "overrides", [dict(attention_sinks=True), dict(pos_encoding="cope")], ids=["sinks", "cope"]
)
def test_context_parallelism_refuses_sinks_and_cope(overrides):
  from jaxpe.model import partitioning
  from jaxpe.model.config import LogicalRules
  from jaxpe.train import sharding

  model = Decoder(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh((1, 1, 1, 2), devices=jax.devices()[:2])
  tokens = jnp.ones((2, 8), jnp.int32)
  with partitioning.activation_sharding(mesh, LogicalRules()):
    with pytest.raises(
      ValueError, match="context parallelism .* runs without attention sinks and dense biases"
    ):
      model(tokens)


@pytest.mark.parametrize(
  "overrides, tpu_kernel",
  [
    ({"attention_sinks": True}, True),  # splash (tpu) and flash (cuda) take sinks; cuDNN does not
    ({"pos_encoding": "cope"}, False),  # additive biases: xla on every platform
    ({"pos_encoding": "t5"}, False),
    ({"pos_encoding": "fire"}, False),
    ({"pos_encoding": "rope"}, True),
  ],
)
def test_auto_runs_what_a_kernel_refuses_on_xla_on_every_platform(overrides, tpu_kernel):
  """``attn_implementation='auto'`` is resolved per platform when the model is lowered: an xla-only
  encoding or sinks (which cuDNN refuses) run on xla there instead of being refused, here with the
  logits of ``attn_implementation='xla'``; lowered for tpu, the kernel only where it takes the call."""
  cfg = ModelConfig(**{**TINY, "attn_implementation": "auto", **overrides})
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 8)), jnp.int32)
  got = Decoder(cfg, rngs=nnx.Rngs(0))(tokens)
  want = Decoder(cfg.model_copy(update={"attn_implementation": "xla"}), rngs=nnx.Rngs(0))(tokens)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
  traced = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).trace(state, tokens)
  tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert ("tpu_custom_call" in tpu) == tpu_kernel
  assert "jaxpe_cpu_flash" not in tpu + cuda
  if not tpu_kernel:  # no fused kernel on cuda for these
    assert "triton" not in cuda and "cudnn" not in cuda
  if overrides.get("attention_sinks"):  # cuDNN refuses sinks; jaxpe's flash (Triton) takes them
    assert "triton" in cuda and "cudnn" not in cuda
