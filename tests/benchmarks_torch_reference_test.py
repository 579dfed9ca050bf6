"""The PyTorch reference of the train-step benchmark (``benchmarks/torch_reference.py``) is jaxpe's
model and optimizer: with jaxpe's parameters copied in, its logits and loss equal the jaxpe
``Decoder``'s, and one AdamW step of each (jaxpe's trainer step, the reference's step) gives the same
next loss (float32, within 1e-5)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.train import steps
from jaxpe.train.config import TrainConfig
from jaxpe.train.optimizer import make_optimizer

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# init_std 0.3: attention weights far from uniform, so positions and every layer move the loss
# (at the default 0.02 every model's loss is log V to 1e-4).
CFG = ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=4, max_len=16, init_std=0.3)
TRAIN = TrainConfig(model=CFG, batch_size=3, seq_len=16, warmup_steps=0, num_steps=10)


@pytest.fixture(scope="module")
def torch_reference():
  """benchmarks/torch_reference.py, imported by the tests that use it (it imports torch: seconds
  that collecting the suite does not pay)."""
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import torch_reference
  finally:
    sys.path.remove(str(BENCHMARKS))
  return torch_reference


@pytest.fixture(scope="module")
def jaxpe_model():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def _models(torch_reference, model):
  reference = torch_reference.TorchDecoder.from_config(CFG, seed=1)
  torch_reference.load_jaxpe_params(reference, model)
  batch = np.random.default_rng(0).integers(0, CFG.vocab_size, (3, 17))
  return reference, batch


def test_same_logits_and_loss_at_init(torch_reference, jaxpe_model):
  import torch

  reference, batch = _models(torch_reference, jaxpe_model)
  graphdef, state = nnx.split(jaxpe_model)

  @jax.jit
  def logits_and_loss(state, batch):
    model = nnx.merge(graphdef, state)
    return model(batch[:, :-1]), steps.next_token_loss(model, batch)

  logits, loss = logits_and_loss(state, jnp.asarray(batch, jnp.int32))
  logits, loss = np.asarray(logits), float(loss)
  with torch.no_grad():
    t_batch = torch.from_numpy(batch)
    t_logits = reference(t_batch[:, :-1]).numpy()
    t_loss = float(reference.loss(t_batch))
    # Without RoPE (phases 0) the loss moves far more than the tolerance: the comparison sees positions.
    reference.cos.fill_(1.0)
    reference.sin.fill_(0.0)
    no_rope = float(reference.loss(t_batch))
  print(f"loss jaxpe {loss:.7f}, torch {t_loss:.7f}, torch without RoPE {no_rope:.7f}")
  assert abs(loss - np.log(CFG.vocab_size)) > 0.1  # not the uniform-prediction loss
  assert abs(no_rope - loss) > 1e-3
  np.testing.assert_allclose(t_logits, logits, rtol=1e-5, atol=1e-5)
  assert abs(t_loss - loss) < 1e-5


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam mixes Python floats and int32 counts
def test_one_optimizer_step_gives_the_same_next_loss(torch_reference, jaxpe_model):
  import torch

  reference, batch = _models(torch_reference, jaxpe_model)
  model = nnx.clone(jaxpe_model)
  graphdef, state = nnx.split((model, nnx.Optimizer(model, make_optimizer(TRAIN), wrt=nnx.Param)))
  train_step = steps.make_train_step(graphdef)
  t_step = torch_reference.make_train_step(reference, TRAIN)
  jb, tb = jnp.asarray(batch, jnp.int32), torch.from_numpy(batch)
  losses, t_losses = [], []
  for _ in range(2):
    state, metrics = train_step(state, jb)
    losses.append(float(metrics["loss"]))
    t_losses.append(t_step(tb))
  print(f"losses jaxpe {losses}, torch {t_losses}")
  assert float(metrics["grad_norm"]) > TRAIN.grad_clip  # clipping is exercised
  assert abs(losses[1] - losses[0]) > 1e-2  # the step changed the model
  np.testing.assert_allclose(t_losses, losses, rtol=0, atol=1e-5)


def test_nanogpt_generate_gives_jaxpes_greedy_tokens(torch_reference):
  # the generation benchmark's torch side (nanoGPT's generate: no cache, the window recomputed)
  import torch

  from jaxpe.model.generate import generate

  model = Decoder(CFG, rngs=nnx.Rngs(0))  # its own: the train-step test donates the shared model's arrays
  reference, _ = _models(torch_reference, model)
  prompt = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 5))
  want = reference.generate(torch.as_tensor(prompt), 8).numpy()
  got = np.asarray(generate(model, jnp.asarray(prompt, jnp.int32), max_new_tokens=8))
  np.testing.assert_array_equal(got, want)
  assert len(set(want.ravel().tolist())) > 1
