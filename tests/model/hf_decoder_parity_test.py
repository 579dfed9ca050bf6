"""Issue 47 parity: small random Mistral, Qwen3, Gemma 2 and Gemma 3 (text) models built from
transformers configs (nothing downloaded), imported by ``jaxpe.model.hf_weights.from_hf_model``, give
transformers' eager logits in float32: a full forward with left padding, and cached decoding past
the sliding window (several wraps of the ring-buffer cache), against transformers' own cached
``generate``. The reference is transformers' PyTorch code (independent of jaxpe's).

Tolerance measured on this machine (transformers 5.25, torch CPU), full forward, weights Normal(0,
0.3) so the soft-caps and windows act: max |delta logit| 4.3e-6 (gemma2, logits up to 3.0), 2.9e-6
(gemma3, 7.3), 8.1e-6 (mistral, 6.6), 1.3e-5 (qwen3, 7.3), float32 rounding of the two orders of
summation; asserted at 1e-4."""

import importlib

import jax
import numpy as np
import pytest
from flax import nnx
from hf_parity import hf_greedy


def _tf():
  return importlib.import_module("transformers")


def _torch():
  return importlib.import_module("torch")


TOL = 1e-4
COMMON = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  max_position_embeddings=128,
  initializer_range=0.3,
  attn_implementation="eager",
)
W = 5  # sliding_window: a prompt of 11 and 12 new tokens wrap the ring (4 slots) several times
FAMILIES = {
  "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=W)),
  "qwen3": (
    "Qwen3Config",
    "Qwen3ForCausalLM",
    dict(use_sliding_window=True, sliding_window=W, max_window_layers=2),
  ),
  "gemma2": (
    "Gemma2Config",
    "Gemma2ForCausalLM",
    dict(sliding_window=W, query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
  ),
  "gemma3": (
    "Gemma3TextConfig",
    "Gemma3ForCausalLM",
    dict(
      sliding_window=W,
      query_pre_attn_scalar=16,
      sliding_window_pattern=2,
      rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
      },
    ),
  ),
}


def _hf_model(family, **extra):
  torch = _torch()
  config_cls, model_cls, kw = FAMILIES[family]
  torch.manual_seed(0)
  cfg = getattr(_tf(), config_cls)(**COMMON, **{**kw, **extra})
  model = getattr(_tf(), model_cls)(cfg).eval().float()
  with torch.no_grad():  # norms away from their init (ones / zeros), so each one's weight matters
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.3 * torch.randn_like(p))
  return model


def _inputs(batch=2, t_len=11):
  tokens = np.random.default_rng(1).integers(0, 64, (batch, t_len))
  mask = np.ones((batch, t_len), np.int64)
  mask[1, :3] = 0  # left padding: positions count real tokens, windows count slots (transformers)
  return tokens, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_forward_with_padding_matches_transformers(family):
  from jaxpe.model.hf_weights import from_hf_model

  torch = _torch()
  hf = _hf_model(family)
  model = from_hf_model(hf)
  tokens, mask = _inputs(t_len=17)
  pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
  with torch.no_grad():
    ref = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits
  got = np.asarray(model(tokens, attention_mask=mask))
  real = mask.astype(bool)
  assert np.abs(got - ref.numpy())[real].max() < TOL
  assert "sliding_attention" in model.cfg.layer_types
  # the window acts: the same weights with full attention everywhere differ from transformers
  # (Gemma 3's local RoPE base needs sliding layers: its per-layer RoPE is checked below instead)
  if family != "gemma3":
    unwindowed = from_hf_model(hf, layer_types=None, sliding_window=None, sliding_window_pattern=None)
    assert np.abs(np.asarray(unwindowed(tokens, attention_mask=mask)) - ref.numpy())[real].max() > 1e-3


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])  # soft caps, local RoPE; the others: same cache code
def test_cached_generation_past_the_window_matches_transformers(family):
  """transformers' greedy ``generate`` (its sliding-window cache) and its per-step logits against
  jaxpe's decoder run step by step on the ring-buffer KV cache with the same tokens."""
  from jaxpe.model.cache import init_cache
  from jaxpe.model.generate import generate
  from jaxpe.model.hf_weights import from_hf_model

  _torch()
  hf = _hf_model(family)
  model = from_hf_model(hf)
  tokens, mask = _inputs()
  new = 12
  ref_tokens, ref_logits = hf_greedy(hf, tokens, mask, new)
  cache = init_cache(model.cfg, 2, tokens.shape[1] + new)
  assert min(c.shape[2] for c in cache.k) == W - 1  # the sliding layers keep a ring of w - 1 slots
  logits, cache = model(tokens, attention_mask=mask, cache=cache)
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda st, tok, c: nnx.merge(graphdef, st)(tok, cache=c))  # one compile, traced end
  last = [logits[:, -1]]
  for i in range(new - 1):
    logits, cache = step(state, ref_tokens[:, i : i + 1], cache)
    last.append(logits[:, -1])
  got = np.stack([np.asarray(x) for x in last], axis=1)
  assert np.abs(got - ref_logits).max() < TOL
  if family == "gemma3":  # jaxpe's generate (one compiled loop over the ring cache) too
    got_tokens = generate(model, tokens, attention_mask=mask, max_new_tokens=new)
    np.testing.assert_array_equal(np.asarray(got_tokens), ref_tokens)


def test_gemma3_local_layers_use_the_local_base_unscaled():
  """Gemma 3's per-layer RoPE: a jaxpe model whose local layers used the global base and scaling
  (rope_local_base_freq unset) no longer matches transformers."""
  from jaxpe.model.hf_weights import from_hf_model

  torch = _torch()
  hf = _hf_model("gemma3")
  tokens, mask = _inputs(t_len=9)
  pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
  with torch.no_grad():
    ref = hf(
      torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)
    ).logits.numpy()
  good = from_hf_model(hf)
  assert good.cfg.rope_local_base_freq == 100.0 and good.cfg.rope_theta == 10000.0
  assert good.cfg.rope_scaling.rope_type == "linear"
  real = mask.astype(bool)
  assert np.abs(np.asarray(good(tokens, attention_mask=mask)) - ref)[real].max() < TOL
  bad = from_hf_model(hf, rope_local_base_freq=None)
  assert np.abs(np.asarray(bad(tokens, attention_mask=mask)) - ref)[real].max() > 1e-3


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_soft_cap_keys_transformers_does_not_apply_are_not_read(family):
  """Gemma3Attention never passes ``attn_logit_softcapping`` to its attention (Mistral, Qwen3 have
  no caps): a config that carries the key gives transformers' logits, uncapped; Gemma 2 reads it
  (above)."""
  from jaxpe.model.hf_weights import from_hf_model

  torch = _torch()
  hf = _hf_model(family, attn_logit_softcapping=1.5)
  model = from_hf_model(hf)
  assert model.cfg.attn_logit_softcapping is None
  tokens, mask = _inputs(t_len=9)
  pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
  with torch.no_grad():
    ref = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits
  real = mask.astype(bool)
  assert np.abs(np.asarray(model(tokens, attention_mask=mask)) - ref.numpy())[real].max() < TOL


def test_attention_bias_is_read_where_transformers_applies_it():
  """``attention_bias``: Qwen3's attention puts biases on q, k, v and o (read, and transformers'
  logits); Mistral's has none whatever its config says (not read: no bias keys in its state dict)."""
  from jaxpe.model.hf_weights import from_hf_model

  torch = _torch()
  hf = _hf_model("qwen3", attention_bias=True)
  with torch.no_grad():  # the biases start at zero: move them so they matter
    for name, p in hf.named_parameters():
      if name.endswith("proj.bias"):
        p.add_(0.3 * torch.randn_like(p))
  model = from_hf_model(hf)
  assert model.cfg.attention_bias
  tokens, mask = _inputs(t_len=9)
  pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
  with torch.no_grad():
    ref = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits
  graphdef, state = nnx.split(model)
  got = jax.jit(lambda st, t, m: nnx.merge(graphdef, st)(t, attention_mask=m))(state, tokens, mask)
  real = mask.astype(bool)
  assert np.abs(np.asarray(got) - ref.numpy())[real].max() < TOL
  assert not from_hf_model(_hf_model("mistral", attention_bias=True)).cfg.attention_bias
