"""Issue 47 parity, Llama 4 (text): a small random ``Llama4ForCausalLM`` built from a transformers
config (nothing downloaded; float32, eager attention), imported by
``jaxpe.model.hf_weights.from_hf_model``, gives transformers' logits: a full forward with left
padding (chunks of 4 counted from each row's first real token, as ``create_chunked_causal_mask``),
and cached decoding past several chunks (the chunked layer's ring of 3 slots) against transformers'
own cached greedy ``generate``, step by step.

What the model exercises: chunked RoPE layers beside a global NoPE layer (``no_rope_layers``) with
the attention temperature (``floor_scale``, ``attn_scale``), llama3 RoPE scaling on adjacent pairs,
the weightless q/k RMS norm after RoPE (``use_qk_norm``), the top-2-of-4 router whose sigmoid
weights scale the experts' inputs, the shared expert, untied head. Weights Normal(0, 0.3), norms
moved off their init.

Tolerance: float32 rounding of two orders of summation (measured on this machine, transformers
5.25, torch CPU: full forward max |delta logit| 6.2e-6, logits up to 6.4); asserted at 1e-4."""

import importlib

import jax
import numpy as np
import pytest
from flax import nnx
from hf_parity import hf_greedy, token_by_token_logits

TOL = 1e-4
C = 4
CONFIG = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=16,
  intermediate_size_mlp=16,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  num_local_experts=4,
  num_experts_per_tok=2,
  attention_chunk_size=C,
  no_rope_layer_interval=2,
  floor_scale=4,
  attn_scale=0.5,
  max_position_embeddings=128,
  initializer_range=0.3,
  attn_implementation="eager",
  rope_parameters=dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
    rope_theta=10000.0,
  ),
)


@pytest.fixture(scope="module")
def hf():
  torch = importlib.import_module("torch")
  tf = importlib.import_module("transformers")
  torch.manual_seed(0)
  model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(**CONFIG)).eval().float()
  with torch.no_grad():  # norms off their init (ones): each one matters
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.3 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def model(hf):
  from jaxpe.model.hf_weights import from_hf_model

  return from_hf_model(hf)


def _inputs(t_len):
  tokens = np.random.default_rng(1).integers(0, 64, (2, t_len))
  mask = np.ones((2, t_len), np.int64)
  mask[1, :3] = 0  # left padding: positions and chunks count from the first real token
  return tokens, mask


def _hf_logits(hf, tokens, mask):
  torch = importlib.import_module("torch")
  pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
  with torch.no_grad():
    return hf(
      torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)
    ).logits.numpy()


def _forward(model):
  graphdef, state = nnx.split(model)
  call = jax.jit(lambda st, t, m: nnx.merge(graphdef, st)(t, attention_mask=m))
  return lambda tokens, mask: np.asarray(call(state, tokens, mask))


def test_config_reads_the_llama4_keys(model):
  cfg = model.cfg
  assert (cfg.mlp_type, cfg.moe_routing, cfg.moe_shared_expert, cfg.use_qk_norm) == (
    "moe",
    "sigmoid_input",
    True,
    True,
  )
  assert cfg.layer_types == ("chunked_attention", "full_attention") and cfg.attention_chunk_size == C
  assert cfg.rope_layout == "interleaved" and not cfg.tie_embeddings


def test_full_forward_with_padding_matches_transformers(hf, model):
  from jaxpe.model.hf_weights import from_hf_model

  tokens, mask = _inputs(17)
  ref = _hf_logits(hf, tokens, mask)
  real = mask.astype(bool)
  assert np.abs(_forward(model)(tokens, mask) - ref)[real].max() < TOL
  # the chunks act: the same weights without them no longer match
  unchunked = from_hf_model(hf, layer_types=None, attention_chunk_size=None)
  assert np.abs(_forward(unchunked)(tokens, mask) - ref)[real].max() > 1e-3


def test_cached_generation_past_chunks_matches_transformers(hf, model):
  """transformers' greedy ``generate`` (its chunked cache) and its per-step logits against jaxpe's
  decoder on the ring-buffer KV cache, one compiled step: the prompt (padding too) fed a token at a
  time, then the tokens transformers chose."""
  from jaxpe.model.cache import init_cache

  tokens, mask = _inputs(6)
  new = 9
  ref_tokens, ref_logits = hf_greedy(hf, tokens, mask, new)
  cache = init_cache(model.cfg, 2, tokens.shape[1] + new)
  assert min(c.shape[2] for c in cache.k) == C - 1  # the chunked layer keeps a ring of C - 1 slots
  got = token_by_token_logits(model, tokens, mask, ref_tokens, cache)
  assert np.abs(got - ref_logits).max() < TOL
