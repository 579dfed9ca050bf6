"""Decoder with every positional encoding and rope_scaling type: cached decoding equals the full
forward pass; left/right-padded and packed batches equal unpadded single sequences at real tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from flax import nnx

from jaxpe.model.cache import init_cache
from jaxpe.model.config import POS_ENCODINGS, ModelConfig, RopeScalingConfig
from jaxpe.model.decoder import Decoder
from jaxpe.train.config import load_config

# init_std 0.2 (not 0.02): attention logits of order 1, so positions visibly change the outputs.
TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=32, init_std=0.2)
ATOL = 3e-5

SCALINGS = {
  "linear": {"rope_type": "linear", "factor": 2.0},
  "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
  "ntk": {"rope_type": "ntk", "factor": 4.0},
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
  "longrope": {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [1.0, 2.0, 8.0, 16.0],
    "original_max_position_embeddings": 16,
  },
  "llama3": {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
  },
}

# (id, config overrides): every pos_encoding, every scaling type, and RoPE/xPos variants.
CASES = [(pe, {"pos_encoding": pe}) for pe in POS_ENCODINGS]
CASES += [(f"rope-{name}", {"pos_encoding": "rope", "rope_scaling": s}) for name, s in SCALINGS.items()]
CASES += [
  (
    "rope-partial-half-gqa",
    {"pos_encoding": "rope", "rotary_dim": 4, "rope_layout": "half", "num_kv_heads": 2},
  ),
  ("xpos-yarn-half", {"pos_encoding": "xpos", "rope_layout": "half", "rope_scaling": SCALINGS["yarn"]}),
  ("alibi-mqa", {"pos_encoding": "alibi", "num_kv_heads": 1}),
  ("alibi-2-of-4-heads", {"pos_encoding": "alibi", "alibi_heads": 2}),
  # Issue 20: NoPE layers, p-RoPE, the RoPE + emulated ALiBi hybrid (tests/model/rope_options_test.py).
  ("rope-nope-layers", {"pos_encoding": "rope", "no_rope_layers": [0, 1]}),
  ("xpos-nope-interval", {"pos_encoding": "xpos", "no_rope_layer_interval": 2}),
  ("rope-nope-scan", {"pos_encoding": "rope", "no_rope_layers": [1, 0], "scan_layers": True}),
  ("p-rope-half", {"pos_encoding": "rope", "rope_proportion": 0.75, "rope_layout": "half"}),
  (
    "rope-alibi-hybrid-yarn-nope",
    {
      "pos_encoding": "rope_alibi",
      "rope_alibi_content_rope": True,
      "rope_scaling": SCALINGS["yarn"],
      "no_rope_layers": [1, 0],
    },
  ),
  ("rope-sinks", {"pos_encoding": "rope", "attention_sinks": True}),
  ("alibi-sinks-gqa", {"pos_encoding": "alibi", "attention_sinks": True, "num_kv_heads": 2}),
]
IDS = [c[0] for c in CASES]


def _model(overrides):
  return Decoder(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(0))


def _tokens(seed, length):
  return jax.random.randint(jax.random.key(seed), (1, length), 1, TINY["vocab_size"])


class Jitted:
  """``model`` called through one ``jax.jit`` of its graph and state (one program per call shape and
  set of keywords), as generation and training run it: the eager op-by-op calls compiled some 40
  programs a case and took 2-3x as long (sinusoidal 49 s eager vs 19 s jitted on the loaded 2-core
  machine); the eager path is tested by the other tests of the model."""

  def __init__(self, model):
    self.cfg = model.cfg
    graphdef, self.state = nnx.split(model)
    self._call = jax.jit(lambda state, tokens, kw: nnx.merge(graphdef, state)(tokens, **kw))

  def __call__(self, tokens, **kw):
    return self._call(self.state, tokens, kw)


@pytest.mark.parametrize("overrides", [c[1] for c in CASES], ids=IDS)
def test_cache_padding_and_packing_equal_single_sequences(overrides):
  check_cache_padding_and_packing(Jitted(_model(overrides)))


def check_cache_padding_and_packing(model):
  """All batches are [2, 12] (plus [2, 7] and [2, 1] for the cache), so eagerly compiled ops are
  shared. References: the unpadded, unpacked, uncached forward of each sequence; by causality its
  first n logits are those of the sequence's first n tokens."""
  seqs = jnp.concatenate([_tokens(10, 12), _tokens(11, 12)])  # two 12-token sequences
  ref = model(seqs)

  # 1. Left and right padding: row 0 holds the first 9 tokens of sequence 0, row 1 all of sequence 1.
  n = 9
  for side in ("left", "right"):
    row0 = jnp.pad(seqs[0, :n], (12 - n, 0) if side == "left" else (0, 12 - n))
    mask0 = jnp.arange(12) >= 12 - n if side == "left" else jnp.arange(12) < n
    out = model(jnp.stack([row0, seqs[1]]), attention_mask=jnp.stack([mask0, jnp.ones(12, bool)]))
    got0 = out[0, 12 - n :] if side == "left" else out[0, :n]
    np.testing.assert_allclose(got0, ref[0, :n], atol=ATOL, rtol=0, err_msg=f"{side} padding, short row")
    np.testing.assert_allclose(out[1], ref[1], atol=ATOL, rtol=0, err_msg=f"{side} padding, full row")

  # 2. Packing: row 0 = 5 tokens of sequence 0 then 7 of sequence 1; row 1 = 9 tokens of sequence 1
  # then 3 padding tokens as their own segment.
  packed = jnp.stack([jnp.concatenate([seqs[0, :5], seqs[1, :7]]), jnp.pad(seqs[1, :9], (0, 3))])
  seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3], jnp.int32)
  out = model(packed, segment_ids=seg)
  np.testing.assert_allclose(out[0, :5], ref[0, :5], atol=ATOL, rtol=0, err_msg="packed doc 0")
  np.testing.assert_allclose(out[0, 5:], ref[1, :7], atol=ATOL, rtol=0, err_msg="packed doc 1")
  np.testing.assert_allclose(out[1, :9], ref[1, :9], atol=ATOL, rtol=0, err_msg="packed doc 2")

  # 3. KV cache: prefill a left-padded batch of prompts (4 and 7 tokens; row 1 unpadded), then
  # decode one token at a time (5 tokens each).
  prompt_lens = (4, 7)
  prompts = jnp.stack([jnp.pad(seqs[b, :m], (7 - m, 0)) for b, m in enumerate(prompt_lens)])
  mask = jnp.asarray([[0] * (7 - m) + [1] * m for m in prompt_lens], bool)
  cache = init_cache(model.cfg, 2, 16)
  logits, cache = model(prompts, attention_mask=mask, cache=cache)
  got = [[logits[b, 7 - m :]] for b, m in enumerate(prompt_lens)]
  for t in range(5):
    step = jnp.stack([seqs[b, m + t : m + t + 1] for b, m in enumerate(prompt_lens)])
    logits, cache = model(step, cache=cache)
    for b in range(2):
      got[b].append(logits[b])
  for b, m in enumerate(prompt_lens):
    np.testing.assert_allclose(
      jnp.concatenate(got[b]), ref[b, : m + 5], atol=ATOL, rtol=0, err_msg=f"cached decoding, row {b}"
    )


def test_rope_scaling_reaches_the_model():
  # Linear scaling by 2 at positions 2p equals default RoPE at positions p (same weights).
  base = _model({"pos_encoding": "rope"})
  linear = _model({"pos_encoding": "rope", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
  tokens = jnp.concatenate([_tokens(30, 12), _tokens(31, 12)])
  idx = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  np.testing.assert_allclose(
    linear(tokens, positions=2 * idx), base(tokens, positions=idx), atol=ATOL, rtol=0
  )
  assert float(jnp.abs(linear(tokens) - base(tokens)).max()) > 1e-2


def test_alibi_on_a_subset_of_heads():
  # alibi_heads=2: heads 0, 1 get the slopes of a 2-head model (2**-4, 2**-8), heads 2, 3 no bias.
  full = _model({"pos_encoding": "alibi"})
  part = _model({"pos_encoding": "alibi", "alibi_heads": 2})
  none = _model({"pos_encoding": "none"})
  tokens = jnp.concatenate([_tokens(40, 12), _tokens(41, 12)])
  a, b, c = full(tokens), part(tokens), none(tokens)
  # Same weights, different biases: all three differ.
  assert float(jnp.abs(a - b).max()) > 1e-3 and float(jnp.abs(b - c).max()) > 1e-3
  # Attention of one layer by hand: heads 0, 1 use slopes 2**-4, 2**-8; heads 2, 3 are position-free.
  attn = part.blocks[0].attn
  x = jax.random.normal(jax.random.key(0), (1, 6, TINY["d_model"]))
  pos = jnp.arange(6, dtype=jnp.int32)[None]
  mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]
  out, _ = attn(x, pos, mask, kv_positions=pos)
  q, k, v = attn.q(x), attn.k(x), attn.v(x)
  logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(q.shape[-1])
  d = (pos[0][:, None] - pos[0][None, :]).astype(jnp.float32)
  slopes = jnp.asarray([2.0**-4, 2.0**-8, 0.0, 0.0], jnp.float32)
  logits = jnp.where(mask, logits - slopes[None, :, None, None] * d[None, None], -jnp.inf)
  ref = attn.o(jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v))
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_rope_scaling_config_from_yaml_dict_and_hashable():
  cfg = load_config(
    None,
    [
      "model.pos_encoding=rope",
      "model.max_len=64",
      "model.rope_scaling={type: longrope, short_factor: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], "
      "long_factor: [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], original_max_position_embeddings: 32}",
    ],
  )
  rs = cfg.model.rope_scaling
  assert isinstance(rs, RopeScalingConfig) and rs.rope_type == "longrope" and rs.short_factor[2] == 3.0
  hash(cfg.model)
  assert rs.as_dict()["long_factor"] == [2.0] * 16
  inv, factor = cfg.model.rope_frequencies()
  # seq_len = max_len 64 > 32: long factors, attention factor sqrt(1 + ln(2) / ln(32)).
  h = 32
  ref = 1.0 / (2.0 * 10000.0 ** (np.arange(0, h, 2) / h))
  np.testing.assert_allclose(inv, ref, rtol=1e-6)
  assert factor == pytest.approx(np.sqrt(1 + np.log(2) / np.log(32)), rel=1e-12)


def test_config_errors_name_the_key():
  with pytest.raises(pydantic.ValidationError, match="rope_type"):
    ModelConfig(rope_scaling={"rope_type": "cubic"})
  with pytest.raises(pydantic.ValidationError, match="facotr"):
    ModelConfig(rope_scaling={"rope_type": "linear", "facotr": 2.0})
  with pytest.raises(pydantic.ValidationError, match="missing required keys \\['factor'\\]"):
    ModelConfig(rope_scaling={"rope_type": "linear"})
  with pytest.raises(pydantic.ValidationError, match="short_factor"):
    ModelConfig(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})
  with pytest.raises(pydantic.ValidationError, match="rope_scaling needs pos_encoding"):
    ModelConfig(pos_encoding="alibi", rope_scaling={"rope_type": "linear", "factor": 2.0})
  with pytest.raises(pydantic.ValidationError, match="alibi_heads"):
    ModelConfig(pos_encoding="alibi", num_heads=4, alibi_heads=5)
  with pytest.raises(pydantic.ValidationError, match="alibi_heads"):
    ModelConfig(pos_encoding="rope", alibi_heads=2)
  with pytest.raises(pydantic.ValidationError, match="rotary_dim"):
    ModelConfig(pos_encoding="xpos", rotary_dim=6, d_model=16, num_heads=4)
