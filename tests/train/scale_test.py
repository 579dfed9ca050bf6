"""Scaling out on 8 fake CPU devices: meshes (data, fsdp, tensor) train like one device, scanned
and rematerialised layers train like the loop, FSDP divides parameter memory, gradient
accumulation equals the large batch, checkpoints move between meshes and layer layouts."""

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder, to_loop_layout, to_scan_layout
from jaxpe.train import checkpoint, sharding, steps, trainer
from jaxpe.train import state as state_lib
from jaxpe.train.config import TrainConfig, load_config

STEPS, BATCH, SEQ = 10, 8, 16
MODEL = ModelConfig(d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=SEQ)


pytestmark = pytest.mark.usefixtures("standard_promotion")


def _cfg(mesh_shape=(1, 1, 1), **model):
  return TrainConfig(
    model=MODEL.model_copy(update=model),
    seq_len=SEQ,
    batch_size=BATCH,
    num_steps=STEPS,
    learning_rate=3e-3,
    warmup_steps=2,
    mesh_shape=mesh_shape,
  )


def _batches():
  # Counting sequences from random starts (next token = token + 1 mod 256): learnable in 10 steps.
  starts = np.random.default_rng(0).integers(0, 256, (STEPS, BATCH, 1))
  return ((starts + np.arange(SEQ + 1)) % 256).astype(np.int32)


def _mesh(shape):
  n = int(np.prod(shape))
  return sharding.make_mesh(shape, devices=jax.devices()[:n])


@functools.cache
def _initial(model_cfg):
  # Built once on the host (no init compile per mesh); each mesh gets it by device_put.
  model = Decoder(model_cfg, rngs=nnx.Rngs(0))
  tx = trainer.make_optimizer(_cfg())
  graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
  return graphdef, jax.tree.map(np.asarray, state)  # host copies: the steps donate their input


RESUME_AT = 5
"""The step the resumed runs restart from (a checkpoint of it is restored)."""


def _losses(cfg, checkpoints=None):
  """The losses of STEPS steps on ``cfg``'s mesh from the shared initial state. With a
  ``checkpoints`` directory, also resumes: the state of step RESUME_AT is saved, restored the way
  the trainer does it (sharded restore and its non-finite check) and run again over the same
  batches; the resumed losses and final state must equal the uninterrupted run's bit for bit."""
  mesh = _mesh(cfg.mesh_shape)
  sharding.check_divisible(cfg.model, mesh, BATCH, seq_len=SEQ, rules=cfg.logical_rules)
  graphdef, state = _initial(cfg.model)
  shardings = sharding.state_shardings(state, mesh, cfg.logical_rules)
  state = jax.device_put(state, shardings)
  batch_sharding = sharding.batch_sharding(mesh, cfg.logical_rules)
  step = steps.make_train_step(
    graphdef, mesh=mesh, rules=cfg.logical_rules, state_shardings=shardings, batch_sharding=batch_sharding
  )

  def run(state, batches):
    out = []
    for batch in batches:
      state, metrics = step(state, jax.device_put(batch, batch_sharding))
      out.append(float(metrics["loss"]))
    return state, out

  if checkpoints is None:
    return np.asarray(run(state, _batches())[1])
  mngr = checkpoint.manager(checkpoints)
  state, first = run(state, _batches()[:RESUME_AT])
  checkpoint.save(mngr, RESUME_AT, state, {"step": RESUME_AT})
  state, rest = run(state, _batches()[RESUME_AT:])
  final = jax.tree.map(np.asarray, state)
  restored, meta = checkpoint.restore_latest(
    mngr, checkpoint.abstract_with_shardings(state, shardings), check_state=state_lib.nonfinite_reason
  )
  mngr.close()
  assert meta == {"step": RESUME_AT}
  resumed, resumed_rest = run(restored, _batches()[RESUME_AT:])
  assert resumed_rest == rest  # bit for bit
  for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(final)):
    np.testing.assert_array_equal(np.asarray(x), y)
  return np.asarray(first + rest)


@functools.cache
def _reference():
  return _losses(_cfg())


MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2), (1, 8, 1)]
SCAN_REMAT = {"scan_layers": True, "remat": "full"}
CASES = (
  [(shape, {}) for shape in MESHES]
  + [(shape, SCAN_REMAT) for shape in MESHES]
  + [((2, 2, 2), {"remat": "dots_saveable"}), ((1, 4, 2), {"scan_layers": True})]
)


@pytest.mark.parametrize(
  "shape, layers",
  CASES,
  ids=[
    "x".join(map(str, s)) + "-" + ("-".join(f"{k}={v}" for k, v in sorted(m.items())) or "loop")
    for s, m in CASES
  ],
)
def test_meshes_train_like_one_device_and_resume_bit_exactly(shape, layers, tmp_path):
  ref = _reference()
  losses = _losses(_cfg(shape, **layers), checkpoints=tmp_path)
  assert ref[-1] < ref[0] - 0.05  # it trains
  # Scanned layers start from the stacked loop parameters, so every variant equals the reference.
  np.testing.assert_allclose(losses, ref, rtol=0, atol=1e-5)


def test_gradient_accumulation_equals_the_large_batch():
  graphdef, state = _initial(MODEL)
  batch = _batches()[0]

  @functools.partial(jax.jit, static_argnums=2)
  def grads(state, batch, micro):
    model, _ = nnx.merge(graphdef, state)
    return steps.accumulated_value_and_grad(steps.next_token_loss, model, batch, micro)

  loss_b, grads_b = grads(state, batch, 1)
  loss_4, grads_4 = grads(state, batch, 4)
  # Reference: the mean of 4 separately computed quarter-batch gradients (float64 on the host).
  quarters = [grads(state, batch[i::4], 1) for i in range(4)]
  ref_loss = np.mean([float(q[0]) for q in quarters])
  ref = jax.tree.map(
    lambda *g: np.mean([np.asarray(x, np.float64) for x in g], axis=0), *[q[1] for q in quarters]
  )
  assert float(loss_4) == pytest.approx(ref_loss, rel=1e-6) and float(loss_b) == pytest.approx(
    ref_loss, rel=1e-6
  )
  for got in (grads_4, grads_b):
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-5, atol=1e-7), got, ref)
  with pytest.raises(ValueError, match="grad_accum_steps"):
    grads(state, batch, 3)


def test_fsdp_divides_parameter_bytes_per_device():
  _, state = _initial(MODEL)
  fsdp = sharding.state_shardings(state, _mesh((1, 8, 1)))
  placed = jax.device_put(state, fsdp)
  per_device = sharding.param_bytes_per_device(placed)
  total = sum(x.nbytes for x in jax.tree.leaves(state))
  unsharded = sum(
    x.nbytes for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(fsdp)) if s.is_fully_replicated
  )
  assert len(per_device) == 8 and len(set(per_device.values())) == 1
  print(f"FSDP 8: {max(per_device.values())} bytes/device of {total} replicated ({unsharded} unsharded)")
  assert max(per_device.values()) <= total / 8 + unsharded
  assert unsharded < 0.01 * total  # only step counters are left whole


def _assert_restored(restored, expected, shardings):
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), expected)
  for x, s in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)


def test_checkpoint_moves_between_meshes_and_layer_layouts(tmp_path):
  graphdef, state = _initial(MODEL)
  rng = np.random.default_rng(1)
  state = jax.tree.map(lambda x: (x + rng.normal(size=x.shape)).astype(x.dtype), state)  # not the init
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(
    mngr, 3, jax.device_put(state, sharding.state_shardings(state, _mesh((2, 4, 1)))), {"step": 3}
  )
  for shape in [(1, 2, 2), (4, 1, 1), (1, 1, 1)]:
    shardings = sharding.state_shardings(state, _mesh(shape))
    restored, meta = checkpoint.restore_latest(mngr, checkpoint.abstract_with_shardings(state, shardings))
    assert meta == {"step": 3}
    _assert_restored(restored, state, shardings)
  # The loop checkpoint read into the scan_layers layout (and back) by stacking the blocks.
  _, scan_state = _initial(MODEL.model_copy(update={"scan_layers": True}))
  stacked = to_scan_layout(state.to_pure_dict())
  assert jax.tree.structure(stacked) == jax.tree.structure(scan_state.to_pure_dict())
  jax.tree.map(np.testing.assert_array_equal, to_loop_layout(stacked), state.to_pure_dict())
  mngr.close()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_losses(workdir):
  return [json.loads(line)["loss"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _restored_flat(directory, cfg, shape):
  _, abstract = trainer.abstract_state(cfg, _mesh(shape))
  mngr = checkpoint.manager(directory)
  restored, _ = checkpoint.restore_latest(mngr, abstract)
  mngr.close()
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(restored)}


def _tiny_run(tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_bytes())
  return [
    f"data.path={corpus}",
    f"seq_len={SEQ}",
    f"batch_size={BATCH}",
    "num_steps=4",
    "warmup_steps=1",
    "eval_every=100",
    "eval_batches=1",
    "checkpoint_every=100",
    "async_checkpoints=true",
    "sample_len=0",
    "model.d_model=16",
    "model.num_layers=1",
    "model.num_heads=2",
    f"model.max_len={SEQ}",
  ]


def test_two_processes_train_like_one_and_resume_converts_layer_layouts(tmp_path):
  run = _tiny_run(tmp_path)
  one = [*run, f"workdir={tmp_path / 'one'}", "mesh_shape=[2, 4, 1]"]
  # One process, 8 devices, loop layers: steps 1-2, saved on (2, 4, 1).
  trainer.train(load_config(None, [*one, "stop_at=2"]), progress=False)
  shutil.copytree(tmp_path / "one" / "checkpoints", tmp_path / "one_at_2")
  # Two processes of 2 devices each on (1, 2, 2), steps 1-4: each reads half of every batch.
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  port, dump = _free_port(), tmp_path / "two.npz"
  procs = [
    subprocess.Popen(
      [sys.executable, str(Path(__file__).with_name("two_process_worker.py")), json.dumps(spec)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for spec in (
      {
        "port": port,
        "process_id": i,
        "overrides": [*run, f"workdir={tmp_path / 'two'}", "mesh_shape=[1, 2, 2]"],
        "restore_from": str(tmp_path / "one_at_2"),
        "dump": str(dump),
      }
      for i in range(2)
    )
  ]
  # Meanwhile the one-process run resumes with scanned, rematerialised layers (the loop checkpoint
  # is converted on restore) for steps 3-4.
  scan = ["model.scan_layers=true", "model.remat=full"]
  assert trainer.train(load_config(None, [*one, *scan]), progress=False).step == 4
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
  # The same losses as one process with the same global batches (meshes differ: 1e-5).
  np.testing.assert_allclose(_run_losses(tmp_path / "two"), _run_losses(tmp_path / "one"), rtol=0, atol=1e-5)
  # One process's checkpoint read by two processes, and two processes' checkpoint read by one
  # (on one device and on (4, 1, 1)): identical values.
  two = dict(np.load(dump))
  one_cfg = load_config(None, one)
  for key, value in _restored_flat(tmp_path / "one_at_2", one_cfg, (1, 1, 1)).items():
    np.testing.assert_array_equal(two["one" + key], value, err_msg=key)
  two_cfg = load_config(None, [*run, f"workdir={tmp_path / 'two'}"])
  for shape in [(1, 1, 1), (4, 1, 1)]:
    for key, value in _restored_flat(tmp_path / "two" / "checkpoints", two_cfg, shape).items():
      np.testing.assert_array_equal(two["own" + key], value, err_msg=key)
  # The resumed one-process run saved in the scanned layout ([L, ...] block parameters).
  flat = _restored_flat(tmp_path / "one" / "checkpoints", load_config(None, [*one, *scan]), (1, 1, 1))
  assert flat["[0]['blocks']['attn']['q']['kernel'].value"].shape[0] == 1


def test_mesh_shape_and_logical_rules_from_config():
  assert load_config(None, ["mesh_shape=[2, 4]"]).mesh_shape == (2, 1, 4, 1)  # old (data, model)
  assert load_config(None, ["mesh_shape=[-1, 2, 2]"]).mesh_shape == (-1, 2, 2, 1)
  for bad in ("[-1, -1, 2]", "[0, 1, 8]", "[1, 2, 3, 4, 5]"):
    with pytest.raises(ValueError, match="mesh_shape"):
      load_config(None, [f"mesh_shape={bad}"])
  with pytest.raises(ValueError, match="does not fit 8 devices"):
    sharding.make_mesh((3, 1, 1))
  cfg = load_config(None, ["logical_rules.embed=null", "logical_rules.mlp=[fsdp, tensor]"])
  assert cfg.logical_rules.embed is None and cfg.logical_rules.mlp == ("fsdp", "tensor")
  with pytest.raises(ValueError, match="logical_rules"):
    load_config(None, ["logical_rules.heads=model"])  # not a mesh axis
  with pytest.raises(ValueError, match="twice"):
    load_config(None, ["logical_rules.batch=[data, data]"])
  # A mesh axis is used once per array: the residual stream [B, T, D] keeps fsdp for B.
  P = jax.sharding.PartitionSpec
  assert sharding.logical_to_spec(sharding.ACTIVATION) == P(("data", "fsdp"), "context", None)
  assert sharding.logical_to_spec(("embed", "heads", "head_dim")) == P("fsdp", "tensor", None)
  assert sharding.logical_to_spec(("layers", "mlp", "embed"), cfg.logical_rules) == P(
    None, ("fsdp", "tensor"), None
  )
  with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by the mesh axes \['tensor'\]"):
    sharding.check_divisible(MODEL, _mesh((1, 1, 8)), BATCH)
  with pytest.raises(ValueError, match=r"batch_size / grad_accum_steps \(2\).*\['data', 'fsdp'\]"):
    sharding.check_divisible(MODEL, _mesh((2, 2, 1)), 2)
  with pytest.raises(ValueError, match="grad_accum_steps"):
    load_config(None, ["batch_size=8", "grad_accum_steps=3"])
