"""Decoder: shapes, finiteness, causality, padding, KV cache, and configuration errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from flax import nnx

from jaxpe.model.cache import init_cache
from jaxpe.model.config import POS_ENCODINGS, ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.train.config import load_config

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=32)


def _model(pe, **kw):
  return Decoder(ModelConfig(**{**TINY, "pos_encoding": pe, **kw}), rngs=nnx.Rngs(0))


def _tokens(key, shape):
  return jax.random.randint(jax.random.key(key), shape, 0, TINY["vocab_size"])


@pytest.mark.parametrize("pe", POS_ENCODINGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_shape_and_finite(pe, dtype):
  logits = _model(pe, dtype=dtype)(_tokens(0, (3, 17)))
  assert logits.shape == (3, 17, TINY["vocab_size"]) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("pe", POS_ENCODINGS)
def test_causal_by_gradient(pe):
  """d logits[t] / d embedding row of the token at s is zero for every s > t (nanodo's test).

  Every position holds a distinct token and the output head is untied, so the embedding row of a
  token is the input at exactly one position.
  """
  model = _model(pe, tie_embeddings=False)
  tokens = jnp.arange(12, dtype=jnp.int32)[None]
  t = 5
  graphdef, state = nnx.split(model)

  def logits_at_t(state):
    return nnx.merge(graphdef, state)(tokens)[0, t].sum()

  grads = jax.grad(logits_at_t)(state)
  norms = np.asarray(jnp.linalg.norm(grads["embed"]["embedding"][...][:12], axis=-1))
  assert np.all(norms[t + 1 :] == 0.0), norms
  assert np.all(norms[: t + 1] > 0.0), norms


@pytest.mark.parametrize("pe", POS_ENCODINGS)
def test_future_tokens_do_not_change_past_logits(pe):
  model = _model(pe)
  a = _tokens(2, (2, 16))
  b = a.at[:, 9:].set(_tokens(3, (2, 7)))
  la, lb = model(a), model(b)
  np.testing.assert_array_equal(la[:, :9], lb[:, :9])
  assert not np.allclose(la[:, 9:], lb[:, 9:])


@pytest.mark.parametrize("pe", POS_ENCODINGS)
def test_cached_decoding_matches_full_forward(pe):
  model = _model(pe)
  tokens = _tokens(4, (2, 14))
  full = model(tokens)
  cache = init_cache(model.cfg, 2, 20)
  pieces = []
  for lo, hi in [(0, 6), (6, 7), (7, 8), (8, 14)]:
    logits, cache = model(tokens[:, lo:hi], cache=cache)
    pieces.append(logits)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=2e-5)


@pytest.mark.parametrize("pe", POS_ENCODINGS)
def test_left_padding_matches_unpadded(pe):
  model = _model(pe)
  row = _tokens(5, (1, 9))
  padded = jnp.concatenate([jnp.zeros((1, 4), row.dtype), row], axis=1)
  mask = jnp.concatenate([jnp.zeros((1, 4), bool), jnp.ones((1, 9), bool)], axis=1)
  np.testing.assert_allclose(model(padded, attention_mask=mask)[:, 4:], model(row), atol=2e-5)


def test_config_errors_name_the_key():
  with pytest.raises(pydantic.ValidationError, match="pos_encoding"):
    ModelConfig(pos_encoding="sinusoidal-ish")
  with pytest.raises(pydantic.ValidationError, match="head_dim must be even"):
    ModelConfig(d_model=28, num_heads=4, pos_encoding="rope")  # H = 7
  with pytest.raises(pydantic.ValidationError, match="rope_alibi_max_phase"):
    ModelConfig(rope_alibi_max_phase=1.6)
  with pytest.raises(pydantic.ValidationError, match="model.nm_layers"):
    load_config(None, ["model.nm_layers=3"])
  with pytest.raises(pydantic.ValidationError, match="batch_size"):
    load_config(None, ["batch_size=many"])


def test_learned_positions_reject_too_long_input():
  with pytest.raises(ValueError, match="max_len"):
    _model("learned")(_tokens(0, (1, TINY["max_len"] + 1)))


def test_out_of_range_inputs_are_errors_not_nans():
  model = _model("learned")
  with pytest.raises(ValueError, match=r"tokens must be in \[0, vocab_size = 64\)"):
    model(jnp.asarray([[1, 64, 2]]))
  with pytest.raises(ValueError, match=r"tokens must be in \[0, vocab_size"):
    model(jnp.asarray([[1, -1, 2]]))
  with pytest.raises(ValueError, match=r"positions must be in \[0, max_len"):
    model(jnp.asarray([[1, 2]]), positions=jnp.asarray([[31, 32]]))
  cache = init_cache(model.cfg, 1, 4)
  _, cache = model(jnp.asarray([[1, 2, 3]]), cache=cache)
  with pytest.raises(ValueError, match="KV cache has 4 slots"):
    model(jnp.asarray([[4, 5]]), cache=cache)


def test_xpos_stays_finite_over_a_long_context():
  # zeta ** (p / 512) underflows float32 near p = 36,000 unless queries and keys share an offset.
  model = _model("xpos", max_len=65536)
  tokens = _tokens(6, (1, 4))
  for start in (0, 40000, 65530):
    positions = jnp.arange(start, start + 4, dtype=jnp.int32)[None]
    assert bool(jnp.all(jnp.isfinite(model(tokens, positions=positions))))


def test_rope_alibi_refuses_sequences_and_caches_beyond_its_context():
  # Past rope_alibi_context the emulated bias leaves ALiBi (at distance 1000 with context 16 it is
  # positive where ALiBi's is -62.5): the model refuses, at trace time, instead of running on.
  cfg = ModelConfig(
    vocab_size=256,
    d_model=16,
    num_layers=1,
    num_heads=2,
    max_len=64,
    pos_encoding="rope_alibi",
    rope_alibi_context=16,
  )
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  assert model(jnp.zeros((1, 16), jnp.int32)).shape == (1, 16, 256)
  message = r"rope_alibi_context = 16 tokens, got a sequence or KV cache of 17 tokens"
  with pytest.raises(ValueError, match=message):
    model(jnp.zeros((1, 17), jnp.int32))
  with pytest.raises(ValueError, match=message):
    jax.jit(lambda t: model(t))(jnp.zeros((2, 17), jnp.int32))
  with pytest.raises(ValueError, match=message):
    model(jnp.zeros((1, 1), jnp.int32), cache=init_cache(cfg, 1, 17))
  model(jnp.zeros((1, 1), jnp.int32), cache=init_cache(cfg, 1, 16))
  # Unset, the context is max_len.
  default = Decoder(cfg.model_copy(update={"rope_alibi_context": None}), rngs=nnx.Rngs(0))
  default(jnp.zeros((1, 64), jnp.int32))
  with pytest.raises(ValueError, match=r"rope_alibi_context = 64 tokens, got a sequence or KV cache of 65"):
    default(jnp.zeros((1, 65), jnp.int32))


@pytest.mark.parametrize("pe", ["sinusoidal", "learned", "rope"])
def test_embed_inputs_scale_against_numpy(pe):
  """The first block's input against a float64 numpy recomputation from the parameters: the
  sinusoidal form is sqrt(D) E[token] + PE(position) (Vaswani et al., section 3.4) with E drawn at
  std D**-0.5, so token and position terms have the same order of magnitude; other encodings keep
  init_std and no scale."""
  model = _model(pe)
  d = TINY["d_model"]
  tokens = _tokens(3, (2, 9))
  positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9)) + jnp.array([[0], [5]], jnp.int32)
  got = np.asarray(model.embed_inputs(tokens, positions), np.float64)
  table = np.asarray(model.embed.embedding[...], np.float64)
  want = table[np.asarray(tokens)]
  pos = np.asarray(positions, np.float64)[..., None]
  if pe == "sinusoidal":
    w = 10000.0 ** (-np.arange(0, d, 2) / d)  # the paper's frequencies, interleaved sin/cos
    pe_table = np.empty((2, 9, d))
    pe_table[..., 0::2], pe_table[..., 1::2] = np.sin(pos * w), np.cos(pos * w)
    want = np.sqrt(d) * want + pe_table
    assert abs(table.std() - d**-0.5) < 0.15 * d**-0.5
  else:
    assert abs(table.std() - ModelConfig().init_std) < 0.15 * ModelConfig().init_std
  if pe == "learned":
    want = want + np.asarray(model.pos_embed.embedding[...], np.float64)[np.asarray(positions)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset", [0.0, 1.0, 100.0, 1e3, 1e4])
def test_layernorm_against_float64_at_large_offsets(offset):
  # issue 17: flax's fast variance E[x^2] - E[x]^2 normalised rows of 100 + 1e-3 k to -0.169, not -1.342
  model = _model("rope")
  rng = np.random.default_rng(0)
  for spread in (1e-3, 1e-1, 1.0, 10.0):
    x = offset + spread * np.concatenate([np.arange(32)[None], rng.normal(size=(3, 32))])
    x = x.astype(np.float32)
    x64 = x.astype(np.float64)  # the reference sees the same float32 inputs
    centred = x64 - x64.mean(-1, keepdims=True)
    ref = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + model.cfg.layernorm_eps)
    for norm in (model.final_norm, model.blocks[0].attn_norm):
      out = np.asarray(norm(jnp.asarray(x)), np.float64)
      assert np.abs(out - ref).max() < 1e-6, (offset, spread, np.abs(out - ref).max())
  if offset == 100.0:  # the row, to 3 decimals
    norm16 = _model("rope", d_model=16).final_norm
    row = np.asarray(norm16(jnp.asarray(100 + 1e-3 * np.arange(16), jnp.float32)[None]))
    ref16 = (np.arange(16) - 7.5) / np.sqrt(np.var(np.arange(16)) + 1e-5 / 1e-6)
    np.testing.assert_allclose(row[0, :2], [-1.342, -1.163], atol=2e-3)
    np.testing.assert_allclose(row[0], ref16, atol=1e-3)
