"""A KV cache rolled back by its end (issue 48, kind 2: state past the cache's end treated as live).

Speculative decoding rejects drafted tokens by moving ``cache.end`` back; the slots from ``end`` on
then hold the rejected tokens' keys, positions and valid flags. Every reader of the cache must treat
them as dead: the next chunk's positions (``next_positions_start``), the valid flags of the cache a
call returns, rope_alibi's span check. The reference is a full recomputation without a cache on the
accepted tokens only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.cache import init_cache, live_slots
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder


def _model(pe: str, **kw) -> Decoder:
  cfg = ModelConfig(
    vocab_size=32, d_model=32, num_layers=2, num_heads=4, max_len=32, pos_encoding=pe, init_std=0.5, **kw
  )
  return Decoder(cfg, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("pe", ["rope", "alibi", "learned", "fire", "t5"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_rolled_back_cache_continues_like_a_full_recomputation(pe, jit):
  model = _model(pe)
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, 32, (2, 6))
  drafted = rng.integers(1, 32, (2, 6))  # speculated tokens; the last 3 of them are rejected
  nxt = rng.integers(1, 32, (2, 2))
  mask = np.ones((2, 6), bool)
  mask[1, :2] = False  # row 1 left-padded
  call = nnx.jit(lambda m, t, c: m(t, cache=c)) if jit else (lambda m, t, c: m(t, cache=c))
  prefill = lambda m, t, c: m(t, attention_mask=jnp.asarray(mask), cache=c)  # noqa: E731
  _, cache = prefill(model, jnp.asarray(prompt), init_cache(model.cfg, 2, 16))
  _, cache = call(model, jnp.asarray(drafted), cache)
  assert int(cache.end) == 12
  cache = cache._replace(end=jnp.asarray(9, jnp.int32))  # keep 3 drafted tokens, reject 3
  logits, cache = call(model, jnp.asarray(nxt), cache)
  # Reference: no cache, the accepted tokens only (row 1 without its padding).
  for b in range(2):
    seq = np.concatenate([prompt[b][mask[b]], drafted[b, :3], nxt[b]])
    full = np.asarray(model(jnp.asarray(seq[None])), np.float64)[0, -2:]
    np.testing.assert_allclose(np.asarray(logits[b], np.float64), full, rtol=0, atol=2e-4)
  # The returned cache: slots 9, 10 hold the new tokens, 11 onward are dead (not valid).
  assert np.asarray(cache.valid)[:, 11:].sum() == 0 and int(cache.end) == 11
  np.testing.assert_array_equal(np.asarray(cache.positions)[:, 9:11], [[9, 10], [7, 8]])
  np.testing.assert_array_equal(np.asarray(live_slots(cache)), np.asarray(cache.valid))


def test_rope_alibi_span_check_reads_only_the_live_slots():
  model = _model("rope_alibi", rope_alibi_context=24)
  cache = init_cache(model.cfg, 1, 12)
  tokens = jnp.ones((1, 4), jnp.int32)
  _, cache = model(tokens, positions=jnp.arange(10, 14)[None], cache=cache)
  _, cache = model(tokens, positions=jnp.arange(30, 34)[None], cache=cache)  # span 10..33 < 24
  cache = cache._replace(end=jnp.asarray(4, jnp.int32))  # the 30..33 chunk rejected
  logits, _ = model(tokens, positions=jnp.arange(0, 4)[None], cache=cache)  # live span 0..13
  full = model(jnp.ones((1, 8), jnp.int32), positions=jnp.asarray([[10, 11, 12, 13, 0, 1, 2, 3]]))
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(full[0, 4:]), rtol=0, atol=2e-4)
  with pytest.raises(ValueError, match="rope_alibi_context"):  # the dead slots did count when live
    model(tokens, positions=jnp.arange(0, 4)[None], cache=cache._replace(end=jnp.asarray(8, jnp.int32)))


def test_next_positions_of_a_rolled_back_cache_under_jit():
  model = _model("rope")
  _, cache = model(jnp.ones((1, 12), jnp.int32), cache=init_cache(model.cfg, 1, 16))
  rolled = cache._replace(end=jnp.asarray(9, jnp.int32))
  _, out = jax.jit(lambda c: nnx.merge(*nnx.split(model))(jnp.ones((1, 1), jnp.int32), cache=c))(rolled)
  assert int(np.asarray(out.positions)[0, 9]) == 9  # was 12: read from the rejected slots
