"""Issue 47 parity, gpt-oss: a small random ``GptOssForCausalLM`` built from a transformers config
(nothing downloaded; float32, eager attention, transformers' eager experts loop), imported by
``jaxpe.model.hf_weights.from_hf_model``, gives transformers' logits: a full forward with left
padding, and cached decoding past the 4-token window (the sliding layer's ring of 3 slots wraps
several times) against transformers' own cached greedy ``generate``, step by step (the empty cache's
prefill path is the other families' test's).

What the model exercises: q/k/v/o biases, learned sinks in the softmax denominator, sliding / full
layers alternating, yarn RoPE (factor 4 over 32 original positions) on halves, the top-2-of-4
router with bias and softmax over the chosen logits, interleaved gate/up columns, the clamped
SwiGLU (``swiglu_limit`` 1.0 so the clamp acts at these weights), expert biases, untied head.
Weights Normal(0, 0.3), and every norm, bias and sink moved off its init.

Tolerance measured on this machine (transformers 5.25, torch CPU): full forward max |delta logit|
7.3e-6 (logits up to 6.1), float32 rounding of the two orders of summation; asserted at 1e-4."""

import importlib

import jax
import numpy as np
import pytest
from flax import nnx
from hf_parity import hf_greedy, token_by_token_logits

TOL = 1e-4
W = 4
CONFIG = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=16,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  num_local_experts=4,
  num_experts_per_tok=2,
  sliding_window=W,
  max_position_embeddings=128,
  initializer_range=0.3,
  swiglu_limit=1.0,
  rope_parameters=dict(
    rope_type="yarn",
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=32,
    rope_theta=10000.0,
  ),
  attn_implementation="eager",
  experts_implementation="eager",
)


@pytest.fixture(scope="module")
def hf():
  torch = importlib.import_module("torch")
  tf = importlib.import_module("transformers")
  torch.manual_seed(0)
  model = tf.GptOssForCausalLM(tf.GptOssConfig(**CONFIG)).eval().float()
  assert model.config._experts_implementation == "eager"
  with torch.no_grad():  # norms, biases (zeros at init) and sinks off their init: each one matters
    for name, p in model.named_parameters():
      if "norm" in name or "bias" in name or "sinks" in name:
        p.add_(0.3 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def model(hf):
  from jaxpe.model.hf_weights import from_hf_model

  return from_hf_model(hf)


def _inputs(t_len):
  tokens = np.random.default_rng(1).integers(0, 64, (2, t_len))
  mask = np.ones((2, t_len), np.int64)
  mask[1, :3] = 0  # left padding: positions count real tokens, windows count slots (transformers)
  return tokens, mask


def _hf_logits(hf, tokens, mask):
  torch = importlib.import_module("torch")
  pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
  with torch.no_grad():
    return hf(
      torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)
    ).logits.numpy()


def test_config_reads_every_gpt_oss_key(model):
  cfg = model.cfg
  assert (cfg.mlp_type, cfg.num_local_experts, cfg.num_experts_per_tok) == ("moe", 4, 2)
  assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.attention_bias, cfg.mlp_bias) == (1.0, 1.702, True, True)
  assert cfg.attention_sinks and not cfg.tie_embeddings and cfg.rope_layout == "half"
  assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == W
  assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.factor == 4.0


def _forward(model):
  """``model``'s full forward under one ``jax.jit`` (one compile, not an eager op-by-op first run)."""
  graphdef, state = nnx.split(model)
  return lambda tokens, mask: np.asarray(
    jax.jit(lambda st, t, m: nnx.merge(graphdef, st)(t, attention_mask=m))(state, tokens, mask)
  )


def test_full_forward_with_padding_matches_transformers(hf, model):
  from jaxpe.model.hf_weights import from_hf_model

  tokens, mask = _inputs(17)
  ref = _hf_logits(hf, tokens, mask)
  real = mask.astype(bool)
  assert np.abs(_forward(model)(tokens, mask) - ref)[real].max() < TOL
  # the window acts: the same weights with full attention everywhere no longer match (the clamp:
  # moe_test's numpy reference)
  unwindowed = from_hf_model(hf, layer_types=None, sliding_window=None)
  assert np.abs(_forward(unwindowed)(tokens, mask) - ref)[real].max() > 1e-3


def test_cached_generation_past_the_window_matches_transformers(hf, model):
  """transformers' greedy ``generate`` (its sliding-window cache) and its per-step logits against
  jaxpe's decoder on the ring-buffer KV cache with the same tokens, one compiled step for all: the
  prompt (its padding too, by ``attention_mask``) fed a token at a time, then the 11 tokens
  transformers chose."""
  from jaxpe.model.cache import init_cache

  tokens, mask = _inputs(7)
  new = 12
  ref_tokens, ref_logits = hf_greedy(hf, tokens, mask, new)
  cache = init_cache(model.cfg, 2, tokens.shape[1] + new)
  assert min(c.shape[2] for c in cache.k) == W - 1  # the sliding layer keeps a ring of w - 1 slots
  got = token_by_token_logits(model, tokens, mask, ref_tokens, cache)
  assert np.abs(got - ref_logits).max() < TOL
