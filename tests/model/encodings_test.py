"""The positional-encoding interface (jaxpe.model.encodings): the registry behind
ModelConfig.pos_encoding, and a new encoding added with one class and its registration only."""

import jax
import numpy as np
import pydantic
import pytest
from flax import nnx

from jaxpe.model import encodings
from jaxpe.model.cache import init_cache
from jaxpe.model.config import POS_ENCODINGS, ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.model.encodings import PositionalEncoding, register
from jaxpe.ops import rope

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=32, init_std=0.2)


def test_the_registry_holds_every_encoding_the_config_accepts_in_order():
  assert tuple(encodings.REGISTRY) == POS_ENCODINGS
  # the built-in ones first, in this order (a registered encoding is appended after them)
  assert POS_ENCODINGS[:7] == ("none", "learned", "sinusoidal", "rope", "xpos", "alibi", "rope_alibi")
  for name, cls in encodings.REGISTRY.items():
    assert issubclass(cls, PositionalEncoding) and cls.name == name
    assert isinstance(encodings.for_config(ModelConfig(pos_encoding=name)), cls)


def test_register_refuses_a_taken_name_and_a_non_encoding():
  with pytest.raises(ValueError, match="pos_encoding 'rope' is already registered"):
    register("rope")(type("Again", (PositionalEncoding,), {}))
  with pytest.raises(TypeError, match="takes a PositionalEncoding subclass"):
    register("not_an_encoding")(object)
  assert "not_an_encoding" not in encodings.REGISTRY


@pytest.fixture
def toy():
  """A toy encoding, as a user would add it: RoPE at base 500 in the half layout."""

  class Toy(PositionalEncoding):
    def encode_qk(self, q, k, positions):
      return (
        rope.apply_rope(q, positions, base=500.0, layout="half"),
        rope.apply_rope(k, positions, base=500.0, layout="half"),
      )

  register("toy")(Toy)
  try:
    yield Toy
  finally:
    del encodings.REGISTRY["toy"]


def test_a_registered_encoding_is_accepted_by_the_config_and_runs_in_the_decoder(toy):
  cfg = ModelConfig(**TINY, pos_encoding="toy")
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  same_rope = Decoder(
    ModelConfig(**TINY, pos_encoding="rope", rope_theta=500.0, rope_layout="half"), rngs=nnx.Rngs(0)
  )
  nope = Decoder(ModelConfig(**TINY, pos_encoding="none"), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, TINY["vocab_size"])
  logits = np.asarray(model(tokens))
  # The toy creates no parameters: the same tree and values as NoPE; its hook alone changes the output.
  assert jax.tree.all(
    jax.tree.map(np.array_equal, nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(nope)))
  )
  assert not np.allclose(logits, np.asarray(nope(tokens)), atol=1e-3)
  np.testing.assert_allclose(logits, np.asarray(same_rope(tokens)), atol=2e-5, rtol=0)
  # Cached decoding (keys stored as encode_qk gives them) equals the full forward pass.
  first, cache = model(tokens[:, :7], cache=init_cache(cfg, 2, 12))
  rest, _ = model(tokens[:, 7:], cache=cache)
  np.testing.assert_allclose(np.concatenate([first, rest], axis=1), logits, atol=2e-5, rtol=0)


def test_an_unregistered_name_is_refused_with_the_registered_ones_listed():
  with pytest.raises(pydantic.ValidationError, match="Input should be 'none', 'learned', .*'rope_alibi'"):
    ModelConfig(pos_encoding="toy")
