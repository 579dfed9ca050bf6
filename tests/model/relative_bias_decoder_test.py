"""Decoders with the learned relative biases (t5, kerple_log, kerple_power, fire): a few training
steps on CPU lower the loss with finite, nonzero gradients reaching the bias parameters;
scan_layers equals the loop; fused kernels refuse the bias. Cached decoding, padding and
packing: tests/model/decoder_pe_test.py runs every registered encoding."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder, to_scan_layout

pytestmark = pytest.mark.usefixtures("standard_promotion")

TINY = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=2, max_len=32, init_std=0.2)
ENCODINGS = ["t5", "kerple_log", "kerple_power", "fire"]
# where each encoding keeps its parameters in the state dict
BIAS_PARAMS = {
  "t5": lambda s: [s["relative_attention_bias"]],
  "kerple_log": lambda s: [s["blocks"][i]["attn"]["kerple"][n] for i in (0, 1) for n in ("r1", "r2")],
  "kerple_power": lambda s: [s["blocks"][i]["attn"]["kerple"][n] for i in (0, 1) for n in ("r1", "r2")],
  "fire": lambda s: [s["blocks"][i]["attn"]["fire"][n] for i in (0, 1) for n in ("w2", "c", "L_multiplier")],
}


def _batch():
  rng = np.random.default_rng(3)
  period = rng.integers(1, 32, (4, 5))  # a repeating pattern: position information helps
  return jnp.asarray(np.tile(period, (1, 4)), jnp.int32)  # [4, 20]


@pytest.mark.parametrize("pe", ENCODINGS)
def test_training_steps_lower_the_loss_and_reach_the_bias_parameters(pe):
  model = Decoder(ModelConfig(**TINY, pos_encoding=pe), rngs=nnx.Rngs(0))
  tokens = _batch()
  graphdef, state = nnx.split(model)
  opt = optax.adam(3e-2)
  opt_state = opt.init(state)

  def loss_fn(state):
    logits = nnx.merge(graphdef, state)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @jax.jit
  def step(state, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(state)
    updates, opt_state = opt.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss, grads

  losses = []
  for i in range(6):
    state, opt_state, loss, grads = step(state, opt_state)
    losses.append(float(loss))
    if i == 0:
      assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
      bias_grads = BIAS_PARAMS[pe](grads.to_pure_dict())
      assert all(float(jnp.abs(g).max()) > 0 for g in bias_grads), pe  # the bias is learned
  print(f"{pe}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
  assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("pe", ["t5", "fire"])  # the table shared by all layers; per-layer modules
def test_scan_layers_equals_the_loop(pe):
  tokens = _batch()
  model = Decoder(ModelConfig(**TINY, pos_encoding=pe), rngs=nnx.Rngs(1))
  logits = model(tokens)
  scanned = Decoder(ModelConfig(**TINY, pos_encoding=pe, scan_layers=True), rngs=nnx.Rngs(2))
  nnx.update(scanned, to_scan_layout(nnx.state(model).to_pure_dict()))
  np.testing.assert_allclose(scanned(tokens), logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl", ["cudnn", "splash", "pallas_gpu"])
def test_fused_kernels_refuse_the_bias(impl):
  # at config time, naming the encoding and the backend (the kernel-level refusal, for 'auto' on an
  # accelerator: tests/attention/position_bias_test.py)
  for pe in ("t5", "kerple_log", "kerple_power", "fire"):
    with pytest.raises(ValueError, match=f"pos_encoding='{pe}' is an additive bias .* got '{impl}'"):
      ModelConfig(**TINY, pos_encoding=pe, attn_implementation=impl)


@pytest.mark.parametrize("pe", ["kerple_log", "kerple_power"])
def test_kerple_uses_the_clamped_parameters_and_passes_their_gradient(pe):
  """The authors clamp r1, r2 >= 0.01 (power: r2 <= 2) before use: out-of-range parameters give the
  bias of the clamped ones (float64 formula), and the gradient passes the clamp (straight through)."""
  from jaxpe.model import encodings

  cfg = ModelConfig(**TINY, pos_encoding=pe)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  layer = model.blocks[0].attn
  layer.kerple.r1[...] = jnp.asarray([-1.0, 0.5], jnp.float32)
  layer.kerple.r2[...] = jnp.asarray([0.3, 5.0], jnp.float32)
  pos = jnp.asarray([[0, 1, 2, 7, 30]], jnp.int32)
  enc = encodings.for_config(cfg)
  got = np.asarray(enc.position_bias(layer, None, pos, pos).dense())
  r1 = np.array([0.01, 0.5])[None, :, None, None]
  r2 = np.array([0.3, 2.0 if pe == "kerple_power" else 5.0])[None, :, None, None]
  d = np.abs(np.array([0, 1, 2, 7, 30])[:, None] - np.array([0, 1, 2, 7, 30])[None, :]).astype(np.float64)
  want = -r1 * (np.log1p(r2 * d) if pe == "kerple_log" else d**r2)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  def loss(r1):  # a stand-in layer holding the traced r1 (an nnx.Param cannot take a tracer here)
    stand_in = SimpleNamespace(kerple=SimpleNamespace(r1=r1, r2=layer.kerple.r2[...]))
    return jnp.sum(enc.position_bias(stand_in, None, pos, pos).dense())

  grad = np.asarray(jax.grad(loss)(jnp.asarray([-1.0, 0.5], jnp.float32)))
  assert grad[0] != 0 and np.isfinite(grad).all()  # straight through the clamp at r1 = -1
