"""One optimizer factory (jaxpe.train.optimizer.make_optimizer) for a TrainConfig and for plain
arguments; the old names of the trainer's and the steps' modules are found in the new modules."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpe.train import optimizer, steps, trainer
from jaxpe.train.config import TrainConfig
from jaxpe.train.optimizer import OPTIMIZER_DEFAULTS, learning_rate_schedule, make_optimizer

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _updates(tx, n=4):
  params = {"w": jnp.ones((3, 3)), "b": jnp.ones(3)}
  state = tx.init(params)
  out = []
  for i in range(n):
    grads = jax.tree.map(lambda p, i=i: (i + 1) * 0.1 * p, params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    out.append(params)
  return out


def _assert_same(a, b):
  jax.tree.map(np.testing.assert_array_equal, _updates(a), _updates(b))


def test_a_config_and_plain_arguments_build_the_same_optimizer():
  cfg = TrainConfig(num_steps=8, learning_rate=0.5, warmup_steps=2, weight_decay=0.3, grad_clip=0.7)
  plain = make_optimizer(
    0.5, num_steps=8, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.3, b1=0.9, b2=0.95, grad_clip=0.7
  )
  _assert_same(make_optimizer(cfg), plain)
  # A keyword overrides the config's value (the trainer's fitted schedule).
  _assert_same(make_optimizer(cfg, num_steps=5), make_optimizer(cfg.model_copy(update={"num_steps": 5})))
  # Without a config the others default to OPTIMIZER_DEFAULTS.
  _assert_same(make_optimizer(0.5, num_steps=8), make_optimizer(0.5, num_steps=8, **OPTIMIZER_DEFAULTS))
  assert trainer.make_optimizer is optimizer.make_optimizer


def test_make_optimizer_refuses_bad_settings_naming_them():
  with pytest.raises(TypeError, match="needs num_steps when learning_rate is a number"):
    make_optimizer(0.1)
  cases = [
    ({"learning_rate": 0.0}, "learning_rate must be > 0, got 0.0"),
    ({"num_steps": 0}, "num_steps must be > 0, got 0"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
    ({"min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\], got 1.5"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0, got -0.1"),
    ({"b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
    ({"b2": -0.1}, r"b2 must be in \[0, 1\), got -0.1"),
    ({"grad_clip": 0.0}, "grad_clip must be > 0, got 0.0"),
  ]
  for change, message in cases:
    kw = {"learning_rate": 0.1, "num_steps": 10, **change}
    with pytest.raises(ValueError, match=message):
      make_optimizer(kw.pop("learning_rate"), **kw)
  with pytest.raises(ValueError, match="num_steps must be > 0, got 0"):
    make_optimizer(TrainConfig(), num_steps=0)


def test_learning_rate_schedule_warms_up_then_decays_to_its_floor():
  schedule = learning_rate_schedule(1.0, num_steps=10, warmup_steps=4, min_lr_ratio=0.1)
  assert [float(schedule(n)) for n in (0, 2, 4)] == pytest.approx([0.0, 0.5, 1.0])
  assert float(schedule(10)) == pytest.approx(0.1) and float(schedule(50)) == pytest.approx(0.1)
  assert 0.1 < float(schedule(7)) < 1.0


# Old flat module -> the modules its public names live in now (docs/architecture.md's changelog).
OLD_NAMES = {
  "jaxpe.trainer": (
    ("jaxpe.train.trainer", "jaxpe.train.run_checks", "jaxpe.train.state", "jaxpe.train.evaluation")
    + ("jaxpe.train.run_files", "jaxpe.train.loop", "jaxpe.train.run_log"),
    [
      "TrainResult",
      "abstract_state",
      "create_state",
      "decay_mask",
      "make_optimizer",
      "next_token_loss",
      "train",
      "RUN_DEFINING_KEYS",
      "RESUME_CHANGEABLE",
      "PROCESS_LOCAL_KEYS",
      "SHARED_CHECK_FILE",
      "RUN_FILES",
      "FIT_AFTER_STEPS",
      "check_resume_config",
      "check_resume_data",
      "check_processes_agree",
      "check_workdir_is_ours",
      "check_shared_workdir",
      "sample_text",
      "plot_loss_curve",
    ],
  ),
  "jaxpe.steps": (
    ("jaxpe.train.steps", "jaxpe.train.optimizer"),
    [
      "decay_mask",
      "make_optimizer",
      "next_token_loss",
      "accumulated_value_and_grad",
      "make_train_step",
      "make_eval_step",
    ],
  ),
}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_every_old_public_name_is_in_one_of_its_new_modules(old):
  modules, names = OLD_NAMES[old]
  modules = [importlib.import_module(m) for m in modules]
  for name in names:
    found = [getattr(m, name) for m in modules if hasattr(m, name)]
    assert found, f"{old}.{name} is in none of {[m.__name__ for m in modules]}"
    assert all(f is found[0] for f in found), f"{old}.{name}: two different objects"
  # The one factory answers both old call forms.
  assert steps.next_token_loss is trainer.next_token_loss


@pytest.mark.parametrize(
  "keys",
  [
    dict(attention_sinks=True, mlp_type="moe", num_local_experts=2, num_experts_per_tok=1, mlp_bias=True),
    dict(pos_encoding="kerple_log"),
    dict(pos_encoding="fire"),
  ],
  ids=["moe_sinks", "kerple", "fire"],
)
def test_decay_mask_skips_every_bias_and_is_the_same_in_both_layer_layouts(keys):
  """The moe experts' ``gate_bias`` / ``up_bias`` / ``down_bias`` (rank 2) are biases: not decayed
  (before: decayed); rank-1 layer parameters (sinks, KERPLE's r1 / r2, FIRE's vectors) are not
  decayed in the ``scan_layers`` layout either, where they are ``[L, .]`` (before: decayed there
  only, so a resume that changed ``scan_layers`` changed the training)."""
  from flax import nnx

  from jaxpe.model import Decoder
  from jaxpe.model.config import ModelConfig
  from jaxpe.model.decoder import to_scan_layout

  base = dict(vocab_size=16, d_model=16, num_heads=2, num_layers=2, max_len=16, **keys)
  masks = []
  for scan in (False, True):
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(
        lambda scan=scan: Decoder(ModelConfig(**base, scan_layers=scan), rngs=nnx.Rngs(0))
      )
    masks.append(optimizer.decay_mask(nnx.to_pure_dict(nnx.state(abstract, nnx.Param))))
  loop = masks[0]
  stacked = to_scan_layout(jax.tree.map(np.asarray, loop))  # per-layer decisions stacked over L
  assert jax.tree.map(lambda a: bool(a.all()), stacked) == jax.tree.map(bool, masks[1])
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(loop)[0]}
  for path, decayed in flat.items():
    leaf = path.rsplit("'", 2)[-2]
    assert decayed == (leaf in ("kernel", "embedding", "gate", "up", "down", "w2")), path  # w2: FIRE [32, N]
