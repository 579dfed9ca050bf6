"""Hostile inputs against the model surface's contract (docs/contracts.md, 'Model, generation and
BLOOM'): ``ModelConfig``, ``Decoder.__call__``, ``init_cache``, ``generate``, ``bloom.from_hf`` /
``save_hf`` / ``config_from_hf``. Each row: (entry point, argument, bad value, exception, message
regex). The checks run before anything compiles, so the table is cheap."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from flax import nnx

from jaxpe import bloom
from jaxpe.model.cache import init_cache
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.model.generate import generate

V = 16
CFG = ModelConfig(vocab_size=V, d_model=16, num_layers=2, num_heads=2, max_len=8)


@pytest.fixture(scope="module")
def model():
  return Decoder(CFG, rngs=nnx.Rngs(0))


PROMPT = np.ones((1, 3), np.int32)

# ------------------------------------------------------------------------------------------------
# ModelConfig: every field refused at construction, the message names the field

CONFIG_CASES = [
  ("vocab_size", 0, "vocab_size"),
  ("vocab_size", -3, "vocab_size"),
  ("vocab_size", 2.5, "vocab_size"),
  ("vocab_size", True, "vocab_size"),
  ("vocab_size", "256", "vocab_size"),
  ("d_model", 0, "d_model"),
  ("d_model", 30, r"d_model \(30\) must be divisible by num_heads \(4\)"),
  ("num_layers", 0, "num_layers"),
  ("num_layers", None, "num_layers"),
  ("num_heads", -1, "num_heads"),
  ("num_kv_heads", 3, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
  ("num_kv_heads", 0, "num_kv_heads"),
  ("head_dim", 0, "head_dim"),
  ("mlp_dim", -4, "mlp_dim"),
  ("max_len", 0, "max_len"),
  ("max_len", 1.5, "max_len"),
  ("pos_encoding", "ropee", "pos_encoding"),
  ("pos_encoding", None, "pos_encoding"),
  ("rope_theta", 0.0, "rope_theta"),
  ("rope_theta", math.nan, "rope_theta"),
  ("rope_theta", math.inf, "rope_theta"),
  ("rotary_dim", 3, "rotary_dim must be even"),
  ("rotary_dim", 64, "rotary_dim must be even and <= head_dim"),
  ("rope_layout", "neox", "rope_layout"),
  ("alibi_heads", 2, "alibi_heads needs pos_encoding='alibi'"),
  ("rope_alibi_max_phase", 2.0, "rope_alibi_max_phase"),
  ("rope_alibi_max_phase", -0.1, "rope_alibi_max_phase"),
  ("rope_alibi_context", 0, "rope_alibi_context"),
  ("rope_alibi_order", 0, "rope_alibi_order"),
  ("rope_alibi_order", 9, "rope_alibi_order"),
  ("rope_alibi_in_projection", True, "rope_alibi_in_projection=True needs"),
  ("attn_implementation", "triton", "attn_implementation"),
  ("alibi_emulation", "approx", "alibi_emulation"),
  ("layernorm_eps", 0.0, "layernorm_eps"),
  ("layernorm_eps", math.nan, "layernorm_eps"),
  ("init_std", -0.02, "init_std"),
  ("init_std", math.inf, "init_std"),
  ("dtype", "float64", "dtype"),
  ("remat", "yes", "remat"),
  ("remat", True, "remat"),
  ("scan_layers", "true", "scan_layers"),
  ("use_bias", 1, "use_bias"),
  ("tie_embeddings", None, "tie_embeddings"),
  ("not_a_field", 1, "not_a_field"),
]


@pytest.mark.parametrize("field, value, match", CONFIG_CASES, ids=[f"{c[0]}={c[1]!r}" for c in CONFIG_CASES])
def test_model_config_refuses(field, value, match):
  with pytest.raises(pydantic.ValidationError, match=match):  # a ValueError
    ModelConfig(**{"num_heads": 4, field: value})


@pytest.mark.parametrize(
  "changes, match",
  [
    ({"pos_encoding": "rope", "head_dim": 3}, "head_dim must be even for pos_encoding='rope'"),
    ({"pos_encoding": "xpos", "head_dim": 5}, "head_dim must be even for pos_encoding='xpos'"),
    ({"pos_encoding": "rope_alibi", "head_dim": 7}, "head_dim must be even for pos_encoding='rope_alibi'"),
    ({"pos_encoding": "sinusoidal", "d_model": 7, "num_heads": 7}, "d_model must be even"),
    ({"pos_encoding": "alibi", "alibi_heads": 5}, "must be <= num_heads"),
    ({"pos_encoding": "none", "rotary_dim": 8}, "rotary_dim is only used by"),
  ],
)
def test_model_config_refuses_combinations(changes, match):
  with pytest.raises(pydantic.ValidationError, match=match):
    ModelConfig(**{"num_heads": 4, **changes})


# ------------------------------------------------------------------------------------------------
# generate


def _key(*a):
  return jax.random.key(0)


GENERATE_CASES = [
  # (argument, overrides, exception, regex)
  ("model", {"model": "decoder"}, TypeError, "model must be a jaxpe.model.Decoder"),
  ("prompt", {"prompt": PROMPT.astype(np.float32)}, TypeError, "prompt must hold integer token ids"),
  ("prompt", {"prompt": PROMPT.astype(bool)}, TypeError, "prompt must hold integer token ids"),
  ("prompt", {"prompt": PROMPT[0]}, ValueError, r"prompt must have shape \[B, T\]"),
  ("prompt", {"prompt": PROMPT[None]}, ValueError, r"prompt must have shape \[B, T\]"),
  ("prompt", {"prompt": "abc"}, TypeError, r"prompt must be an array of numbers"),
  ("prompt", {"prompt": None}, TypeError, r"prompt must be an array of numbers"),
  ("prompt", {"prompt": np.zeros((1, 0), np.int32)}, ValueError, "at least one token"),
  ("prompt", {"prompt": np.zeros((0, 3), np.int32)}, ValueError, "at least one token"),
  ("prompt", {"prompt": np.asarray([[1, V]])}, ValueError, r"prompt must be in \[0, vocab_size = 16\)"),
  ("prompt", {"prompt": np.asarray([[-1, 2]])}, ValueError, r"prompt must be in \[0, vocab_size = 16\)"),
  ("prompt", {"prompt": np.asarray([[2**40, 2]])}, ValueError, r"prompt must be in \[0, vocab_size"),
  ("max_new_tokens", {"max_new_tokens": 4.0}, TypeError, "max_new_tokens must be a Python int"),
  ("max_new_tokens", {"max_new_tokens": True}, TypeError, "max_new_tokens must be a Python int"),
  ("max_new_tokens", {"max_new_tokens": "4"}, TypeError, "max_new_tokens must be a Python int"),
  ("max_new_tokens", {"max_new_tokens": None}, TypeError, "max_new_tokens must be a Python int"),
  ("max_new_tokens", {"max_new_tokens": math.nan}, TypeError, "max_new_tokens must be a Python int"),
  ("max_new_tokens", {"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
  ("max_new_tokens", {"max_new_tokens": -2}, ValueError, "max_new_tokens must be >= 1"),
  ("max_new_tokens", {"max_new_tokens": 2**31}, ValueError, r"must be <= int32 positions"),
  (
    "attention_mask",
    {"attention_mask": np.ones((1, 3), np.float32)},
    TypeError,
    "attention_mask must be bool",
  ),
  (
    "attention_mask",
    {"attention_mask": np.ones((1, 4), bool)},
    ValueError,
    "attention_mask must have the prompt",
  ),
  (
    "attention_mask",
    {"attention_mask": np.ones((3,), bool)},
    ValueError,
    "attention_mask must have the prompt",
  ),
  (
    "attention_mask",
    {"attention_mask": np.ones((2, 3), bool)},
    ValueError,
    "attention_mask must have the prompt",
  ),
  ("attention_mask", {"attention_mask": np.asarray([[1, 2, 1]])}, ValueError, "0 .padding. or 1"),
  ("attention_mask", {"attention_mask": np.asarray([[1, -1, 1]])}, ValueError, "0 .padding. or 1"),
  (
    "attention_mask",
    {"attention_mask": np.zeros((1, 3), bool)},
    ValueError,
    r"rows \[0\] hold no real token",
  ),
  ("temperature", {"temperature": math.nan}, ValueError, r"temperature must be in \[0, inf\]"),
  ("temperature", {"temperature": -1.0}, ValueError, r"temperature must be in \[0, inf\]"),
  ("temperature", {"temperature": -math.inf}, ValueError, r"temperature must be in \[0, inf\]"),
  ("temperature", {"temperature": "0.5"}, TypeError, "temperature must be a Python number"),
  ("temperature", {"temperature": None}, TypeError, "temperature must be a Python number"),
  ("temperature", {"temperature": True}, TypeError, "temperature must be a Python number"),
  ("temperature", {"temperature": jnp.float32(0.5)}, TypeError, "temperature must be a Python number"),
  ("top_k", {"top_k": 0}, ValueError, r"top_k must be in \[1, vocab_size=16\]"),
  ("top_k", {"top_k": -1}, ValueError, r"top_k must be in \[1, vocab_size=16\]"),
  ("top_k", {"top_k": V + 1}, ValueError, r"top_k must be in \[1, vocab_size=16\]"),
  ("top_k", {"top_k": 2**63}, ValueError, r"top_k must be in \[1, vocab_size=16\]"),
  ("top_k", {"top_k": 2.0}, TypeError, "top_k must be None or a Python int"),
  ("top_k", {"top_k": True}, TypeError, "top_k must be None or a Python int"),
  ("rng", {"temperature": 1.0}, ValueError, "rng is required when temperature > 0"),
  ("rng", {"temperature": 1.0, "rng": 0}, TypeError, "rng must be a PRNG key"),
  ("rng", {"temperature": 1.0, "rng": "seed"}, TypeError, "rng must be a PRNG key"),
  ("rng", {"temperature": 1.0, "rng": np.zeros(3, np.uint32)}, TypeError, "rng must be a PRNG key"),
  ("rng", {"temperature": 1.0, "rng": np.zeros(2, np.float32)}, TypeError, "rng must be a PRNG key"),
  ("rng", {"temperature": 1.0, "rng": "split"}, ValueError, "rng must be one PRNG key"),
]


@pytest.mark.parametrize(
  "arg, overrides, exc, match", GENERATE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GENERATE_CASES)]
)
def test_generate_refuses(model, arg, overrides, exc, match):
  kwargs = {"model": model, "prompt": PROMPT, "max_new_tokens": 2, **overrides}
  if isinstance(kwargs.get("rng"), str) and kwargs["rng"] == "split":
    kwargs["rng"] = jax.random.split(jax.random.key(0), 2)
  with pytest.raises(exc, match=match):
    generate(kwargs.pop("model"), kwargs.pop("prompt"), **kwargs)


def test_generate_limits_of_the_position_encodings():
  learned = Decoder(CFG.model_copy(update={"pos_encoding": "learned"}), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"must be <= max_len \(8\) for pos_encoding='learned', got T=3"):
    generate(learned, PROMPT, max_new_tokens=6)


def test_generate_accepts_the_documented_forms(model):
  # lists, numpy int64, int 0/1 masks, legacy uint32[2] keys (equal to the typed key they wrap),
  # numpy integers for the int arguments, temperature inf, top_k = V
  greedy = generate(model, PROMPT, max_new_tokens=2)
  assert generate(model, PROMPT.tolist(), max_new_tokens=np.int64(2)).tolist() == greedy.tolist()
  masked = generate(model, PROMPT.astype(np.int64), max_new_tokens=2, attention_mask=np.ones((1, 3), np.int8))
  assert masked.tolist() == greedy.tolist()
  legacy = jax.random.PRNGKey(5)
  a = generate(model, PROMPT, max_new_tokens=3, temperature=1.0, top_k=V, rng=legacy)
  b = generate(
    model, PROMPT, max_new_tokens=3, temperature=1.0, top_k=V, rng=jax.random.wrap_key_data(legacy)
  )
  np.testing.assert_array_equal(a, b)
  c = generate(
    model, PROMPT, max_new_tokens=3, temperature=math.inf, top_k=np.int32(3), rng=jax.random.key(1)
  )
  assert c.shape == (1, 3) and c.dtype == jnp.int32


# ------------------------------------------------------------------------------------------------
# Decoder.__call__ and init_cache

TOKENS = np.ones((2, 3), np.int32)
DECODER_CASES = [
  ("tokens", {"tokens": TOKENS.astype(np.float32)}, TypeError, "tokens must hold integer token ids"),
  ("tokens", {"tokens": TOKENS.astype(bool)}, TypeError, "tokens must hold integer token ids"),
  ("tokens", {"tokens": TOKENS[0]}, ValueError, r"tokens must have shape \[B, T\]"),
  ("tokens", {"tokens": [[1, 2, 3], [4]]}, TypeError, r"tokens must be an array of numbers"),  # ragged
  ("positions", {"positions": [[0, 1, 2], [0]]}, TypeError, r"positions must be an array of numbers"),
  ("tokens", {"tokens": TOKENS[None]}, ValueError, r"tokens must have shape \[B, T\]"),
  ("tokens", {"tokens": np.zeros((2, 0), np.int32)}, ValueError, "at least one token"),
  ("tokens", {"tokens": np.full((2, 3), V)}, ValueError, r"tokens must be in \[0, vocab_size = 16\)"),
  ("tokens", {"tokens": np.full((2, 3), -1)}, ValueError, r"tokens must be in \[0, vocab_size = 16\)"),
  (
    "positions",
    {"positions": np.zeros((2, 4), np.int32)},
    ValueError,
    "positions must have the shape of tokens",
  ),
  (
    "positions",
    {"positions": np.zeros((3,), np.int32)},
    ValueError,
    "positions must have the shape of tokens",
  ),
  ("positions", {"positions": np.zeros((2, 3), np.float32)}, TypeError, "positions must be an integer array"),
  ("positions", {"positions": np.full((2, 3), -1)}, ValueError, "positions must be >= 0"),
  ("positions", {"positions": np.full((2, 3), 2**31)}, ValueError, "positions must be < 2.31"),
  (
    "attention_mask",
    {"attention_mask": np.ones((2, 3), np.float32)},
    TypeError,
    "attention_mask must be bool",
  ),
  (
    "attention_mask",
    {"attention_mask": np.ones((2, 2), bool)},
    ValueError,
    "attention_mask must have the shape",
  ),
  ("segment_ids", {"segment_ids": np.ones((2, 3), np.float32)}, TypeError, "segment_ids must be an integer"),
  ("segment_ids", {"segment_ids": np.ones((1, 3), np.int32)}, ValueError, "segment_ids must have the shape"),
  (
    "segment_ids",
    {"segment_ids": np.ones((2, 3), np.int32), "cache": "ok"},
    ValueError,
    "cannot be combined",
  ),
  ("cache", {"cache": "cache"}, TypeError, "cache must be a KVCache"),
  ("cache", {"cache": ("b", 3, 8)}, ValueError, r"cache.k\[0\] must have shape \(2, 2, 8, 8\)"),
  ("cache", {"cache": ("l", 2, 8)}, ValueError, "cache.k must hold num_layers = 2 arrays"),
  ("cache", {"cache": ("dtype", 2, 8)}, TypeError, r"cache.k\[0\] must have dtype float32"),
  ("cache", {"cache": ("ok", 2, 2)}, ValueError, "the KV cache has 2 slots; 3 new tokens do not fit"),
  ("cache", {"cache": ("full", 2, 4)}, ValueError, "the KV cache has 4 slots; 3 new tokens after 2 filled"),
]


def _cache(kind, batch, slots):
  if kind == "ok":
    return init_cache(CFG, batch, slots)
  if kind == "b":
    return init_cache(CFG, batch, slots)
  if kind == "l":
    return init_cache(CFG.model_copy(update={"num_layers": 3}), batch, slots)
  if kind == "dtype":
    return init_cache(CFG.model_copy(update={"dtype": "bfloat16"}), batch, slots)
  if kind == "full":
    return init_cache(CFG, batch, slots)._replace(end=jnp.asarray(2, jnp.int32))
  raise AssertionError(kind)


@pytest.mark.parametrize(
  "arg, overrides, exc, match", DECODER_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(DECODER_CASES)]
)
def test_decoder_call_refuses(model, arg, overrides, exc, match):
  kwargs = {"tokens": TOKENS, **overrides}
  if kwargs.get("cache") == "ok":
    kwargs["cache"] = init_cache(CFG, 2, 8)
  elif isinstance(kwargs.get("cache"), tuple):
    kwargs["cache"] = _cache(*kwargs["cache"])
  with pytest.raises(exc, match=match):
    model(kwargs.pop("tokens"), **kwargs)


def test_learned_positions_beyond_the_table_are_refused():
  learned = Decoder(CFG.model_copy(update={"pos_encoding": "learned"}), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"positions must be in \[0, max_len"):
    learned(TOKENS, positions=np.full((2, 3), 8))
  with pytest.raises(ValueError, match="exceeds max_len=8"):
    learned(np.ones((1, 9), np.int32))


@pytest.mark.parametrize(
  "args, exc, match",
  [
    (("cfg", 1, 4), TypeError, "cfg must be a jaxpe.config.ModelConfig"),
    ((CFG, 0, 4), ValueError, "batch_size must be a positive integer"),
    ((CFG, -1, 4), ValueError, "batch_size must be a positive integer"),
    ((CFG, 1.0, 4), ValueError, "batch_size must be a positive integer"),
    ((CFG, 1, 0), ValueError, "max_len must be a positive integer"),
    ((CFG, 1, "4"), ValueError, "max_len must be a positive integer"),
    ((CFG, 1, None), ValueError, "max_len must be a positive integer"),
  ],
)
def test_init_cache_refuses(args, exc, match):
  with pytest.raises(exc, match=match):
    init_cache(*args)


# ------------------------------------------------------------------------------------------------
# bloom.from_hf / config_from_hf / save_hf (the file and state-dict errors: tests/bloom_test.py)

BLOOM_CFG = {"model_type": "bloom", "vocab_size": V, "hidden_size": 16, "n_layer": 1, "n_head": 2}


@pytest.mark.parametrize(
  "call, exc, match",
  [
    (lambda: bloom.from_hf(42), TypeError, "source must be a BloomForCausalLM"),
    (lambda: bloom.from_hf(None), TypeError, "source must be a BloomForCausalLM"),
    (lambda: bloom.from_hf({}), ValueError, "hf_config is required"),
    (lambda: bloom.from_hf({}, hf_config=["bloom"]), TypeError, "hf_config must be a mapping"),
    (lambda: bloom.from_hf({}, hf_config={**BLOOM_CFG, "model_type": "gpt2"}), ValueError, "model_type"),
    (lambda: bloom.from_hf({}, hf_config={**BLOOM_CFG, "n_head": 3}), ValueError, "divisible by n_head"),
    (
      lambda: bloom.from_hf({}, hf_config={**BLOOM_CFG, "n_layer": -1}),
      ValueError,
      "n_layer must be a positive",
    ),
    (lambda: bloom.from_hf({}, hf_config=BLOOM_CFG), bloom.CheckpointError, "missing keys"),
    (lambda: bloom.from_hf({}, hf_config=BLOOM_CFG, dtype="float64"), ValueError, "dtype"),
    (lambda: bloom.from_hf({}, hf_config=BLOOM_CFG, max_len=0), ValueError, "max_len"),
    (lambda: bloom.from_hf("/nonexistent/bloom"), FileNotFoundError, "does not exist"),
    (
      lambda: bloom.config_from_hf({**BLOOM_CFG, "apply_residual_connection_post_layernorm": True}),
      ValueError,
      "apply_residual_connection_post_layernorm",
    ),
  ],
)
def test_bloom_import_refuses(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


def test_bloom_export_refuses(model, tmp_path):
  bloom_model = Decoder(bloom.config_from_hf(BLOOM_CFG), rngs=nnx.Rngs(0))
  cases = [
    (lambda: bloom.save_hf("model", tmp_path / "a"), TypeError, "model must be a jaxpe.model.Decoder"),
    (lambda: bloom.save_hf(bloom_model, 5), TypeError, "path must be a non-empty str"),
    (lambda: bloom.save_hf(bloom_model, ""), TypeError, "path must be a non-empty str"),
    (
      lambda: bloom.save_hf(bloom_model, tmp_path / "b", overwrite="yes"),
      TypeError,
      "overwrite must be True",
    ),
    (lambda: bloom.save_hf(bloom_model, tmp_path / "c", force=1), TypeError, "force must be True"),
    (lambda: bloom.save_hf(model, tmp_path / "d"), ValueError, "to be a BLOOM model"),
  ]
  for call, exc, match in cases:
    with pytest.raises(exc, match=match):
      call()
  assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written by a refused export
  (tmp_path / "file").write_text("mine")
  with pytest.raises(FileExistsError, match="not a directory"):
    bloom.save_hf(bloom_model, tmp_path / "file")
  assert (tmp_path / "file").read_text() == "mine"


def test_traced_out_of_vocab_ids_give_nan_logits_never_another_token(model):
  # under jit the ids cannot be checked: the documented result is NaN logits for that row
  out = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray([[1, -1, 2], [1, V, 2], [1, 2, 3]])))
  assert np.isnan(out[:2]).all() and np.isfinite(out[2]).all()
  np.testing.assert_allclose(out[2], np.asarray(model(jnp.asarray([[1, 2, 3]])))[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_bloom_weights_with_nan_or_inf_are_refused_naming_the_key(bad):
  """A state dict with one NaN loaded without a word and gave NaN logits (found by the reviewer)."""
  import transformers

  hf = transformers.BloomForCausalLM(
    transformers.BloomConfig(**{k: v for k, v in BLOOM_CFG.items() if k != "model_type"})
  )
  state = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
  key = next(k for k in state if k.endswith("self_attention.dense.weight"))
  state[key][0, 1] = bad
  with pytest.raises(
    bloom.CheckpointError, match=r"checkpoint key '.*self_attention\.dense\.weight' holds 1 non-finite"
  ):
    bloom.from_hf(state, hf_config=BLOOM_CFG)
  state[key][0, 1] = 0.5  # the same dict with finite values loads
  bloom.from_hf(state, hf_config=BLOOM_CFG)


def test_rope_alibi_refuses_concrete_positions_spanning_more_than_its_context():
  """Second review: positions [[0, S]] with S past rope_alibi_context were accepted and the logits
  left ALiBi's (2.6e-3 off at S = 200) or met the op's theta message. The span is checked within the
  call and against the KV cache's positions; within the context the call matches ALiBi."""
  cfg = ModelConfig(
    vocab_size=V,
    d_model=16,
    num_layers=1,
    num_heads=4,
    max_len=64,
    pos_encoding="rope_alibi",
    rope_alibi_context=16,
  )
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray([[3, 5]], jnp.int32)
  for far in (16, 40, 400):
    with pytest.raises(ValueError, match=rf"positions span 0\.\.{far} .*rope_alibi_context = 16"):
      model(tokens, positions=np.asarray([[0, far]], np.int32))
  assert np.isfinite(np.asarray(model(tokens, positions=np.asarray([[100, 115]], np.int32)))).all()
  _, cache = model(tokens, positions=np.asarray([[0, 1]], np.int32), cache=init_cache(cfg, 1, 8))
  with pytest.raises(ValueError, match=r"positions span 0\.\.20 .*with the KV cache's"):
    model(jnp.asarray([[7]], jnp.int32), positions=np.asarray([[20]], np.int32), cache=cache)


def test_a_ragged_prompt_is_refused_naming_prompt():
  model = Decoder(
    ModelConfig(vocab_size=V, d_model=16, num_layers=1, num_heads=2, max_len=16), rngs=nnx.Rngs(0)
  )
  with pytest.raises(TypeError, match=r"prompt must be an array of numbers"):
    generate(model, [[1, 2], [3]], max_new_tokens=2)
