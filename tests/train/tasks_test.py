"""The synthetic retrieval tasks (jaxpe.train.tasks): each generator against an independent reading of
its samples (answers where they must be, the right answer, distances as configured), determinism in
(seed, step, row), the masked loss against numpy, the config checks naming the key, and a task run
through the ordinary trainer whose fingerprint covers the task (a changed task is refused on resume)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.train import tasks, trainer
from jaxpe.train.config import TrainConfig
from jaxpe.train.data_config import TaskConfig
from jaxpe.train.steps import next_token_loss

MQAR = TaskConfig(name="mqar", num_keys=40, num_values=10, spacing=8)
COPY = TaskConfig(name="copy", num_symbols=64)
FLIP = TaskConfig(name="flipflop", ignore=0.6)


@pytest.mark.parametrize("length", [16, 64, 200])
def test_mqar_samples(length):
  n = length // 8
  for i in range(5):
    tok, mask = tasks.sample(MQAR, length, [0, 3, 1, i])
    assert tok.shape == mask.shape == (length + 1,)
    keys, values = tok[0 : 2 * n : 2], tok[1 : 2 * n : 2]
    assert len(set(keys.tolist())) == n and all(2 <= k < 42 for k in keys), keys
    assert all(42 <= v < 52 for v in values)
    start = length + 1 - 2 * n  # the queries end the sample
    assert (tok[2 * n : start] == 0).all()
    answers = [p for p in range(length + 1) if mask[p]]
    assert answers == list(range(start + 1, length + 1, 2))
    pairs = dict(zip(keys.tolist(), values.tolist()))
    where = {k: 2 * j for j, k in enumerate(keys.tolist())}
    queried = []
    for p in answers:
      assert tok[p] == pairs[tok[p - 1]]  # the answer is the value of the key just before it
      assert p - (where[tok[p - 1]] + 1) >= length + 1 - 4 * n  # at least the padding away from its source
      queried.append(int(tok[p - 1]))
    assert sorted(queried) == sorted(keys.tolist())  # every key asked once


@pytest.mark.parametrize("length", [16, 64, 127])
def test_copy_samples(length):
  lengths = set()
  for i in range(20):
    tok, mask = tasks.sample(COPY, length, [0, 0, 5, i])
    n = int(np.flatnonzero(tok == 1)[0])  # the separator
    lengths.add(n)
    assert max(1, length // 8) <= n <= length // 2
    assert len(set(tok[:n].tolist())) == n and (tok[:n] >= 2).all()
    assert (tok[n + 1 : 2 * n + 1] == tok[:n]).all() and (tok[2 * n + 1 :] == 0).all()
    assert np.flatnonzero(mask).tolist() == list(range(n + 1, 2 * n + 1))  # each n + 1 after its source
  assert len(lengths) > 3  # the span length varies


@pytest.mark.parametrize("length", [15, 64, 301])
def test_flipflop_samples(length):
  reads = 0
  for i in range(10):
    tok, mask = tasks.sample(FLIP, length, [1, 2, i])
    ops, bits = tok[0::2][: (length + 1) // 2], tok[1::2][: (length + 1) // 2]
    assert ops[0] == tasks.WRITE and ops[-1] == tasks.READ
    last = None
    for j, (op, bit) in enumerate(zip(ops.tolist(), bits.tolist())):
      assert op in (tasks.WRITE, tasks.READ, tasks.IGNORE) and bit in (tasks.BIT0, tasks.BIT0 + 1)
      if op == tasks.WRITE:
        last = bit
      assert mask[2 * j + 1] == (op == tasks.READ)
      if op == tasks.READ:
        assert bit == last
        reads += 1
    assert mask[0::2].sum() == 0
  assert reads > 10


def _answer_from_the_past(task, tok: np.ndarray, p: int) -> int | None:
  """The answer at ``p`` as the tokens before it determine it (None: they do not): an independent
  reading of each task's rule."""
  past = tok[:p].tolist()
  if task.name == "copy":
    n = past.index(tasks.SEP) if tasks.SEP in past else None
    return None if n is None or p - n - 1 >= n else past[p - n - 1]
  if task.name == "mqar":
    key, pairs = past[-1], {past[i]: past[i + 1] for i in range(0, len(past) - 2, 2) if past[i] != 0}
    return pairs.get(key)
  ops = past[0::2]  # flipflop: the bit of the last write before the read at p - 1
  writes = [j for j, op in enumerate(ops[:-1]) if op == tasks.WRITE]
  return past[2 * writes[-1] + 1] if writes and ops[-1] == tasks.READ else None


@pytest.mark.parametrize("task", [MQAR, COPY, FLIP], ids=lambda t: t.name)
def test_every_length_gives_answerable_samples_or_is_refused_naming_the_range(task):
  # Issue 48, kind 3: flip-flop at L = 2 was one instruction, a read with no earlier write, scored.
  for length in range(1, 25):
    if length < tasks.min_length(task):
      with pytest.raises(
        ValueError, match=rf"length must be an int >= {tasks.min_length(task)} for task {task.name}"
      ):
        tasks.sample(task, length, [0])
      continue
    for i in range(30):
      tok, mask = tasks.sample(task, length, [2, length, i])
      answers = np.flatnonzero(mask)
      assert answers.size > 0
      for p in answers:
        assert _answer_from_the_past(task, tok, p) == tok[p], (length, i, p, tok.tolist())
  assert tasks.min_length(FLIP) == 3
  with pytest.raises(ValueError, match=r"seq_len must be an int >= 3 for task flipflop"):
    TrainConfig.model_validate(
      {"data": {"task": FLIP.model_dump()}, "sample_len": 0, "seq_len": 2, "model": {"vocab_size": 7}}
    )


def test_determinism_rows_and_held_out():
  a = tasks.task_batch(COPY, step=4, seed=1, batch_size=6, seq_len=32)
  assert a.shape == (6, 2, 33) and a.dtype == np.int32
  np.testing.assert_array_equal(a, tasks.task_batch(COPY, step=4, seed=1, batch_size=6, seq_len=32))
  np.testing.assert_array_equal(
    a[2:5], tasks.task_batch(COPY, step=4, seed=1, batch_size=6, seq_len=32, rows=slice(2, 5))
  )
  assert not np.array_equal(a, tasks.task_batch(COPY, step=5, seed=1, batch_size=6, seq_len=32))
  assert not np.array_equal(a, tasks.task_batch(COPY, step=4, seed=2, batch_size=6, seq_len=32))
  h = tasks.held_out(COPY, seed=1, count=6, length=32)
  assert not any(np.array_equal(h[i], a[j]) for i in range(6) for j in range(6))
  np.testing.assert_array_equal(h, tasks.held_out(COPY, seed=1, count=6, length=32))


def test_vocab_and_length_checks():
  assert tasks.vocab_size(MQAR) == 52 and tasks.vocab_size(COPY) == 66 and tasks.vocab_size(FLIP) == 7
  assert tasks.answer_bits(MQAR) == pytest.approx(math.log2(10))
  with pytest.raises(ValueError, match=r"length 400 needs 50 distinct mqar keys .* data.task.num_keys is 40"):
    tasks.sample(MQAR, 400, [0])
  with pytest.raises(ValueError, match=r"needs up to 80 distinct copy symbols"):
    tasks.sample(COPY, 160, [0])
  base = {"data": {"task": COPY.model_dump()}, "sample_len": 0, "seq_len": 32, "model": {"vocab_size": 66}}
  TrainConfig.model_validate(base)
  with pytest.raises(ValueError, match=r"model.vocab_size \(65\) must be >= 66"):
    TrainConfig.model_validate({**base, "model": {"vocab_size": 65}})
  with pytest.raises(ValueError, match=r"sample_len must be 0 with data.task"):
    TrainConfig.model_validate({**base, "sample_len": 8})
  with pytest.raises(ValueError, match=r"seq_len 256 needs up to 128 distinct copy symbols"):
    TrainConfig.model_validate({**base, "seq_len": 256})
  for bad in ({"ignore": 1.0}, {"ignore": float("nan")}, {"spacing": 3}, {"name": "passkey"}):
    with pytest.raises(ValueError):
      TaskConfig.model_validate({"name": "mqar", **bad})


def test_masked_loss_matches_numpy():
  rng = np.random.default_rng(0)
  batch = tasks.task_batch(MQAR, step=0, seed=0, batch_size=3, seq_len=32)
  logits = rng.normal(size=(3, 32, 52))
  got = float(next_token_loss(lambda x: jnp.asarray(logits, jnp.float32), jnp.asarray(batch)))
  lse = np.log(np.exp(logits).sum(-1))
  nll = lse - np.take_along_axis(logits, batch[:, 0, 1:, None], -1)[..., 0]
  m = batch[:, 1, 1:].astype(bool)
  np.testing.assert_allclose(got, nll[m].mean(), rtol=1e-5)
  text = float(next_token_loss(lambda x: jnp.asarray(logits, jnp.float32), jnp.asarray(batch[:, 0])))
  np.testing.assert_allclose(text, nll.mean(), rtol=1e-5)  # a [B, T + 1] batch: every target


def test_task_run_through_the_trainer_and_changed_task_refused(tmp_path):
  cfg = TrainConfig.model_validate(
    {
      "workdir": str(tmp_path / "run"),
      "seq_len": 32,
      "batch_size": 8,
      "num_steps": 4,
      "warmup_steps": 1,
      "eval_every": 1000,
      "eval_batches": 1,
      "checkpoint_every": 2,
      "sample_len": 0,
      "data": {"task": COPY.model_dump()},
      "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "vocab_size": 66, "max_len": 32},
    }
  )
  with jax.numpy_dtype_promotion("standard"):
    r = trainer.train(cfg, progress=False)
  assert r.step == 4 and r.run["data"] == {"task": "copy", "sha256": tasks.fingerprint(COPY)["sha256"]}
  assert r.unigram_bits_per_byte == pytest.approx(6.0) and math.isfinite(r.eval_bits_per_byte)
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # bits per answer, named so
  assert (summary["unit"], summary["unigram_bits_per_answer"]) == ("answer", pytest.approx(6.0))
  assert r.unit == "answer" and not any("per_byte" in k for k in summary)
  other = cfg.model_copy(
    update={
      "num_steps": 6,
      "data": cfg.data.model_copy(update={"task": COPY.model_copy(update={"num_symbols": 65})}),
    }
  )
  with pytest.raises(ValueError, match=r"data.task.num_symbols: 64 -> 65"):
    with jax.numpy_dtype_promotion("standard"):
      trainer.train(other, progress=False)
  assert tasks.fingerprint(COPY)["sha256"] != tasks.fingerprint(other.data.task)["sha256"]
