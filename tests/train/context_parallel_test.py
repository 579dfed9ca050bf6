"""Context parallelism end to end on 8 fake CPU devices: the decoder with its sequence split over
the ``context`` mesh axis (2, 4, 8 shards, beside data / fsdp / tensor; all-gather and ring) gives
one device's loss and gradients for every positional encoding, with padding and packed documents;
the trainer takes the axis from ``mesh_shape``; checkpoints move between context-parallel and plain
meshes; and two processes split the context axis between them."""

import functools
import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpe.attention import context
from jaxpe.model import partitioning
from jaxpe.model.config import LogicalRules, ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.train import checkpoint, sharding, trainer
from jaxpe.train.config import load_config

B, T = 4, 16
BASE = dict(d_model=16, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=32, max_len=T)
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}
LINEAR = {"rope_type": "linear", "factor": 2.0}


def _batch():
  """Row 0 plain, row 1 left padding, row 2 three packed documents, row 3 two packed documents
  and right padding; the loss counts real tokens only."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (B, T + 1)).astype(np.int32)
  valid = np.ones((B, T), bool)
  valid[1, :3] = False
  valid[3, -4:] = False
  segments = np.zeros((B, T), np.int32)
  segments[2, 5:], segments[2, 11:] = 1, 2
  segments[3, 7:] = 1
  return tokens[:, :-1], tokens[:, 1:], valid, segments


def _loss(model, inputs, targets, valid, segments, shards):
  """Mean cross-entropy over real tokens; with shards > 1 everything in zig-zag order."""
  weights = valid.astype(jnp.float32)
  if shards == 1:
    logits = model(inputs, attention_mask=valid, segment_ids=segments)
  else:
    kwargs = partitioning.zigzag_inputs(inputs, shards, attention_mask=valid, segment_ids=segments)
    logits = model(**kwargs)
    targets, weights = context.to_zigzag(targets, shards), context.to_zigzag(weights, shards)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * weights) / jnp.sum(weights)


@functools.cache
def _model(encoding_json):
  cfg = ModelConfig(**BASE, **json.loads(encoding_json))
  return nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))


def _value_and_grad(encoding, mesh_shape, strategy="all_gather", *, grads=True):
  """(loss, gradients as numpy) of ``_loss`` with the sequence split over ``mesh_shape``."""
  graphdef, state = _model(json.dumps({**encoding, "context_attention": strategy}, sort_keys=True))
  n = int(np.prod(mesh_shape))
  mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:n])
  rules = LogicalRules()
  state = jax.device_put(state, sharding.state_shardings(state, mesh, rules))
  shards = mesh.shape["context"]

  @jax.jit
  def run(state, *batch):
    with partitioning.activation_sharding(mesh, rules):
      loss_of = lambda s: _loss(nnx.merge(graphdef, s), *batch, shards)  # noqa: E731
      return jax.value_and_grad(loss_of)(state) if grads else (loss_of(state), None)

  loss, g = run(state, *_batch())
  return float(loss), None if g is None else [np.asarray(x) for x in jax.tree.leaves(g)]


# (encoding, mesh (data, fsdp, tensor, context), strategy, compare gradients too)
CASES = [
  ({"pos_encoding": "none"}, (1, 1, 1, 8), "ring", False),
  ({"pos_encoding": "rope", "rope_scaling": YARN}, (2, 1, 1, 4), "ring", True),
  ({"pos_encoding": "xpos", "rope_scaling": LINEAR}, (1, 1, 2, 4), "all_gather", False),
  ({"pos_encoding": "alibi"}, (2, 2, 1, 2), "ring", False),
  ({"pos_encoding": "rope_alibi"}, (1, 4, 1, 2), "all_gather", False),
  ({"pos_encoding": "sinusoidal"}, (2, 1, 1, 4), "all_gather", False),
  ({"pos_encoding": "learned", "scan_layers": True, "remat": "full"}, (1, 2, 1, 4), "ring", False),
  ({"pos_encoding": "fire"}, (2, 1, 1, 4), "ring", True),  # per-layer bias parameters, summed over shards
  ({"pos_encoding": "t5", "scan_layers": True}, (1, 1, 2, 4), "all_gather", True),  # the shared table
  # issue 47: a sliding window and soft-capped scores across shards (windows on the original slots)
  ({"pos_encoding": "rope", "sliding_window": 3, "attn_logit_softcapping": 2.0}, (1, 1, 1, 4), "ring", True),
]


@pytest.mark.parametrize(
  "encoding, mesh_shape, strategy, grads",
  CASES,
  ids=[
    f"{e['pos_encoding']}{'-' + e['rope_scaling']['rope_type'] if 'rope_scaling' in e else ''}-"
    f"{'x'.join(map(str, m))}-{s}"
    for e, m, s, _ in CASES
  ],
)
def test_context_parallel_decoder_equals_one_device(encoding, mesh_shape, strategy, grads):
  ref_loss, ref_grads = _value_and_grad(encoding, (1, 1, 1, 1), grads=grads)
  loss, got = _value_and_grad(encoding, mesh_shape, strategy, grads=grads)
  print(f"{encoding['pos_encoding']} {mesh_shape} {strategy}: |loss diff| {abs(loss - ref_loss):.2e}", end="")
  assert abs(loss - ref_loss) <= 1e-5, (loss, ref_loss)
  if grads:
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref_grads))
    print(f", max |grad diff| {diff:.2e}", end="")
    assert diff <= 1e-5
  print()


def test_slot_index_in_any_order_equals_slot_order():
  """On one device, tokens given in a shuffled order with their slots, positions, padding and
  segments give the logits of the ordered call (moved back): causality follows slots."""
  graphdef, state = _model(json.dumps({"pos_encoding": "rope"}))
  model = nnx.merge(graphdef, state)
  inputs, _, valid, segments = _batch()
  kwargs = partitioning.zigzag_inputs(jnp.asarray(inputs), 1, attention_mask=valid, segment_ids=segments)
  order = np.random.default_rng(2).permutation(T)
  shuffled = {name: x[:, order] for name, x in kwargs.items()}
  ref, got = jax.jit(lambda: (model(inputs, attention_mask=valid, segment_ids=segments), model(**shuffled)))()
  np.testing.assert_allclose(
    np.asarray(got)[valid[:, order]], np.asarray(ref[:, order])[valid[:, order]], atol=1e-5
  )
  with pytest.raises(ValueError, match="needs the reordered tokens' positions"):
    model(inputs, slot_index=shuffled["slot_index"], segment_ids=segments)
  with pytest.raises(ValueError, match="slot_index must have the shape of tokens"):
    model(inputs, slot_index=shuffled["slot_index"][:, :4])


def test_mesh_shape_context_axis_from_config():
  assert load_config(None, ["mesh_shape=[2, 4]"]).mesh_shape == (2, 1, 4, 1)  # old (data, model)
  assert load_config(None, ["mesh_shape=[2, 2, 2]"]).mesh_shape == (2, 2, 2, 1)  # before the context axis
  assert load_config(None, ["mesh_shape=[2, 1, 1, 4]"]).mesh_shape == (2, 1, 1, 4)
  assert dict(sharding.make_mesh((2, 1, 1, -1)).shape) == {"data": 2, "fsdp": 1, "tensor": 1, "context": 4}
  assert dict(sharding.make_mesh((2, 2, 2)).shape)["context"] == 1
  with pytest.raises(ValueError, match=r"seq_len \(12\) must be divisible by 2 x 4 = 8"):
    load_config(None, ["mesh_shape=[2, 1, 1, 4]", "seq_len=12"])
  with pytest.raises(ValueError, match="set model.attn_implementation=xla, got 'cudnn'"):
    load_config(None, ["mesh_shape=[2, 1, 1, 4]", "model.attn_implementation=cudnn"])
  # length replicated: no context parallelism, no constraint on seq_len.
  assert (
    load_config(None, ["mesh_shape=[2, 1, 1, 4]", "seq_len=12", "logical_rules.length=null"]).seq_len == 12
  )
  with pytest.raises(ValueError, match=r"seq_len \(12\) must be divisible by 2 x 8 = 16"):
    sharding.check_divisible(ModelConfig(**BASE), sharding.make_mesh((1, 1, 1, -1)), 8, seq_len=12)
  with pytest.raises(ValueError, match=r"mesh_shape takes 4 sizes \(data, fsdp, tensor, context\)"):
    load_config(None, ["mesh_shape=[1, 1, 1, 1, 8]"])
  P = jax.sharding.PartitionSpec
  assert sharding.logical_to_spec(sharding.ACTIVATION) == P(("data", "fsdp"), "context", None)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_losses(workdir):
  return [json.loads(line)["loss"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _restore(directory, cfg, shape):
  """The checkpoint in ``directory`` restored onto ``shape``'s mesh (shardings checked)."""
  n = int(np.prod(shape))
  _, abstract = trainer.abstract_state(cfg, sharding.make_mesh(shape, devices=jax.devices()[:n]))
  mngr = checkpoint.manager(directory, read_only=True)
  restored, _ = checkpoint.restore_latest(mngr, abstract)
  mngr.close()
  for x, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert x.sharding.is_equivalent_to(a.sharding, x.ndim)
  return restored


def _flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.usefixtures("standard_promotion")
def test_trainer_context_parallel_across_processes_and_checkpoints_across_meshes(tmp_path):
  """The trainer runs 3 steps with the sequence split over (data 2, context 4); two processes (2
  devices each) take the same steps with the context axis (4) spanning both: the same losses and
  final parameters within 1e-5. The trainer's checkpoint restores with identical values onto the
  two-process context mesh, one device and a plain data-parallel mesh, and a one-device checkpoint
  back onto (data 2, context 4)."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_bytes())
  run = [
    f"data.path={corpus}",
    f"seq_len={T}",
    "batch_size=8",
    "num_steps=3",
    "warmup_steps=1",
    "eval_every=100",
    "eval_batches=1",
    "checkpoint_every=100",
    "sample_len=0",
    "model.d_model=16",
    "model.num_layers=1",
    "model.num_heads=2",
    f"model.max_len={T}",
    "model.pos_encoding=rope",
    "model.context_attention=ring",
  ]
  cfg = load_config(None, [*run, f"workdir={tmp_path / 'one'}", "mesh_shape=[2, 1, 1, 4]"])
  assert trainer.train(cfg, progress=False).step == 3
  saved = tmp_path / "one" / "checkpoints"
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  dump = tmp_path / "two.npz"
  spec = {
    "port": _free_port(),
    "overrides": [*run, f"workdir={tmp_path / 'two'}", "mesh_shape=[1, 1, 1, 4]"],
    "restore_from": str(saved),
    "dump": str(dump),
  }
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(Path(__file__).with_name("context_worker.py")),
        json.dumps({**spec, "process_id": i}),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  try:
    outputs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
  two = dict(np.load(dump))
  one_losses = _run_losses(tmp_path / "one")
  diff = np.max(np.abs(two["losses"] - one_losses))
  print(f"losses {one_losses} / {two['losses'].tolist()}: max diff {diff:.2e}")
  np.testing.assert_allclose(two["losses"], one_losses, rtol=0, atol=1e-5)
  one_device = _flat(_restore(saved, cfg, (1, 1, 1, 1)))
  for key, value in one_device.items():
    np.testing.assert_array_equal(two["restored" + key], value, err_msg=key)  # onto 2 processes
    np.testing.assert_allclose(two["own" + key], value, rtol=0, atol=1e-5, err_msg=key)  # trained alike
  for key, value in _flat(_restore(saved, cfg, (8, 1, 1, 1))).items():
    np.testing.assert_array_equal(value, one_device[key], err_msg=key)  # onto a plain mesh
  # A checkpoint written from one device restores onto (data 2, context 4).
  mngr = checkpoint.manager(tmp_path / "plain")
  checkpoint.save(mngr, 3, _restore(saved, cfg, (1, 1, 1, 1)), {"step": 3})
  mngr.close()
  for key, value in _flat(_restore(tmp_path / "plain", cfg, (2, 1, 1, 4))).items():
    np.testing.assert_array_equal(value, one_device[key], err_msg=key)
