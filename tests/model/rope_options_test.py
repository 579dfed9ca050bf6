"""NoPE layers (``no_rope_layers`` / ``no_rope_layer_interval``), p-RoPE (``rope_proportion``) and the
RoPE + emulated ALiBi hybrid (``rope_alibi_content_rope``) in the decoder (issue 20).

References: transformers' own Llama4TextConfig / SmolLM3Config for the schedule; a float64 numpy
transcription of gemma's ``apply_rope`` for p-RoPE; the decoder with ``pos_encoding='none'`` (same
weights: rope has no parameters) for NoPE layers; today's ``rope_alibi`` for the hybrid at frequency 0.
Cache, padding and packing of every option: tests/model/decoder_pe_test.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydantic
import pytest
from flax import nnx

from jaxpe.model import generate
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.ops import rope, rope_scaling

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=32, init_std=0.2)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 12)), jnp.int32)


def _logits(overrides):
  """Eager logits: the ops of every config of these shapes compile once (the training test runs the
  options under ``nnx.jit``)."""
  model = Decoder(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(0))
  return np.asarray(model(TOKENS))


# -- NoPE layers ------------------------------------------------------------------------------


@pytest.mark.parametrize("layers, interval", [(4, 4), (36, 4), (12, 3), (5, 1), (3, 7)])
def test_interval_schedule_equals_transformers(layers, interval):
  """transformers 5.24: Llama4TextConfig and SmolLM3Config both default ``no_rope_layers`` to
  ``int((layer_idx + 1) % no_rope_layer_interval != 0)``."""
  import transformers  # here, not when the file is collected

  cfg = ModelConfig(**{**TINY, "num_layers": layers, "no_rope_layer_interval": interval})
  for hf_cls in (transformers.Llama4TextConfig, transformers.SmolLM3Config):
    hf = hf_cls(num_hidden_layers=layers, no_rope_layer_interval=interval)
    assert list(cfg.rope_layers()) == [bool(f) for f in hf.no_rope_layers], hf_cls.__name__
  explicit = [1, 0, 0, 1, 1][: min(layers, 5)] + [1] * max(0, layers - 5)
  hf = transformers.SmolLM3Config(num_hidden_layers=layers, no_rope_layers=explicit)
  assert list(ModelConfig(**{**TINY, "num_layers": layers, "no_rope_layers": explicit}).rope_layers()) == [
    bool(f) for f in hf.no_rope_layers
  ]


def test_nope_layers_are_not_rotated():
  """All layers NoPE equals pos_encoding='none' bit for bit (same weights: rope has no parameters);
  a mixed schedule is neither none nor rope, and the scanned flags give the loop's logits."""
  none, rope_all = _logits({"pos_encoding": "none"}), _logits({})
  np.testing.assert_array_equal(_logits({"no_rope_layers": [0, 0]}), none)
  mixed = _logits({"no_rope_layers": [1, 0]})
  assert np.abs(mixed - none).max() > 1e-3 and np.abs(mixed - rope_all).max() > 1e-3
  np.testing.assert_allclose(
    _logits({"no_rope_layers": [1, 0], "scan_layers": True}), mixed, atol=1e-5, rtol=0
  )
  # xPos: a NoPE layer neither rotates nor scales.
  np.testing.assert_array_equal(_logits({"pos_encoding": "xpos", "no_rope_layer_interval": 1}), none)


# -- p-RoPE -----------------------------------------------------------------------------------


def gemma_apply_rope_f64(x, positions, *, base_frequency, rope_proportion, scale_factor=1.0):
  """google-deepmind/gemma ``gemma/gm/math/_positional_embeddings.py`` ``apply_rope``, transcribed to
  numpy float64."""
  head_dim = x.shape[-1]
  rope_angles = int(rope_proportion * head_dim // 2)
  nope_angles = head_dim // 2 - rope_angles
  freq_exponents = (2.0 / head_dim) * np.arange(0, rope_angles, dtype=np.float64)
  timescale = np.pad(base_frequency**freq_exponents, (0, nope_angles), constant_values=(0, np.inf))
  sinusoid_inp = np.asarray(positions, np.float64)[..., None] / timescale[None, None, :]
  sinusoid_inp = sinusoid_inp[..., None, :] / scale_factor
  sin, cos = np.sin(sinusoid_inp), np.cos(sinusoid_inp)
  first_half, second_half = np.split(np.asarray(x, np.float64), 2, axis=-1)
  return np.concatenate([first_half * cos - second_half * sin, second_half * cos + first_half * sin], axis=-1)


@pytest.mark.parametrize("proportion, factor", [(0.75, 1.0), (0.25, 1.0), (0.5, 8.0), (1.0, 1.0)])
def test_p_rope_matches_gemma(proportion, factor):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 9, 3, 16)).astype(np.float32)
  pos = rng.integers(0, 5000, (2, 9)).astype(np.int32)
  inv_freq = rope_scaling.p_rope_inv_freq(16, proportion=proportion, rope_theta=10000.0, factor=factor)

  @jax.jit
  def f(x):
    return rope.apply_rope(x, pos, inv_freq=inv_freq, layout="half")

  want = gemma_apply_rope_f64(x, pos, base_frequency=10000.0, rope_proportion=proportion, scale_factor=factor)
  # The float32 frequencies (rounded once) times positions up to 5000: phases within ~5e-4 rad.
  np.testing.assert_allclose(f(x), want, atol=2e-3, rtol=0)
  # Gradient of a weighted sum: the rotation's transpose, i.e. gemma's rotation at -positions.
  w = rng.standard_normal(x.shape)
  g = jax.jit(jax.grad(lambda x: jnp.sum(f(x) * w)))(x)
  want_g = gemma_apply_rope_f64(
    w, -pos, base_frequency=10000.0, rope_proportion=proportion, scale_factor=factor
  )
  np.testing.assert_allclose(g, want_g, atol=2e-3, rtol=0)
  rotated = int(proportion * 16 // 2)
  np.testing.assert_array_equal(np.asarray(f(x))[..., rotated:8], x[..., rotated:8])  # position-free


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"proportion": 0.0}, ValueError, "proportion must be in \\(0, 1\\]"),
    ({"proportion": 1.25}, ValueError, "proportion must be in"),
    ({"proportion": True}, TypeError, "proportion must be a number"),
    ({"proportion": 0.5, "rope_theta": float("inf")}, ValueError, "rope_theta must be finite and > 0"),
    ({"proportion": 0.5, "factor": 0.0}, ValueError, "factor"),
  ],
)
def test_p_rope_inv_freq_refuses(kwargs, error, match):
  with pytest.raises(error, match=match):
    rope_scaling.p_rope_inv_freq(16, **kwargs)
  with pytest.raises(ValueError, match="head_dim"):
    rope_scaling.p_rope_inv_freq(15, proportion=0.5)


def test_p_rope_at_one_is_plain_rope_exactly():
  np.testing.assert_array_equal(
    rope_scaling.p_rope_inv_freq(64, proportion=1.0, rope_theta=500.0),
    rope_scaling.rope_frequencies(None, head_dim=64, rope_theta=500.0)[0],
  )
  np.testing.assert_array_equal(_logits({"rope_proportion": 1.0}), _logits({}))
  assert np.abs(_logits({"rope_proportion": 0.5}) - _logits({})).max() > 1e-3


# -- the hybrid ---------------------------------------------------------------------------------


def test_hybrid_at_frequency_zero_is_todays_rope_alibi_bit_for_bit():
  """BLOOM-style check: content frequencies all 0 (p-RoPE with ``int(0.1 * 8 // 2) = 0`` rotated
  pairs, or every layer NoPE) give today's rope_alibi logits exactly."""
  today = _logits({"pos_encoding": "rope_alibi"})
  hybrid = {"pos_encoding": "rope_alibi", "rope_alibi_content_rope": True}
  np.testing.assert_array_equal(_logits({**hybrid, "rope_proportion": 0.1}), today)
  np.testing.assert_array_equal(_logits({**hybrid, "no_rope_layers": [0, 0]}), today)
  assert np.abs(_logits(hybrid) - today).max() > 1e-3


# -- training -----------------------------------------------------------------------------------

OPTIONS = {  # every option trains; each config combines several to keep the compiles few
  "p-rope-nope-scan-remat": {
    "rope_proportion": 0.75,
    "no_rope_layers": [0, 1],
    "scan_layers": True,
    "remat": "full",
  },
  "xpos-nope": {"pos_encoding": "xpos", "no_rope_layer_interval": 2},
  "hybrid-linear-nope": {
    "pos_encoding": "rope_alibi",
    "rope_alibi_content_rope": True,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "no_rope_layer_interval": 2,
  },
}


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam mixes Python floats with int32 counts
@pytest.mark.parametrize("overrides", list(OPTIONS.values()), ids=list(OPTIONS))
def test_a_few_training_steps(overrides):
  model = Decoder(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  tokens = jnp.asarray(np.tile(np.arange(1, 17), (4, 1)) * 3 % 64, jnp.int32)  # a learnable pattern

  @nnx.jit
  def step(model, opt, tokens):
    def loss_fn(m):
      logits = m(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt, tokens)) for _ in range(5)]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


# -- config errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "overrides, match",
  [
    ({"no_rope_layers": [1, 0, 1]}, "num_layers \\(2\\) entries"),
    ({"no_rope_layers": [1, 2]}, "each 1 \\(RoPE\\) or 0"),
    ({"no_rope_layers": [1, 0], "no_rope_layer_interval": 2}, "not both"),
    ({"pos_encoding": "alibi", "no_rope_layer_interval": 2}, "need pos_encoding"),
    ({"pos_encoding": "rope_alibi", "no_rope_layers": [1, 0]}, "rope_alibi_content_rope=True"),
    ({"no_rope_layer_interval": 0}, "greater than 0"),
    ({"rope_proportion": 0.5, "rotary_dim": 4}, "no rotary_dim"),
    ({"rope_proportion": 0.5, "pos_encoding": "xpos"}, "needs pos_encoding 'rope'"),
    (
      {"rope_proportion": 0.5, "rope_scaling": {"rope_type": "ntk", "factor": 2.0}},
      "only with rope_scaling 'linear'",
    ),
    (
      {
        "rope_proportion": 0.5,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25},
      },
      "keys \\['partial_rotary_factor'\\] are not used with rope_proportion",
    ),
    (
      {
        "rope_proportion": 0.5,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0, "attention_factor": 3.0},
      },
      "keys \\['attention_factor'\\] are not used with rope_proportion",
    ),
    ({"rope_proportion": 1.5}, "less than or equal to 1"),
    ({"rope_alibi_content_rope": True}, "needs pos_encoding='rope_alibi'"),
    ({"pos_encoding": "rope_alibi", "rotary_dim": 4}, "rotary_dim is only used"),
  ],
)
def test_config_refuses_what_means_nothing(overrides, match):
  with pytest.raises(pydantic.ValidationError, match=match):
    ModelConfig(**{**TINY, **overrides})


def test_generation_with_nope_layers_and_the_hybrid_under_scan():
  """Greedy ``generate`` (KV cache, scanned layer flags) picks the full forward's argmax at every step."""
  cfg = ModelConfig(
    **{
      **TINY,
      "pos_encoding": "rope_alibi",
      "rope_alibi_content_rope": True,
      "rope_proportion": 0.5,
      "no_rope_layers": [0, 1],
      "scan_layers": True,
    }
  )
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  new = np.asarray(generate.generate(model, TOKENS[:, :6], max_new_tokens=4))
  assert new.shape == (2, 4)
  logits = np.asarray(model(jnp.concatenate([TOKENS[:, :6], jnp.asarray(new[:, :-1], jnp.int32)], axis=1)))
  np.testing.assert_array_equal(new, logits[:, 5:].argmax(-1))
