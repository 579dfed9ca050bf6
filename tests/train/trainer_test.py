"""Trainer end to end on a tiny config: loss goes down, outputs are written, resumes are exact,
checkpoints move between mesh shapes, and bad data paths fail clearly."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpe.train import checkpoint, data, evaluation, sharding, trainer
from jaxpe.train.config import load_config

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _cfg(workdir, text_file, *extra):
  return load_config(
    None,
    [
      f"workdir={workdir}",
      f"data.path={text_file}",
      "seq_len=32",
      "batch_size=8",
      "num_steps=12",
      "warmup_steps=2",
      "eval_every=6",
      "eval_batches=2",
      "checkpoint_every=6",
      "sample_len=0",  # generation costs a compile per run; on where the sample is checked
      "model.d_model=32",
      "model.num_layers=2",
      "model.num_heads=4",
      "model.max_len=32",
      *extra,
    ],
  )


def _params(cfg, mesh_shape=(-1, 1)):
  mesh = sharding.make_mesh(mesh_shape)
  _, state, shardings = trainer.create_state(cfg, mesh)
  mngr = checkpoint.manager(Path(cfg.workdir) / "checkpoints")
  restored, meta = checkpoint.restore_latest(mngr, checkpoint.abstract_with_shardings(state, shardings))
  mngr.close()
  return jax.tree.map(np.asarray, restored), meta


def test_training_lowers_loss_and_writes_outputs(tmp_path, text_file):
  cfg = _cfg(
    tmp_path / "run", text_file, "num_steps=40", "learning_rate=1e-2", "eval_every=20", "sample_len=8"
  )
  result = trainer.train(cfg, progress=False)
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 41))
  assert np.mean([r["loss"] for r in records[-5:]]) < records[0]["loss"] - 1.0  # from ~ln(256) = 5.5
  evals = [r["eval_bits_per_byte"] for r in records if "eval_bits_per_byte" in r]
  assert len(evals) == 2 and evals[1] < evals[0] < 8.0
  assert result.unigram_bits_per_byte == pytest.approx(
    data.unigram_bits_per_byte(
      np.concatenate(
        [
          b[:, 1:].ravel()
          for b in data.eval_batches(
            data.load_corpus(
              text_file, max_bytes=cfg.data.max_bytes, eval_fraction=cfg.data.eval_fraction
            ).eval,
            batch_size=8,
            seq_len=32,
            num_batches=2,
          )
        ]
      )
    )
  )
  for name in ("loss.png", "summary.json", "config.json"):
    assert (tmp_path / "run" / name).is_file()
  assert result.sample.startswith(cfg.sample_prompt) and len(result.sample) >= len(cfg.sample_prompt) + 1


def test_resume_reproduces_uninterrupted_run(tmp_path, text_file):
  straight = _cfg(tmp_path / "straight", text_file)
  trainer.train(straight, progress=False)
  # The interrupted run writes its checkpoints asynchronously (issue 10): still bit-exact.
  split = _cfg(tmp_path / "split", text_file, "stop_at=6", "async_checkpoints=true")
  trainer.train(split, progress=False)
  assert _params(split)[1]["step"] == 6
  resumed = _cfg(tmp_path / "split", text_file, "async_checkpoints=true")  # continues from step 6
  result = trainer.train(resumed, progress=False)
  assert result.step == 12
  (a, meta_a), (b, meta_b) = _params(straight), _params(resumed)
  position = {"step": 12, "data_position": 12, "skipped_steps": 0}
  assert {k: meta_a[k] for k in position} == {k: meta_b[k] for k in position} == position
  assert meta_b["config"] == resumed.model_dump(mode="json")  # the run travels with its checkpoint
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def test_checkpoint_restores_onto_another_mesh(tmp_path, text_file):
  assert jax.device_count() == 8
  cfg = _cfg(tmp_path / "mesh", text_file, "mesh_shape=[2, 4]", "num_steps=6")
  trainer.train(cfg, progress=False)
  on_2x4, _ = _params(cfg, (2, 4))
  on_8x1, _ = _params(cfg, (8, 1))
  jax.tree.map(np.testing.assert_array_equal, on_2x4, on_8x1)


def test_bad_data_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.load_corpus(str(tmp_path / "nope"), max_bytes=100, eval_fraction=0.1)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="holds no text files"):
    data.load_corpus(str(tmp_path / "empty"), max_bytes=100, eval_fraction=0.1)
  (tmp_path / "blank.txt").write_bytes(b"")
  with pytest.raises(ValueError, match="both must be non-empty"):
    data.load_corpus(str(tmp_path / "blank.txt"), max_bytes=100, eval_fraction=0.1)


def test_stdlib_corpus_split_is_deterministic_and_disjoint():
  a = data.load_corpus(None, max_bytes=2_000_000, eval_fraction=0.05)
  b = data.load_corpus(None, max_bytes=2_000_000, eval_fraction=0.05)
  np.testing.assert_array_equal(a.train, b.train)
  np.testing.assert_array_equal(a.eval, b.eval)
  assert a.train.size + a.eval.size == 2_000_000 and 0 < a.eval.size < 0.2 * 2_000_000


def test_batches_are_deterministic_per_step():
  tokens = np.arange(1000, dtype=np.uint8)
  x = data.train_batch(tokens, step=3, seed=1, batch_size=4, seq_len=16)
  np.testing.assert_array_equal(x, data.train_batch(tokens, step=3, seed=1, batch_size=4, seq_len=16))
  assert not np.array_equal(x, data.train_batch(tokens, step=4, seed=1, batch_size=4, seq_len=16))
  assert x.shape == (4, 17) and np.all(np.diff(x.astype(np.int64) % 256, axis=1) % 256 == 1)


def _steps(workdir):
  return [json.loads(line)["step"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_resume_checks_config_stops_at_stop_at_and_keeps_one_record_per_step(tmp_path, text_file):
  run = tmp_path / "run"
  fast = ["num_steps=4", "checkpoint_every=2", "eval_every=100", "model.d_model=16"]
  first = trainer.train(_cfg(run, text_file, *fast, "stop_at=2"), progress=False)
  assert first.step == 2 and _steps(run) == [1, 2]
  saved = (run / "config.json").read_text()

  # Rerun at stop_at: no steps; throughput from the last metrics record, not 0.
  again = trainer.train(_cfg(run, text_file, *fast, "stop_at=2"), progress=False)
  assert again.step == 2 and _steps(run) == [1, 2]
  last_record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
  assert again.tokens_per_second == last_record["tokens_per_second"] > 0
  assert json.loads((run / "summary.json").read_text())["tokens_per_second"] > 0

  # Changing what defines the state or the batch stream is refused, and config.json is kept.
  with pytest.raises(ValueError, match=r"model\.d_model: 16 -> 32.*seq_len: 32 -> 16.*new workdir"):
    trainer.train(_cfg(run, text_file, *fast[:-1], "seq_len=16"), progress=False)
  for change in ("seed=1", "batch_size=16", "data.max_bytes=99999"):
    with pytest.raises(ValueError, match=change.split("=")[0]):
      trainer.train(_cfg(run, text_file, *fast, change), progress=False)
  assert (run / "config.json").read_text() == saved

  # Allowed changes resume; the first step of the resumed process is not timed.
  trainer.train(_cfg(run, text_file, *fast, "eval_every=3"), progress=False)
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert records[2]["tokens_per_second"] == 0.0 and records[3]["tokens_per_second"] > 0
  assert json.loads((run / "config.json").read_text())["eval_every"] == 3

  # A crash after step 4's metrics but before its checkpoint: steps 3-4 are redone, not duplicated.
  import shutil

  shutil.rmtree(run / "checkpoints" / "4")
  assert trainer.train(_cfg(run, text_file, *fast), progress=False).step == 4
  assert _steps(run) == [1, 2, 3, 4]
  # A process that ran a single (compiling, untimed) step reports the last timed figure, not 0.
  shutil.rmtree(run / "checkpoints" / "4")  # resumes at 2 and runs step 3 only
  result = trainer.train(_cfg(run, text_file, *fast, "stop_at=3"), progress=False)
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert result.step == 3 and [r["step"] for r in records] == [1, 2, 3]
  assert records[2]["tokens_per_second"] == 0.0
  assert result.tokens_per_second == records[1]["tokens_per_second"] > 0


def test_weight_decay_skips_biases_and_layernorm(tmp_path, text_file):
  from flax import nnx

  from jaxpe.model.decoder import Decoder

  cfg = _cfg(
    tmp_path, text_file, "model.use_bias=true", "warmup_steps=0", "learning_rate=0.1", "weight_decay=0.5"
  )
  # An "rbg" key: the same init, its draws compile in a third of threefry's time (once per weight shape).
  model = Decoder(cfg.model, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
  before = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  optimizer = nnx.Optimizer(model, trainer.make_optimizer(cfg), wrt=nnx.Param)
  zeros = jax.tree.map(jax.numpy.zeros_like, nnx.state(model, nnx.Param))
  nnx.jit(lambda opt, m, g: opt.update(m, g))(optimizer, model, zeros)  # one compile, not one per op
  after = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  # Zero gradients: Adam's step is 0, so only decoupled decay moves a parameter, by -lr * wd * p.
  decayed = {k for k in before if not k.endswith(("bias", "scale"))}
  assert any("attn/q/bias" in k and before[k].ndim == 2 for k in before)  # [N, H] biases are kept too
  assert decayed and all(k.endswith(("kernel", "embedding")) for k in decayed)
  for k in before:
    expected = before[k] * (1 - 0.1 * 0.5) if k in decayed else before[k]
    np.testing.assert_allclose(after[k], expected, rtol=1e-6, err_msg=k)


def test_sample_is_clipped_to_max_len_for_learned_positions(monkeypatch, tmp_path, text_file):
  from flax import nnx

  from jaxpe.model.decoder import Decoder

  cfg = _cfg(tmp_path, text_file, "model.pos_encoding=learned", "model.max_len=16", "seq_len=16")
  calls = []
  real = evaluation.generate

  def spy(model, prompt, **kw):
    calls.append((prompt.shape[1], kw["max_new_tokens"]))
    return real(model, prompt, **kw)

  monkeypatch.setattr(evaluation, "generate", spy)
  rngs = lambda: nnx.Rngs(jax.random.key(0, impl="rbg"))  # noqa: E731  (the cheaper draws, as above)
  learned = Decoder(cfg.model, rngs=rngs())
  out = evaluation.sample_text(learned, "def ", 64, seed=0)
  assert calls == [(4, 12)] and out.startswith("def ")
  rope = Decoder(cfg.model.model_copy(update={"pos_encoding": "rope"}), rngs=rngs())
  evaluation.sample_text(rope, "def ", 20, seed=0)
  assert calls[-1] == (4, 20)  # relative positions: not clipped
  # rope_alibi follows ALiBi only within its context: clipped to it (it would refuse the cache).
  emulated = cfg.model.model_copy(update={"pos_encoding": "rope_alibi", "rope_alibi_context": 12})
  emulated = Decoder(emulated, rngs=rngs())
  evaluation.sample_text(emulated, "def ", 20, seed=0)
  assert calls[-1] == (4, 8)
  with pytest.raises(ValueError, match=r"no room in rope_alibi_context \(12\)"):
    evaluation.sample_text(emulated, "x" * 12, 20, seed=0)
