"""Token files (``data.tokens``) and document packing (``data.packing``), against references written
here: the ids numpy wrote, documents cut by hand, and each document run through the model alone."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.train import checkpoint, data, packing, sharding, steps, token_data, trainer
from jaxpe.train.config import load_config

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _ids(n=3000, vocab=700, eot=699, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab - 1, size=n)
  ids[rng.choice(n, n // 40, replace=False)] = eot
  return ids


@pytest.mark.parametrize("fmt", ["bin16", "bin32_sidecar", "npy"])
def test_token_files_read_memory_mapped_with_the_held_out_tail(tmp_path, fmt):
  ids = _ids()
  if fmt == "bin16":
    path, kwargs = tmp_path / "t.bin", {"token_dtype": "uint16"}
    ids.astype("<u2").tofile(path)
  elif fmt == "bin32_sidecar":
    path, kwargs = tmp_path / "t.bin", {}
    ids.astype("<u4").tofile(path)
    (tmp_path / "t.bin.json").write_text(json.dumps({"dtype": "uint32", "eot_token": 699}))
  else:
    path, kwargs = tmp_path / "t.npy", {}
    np.save(path, ids.astype(np.int32))
  corpus = token_data.load_tokens(str(path), eval_fraction=0.1, vocab_size=700, eot_token=699, **kwargs)
  assert isinstance(corpus.train.base if fmt == "npy" else corpus.train, np.memmap)
  np.testing.assert_array_equal(corpus.train, ids[:2700])  # 3000 - ceil(300)
  np.testing.assert_array_equal(corpus.eval, ids[2700:])
  ends = [i + 1 for i in range(3000) if ids[i] == 699 and i + 1 < 3000]
  np.testing.assert_array_equal(corpus.train_docs, [0] + [e for e in ends if e < 2700])
  np.testing.assert_array_equal(corpus.eval_docs, [0] + [e - 2700 for e in ends if e > 2700])
  assert corpus.unit == "tokens" and "2,700 tokens" in corpus.describe()
  # the batches of a text run work on the memory-mapped ids
  batch = data.train_batch(corpus.train, step=3, seed=1, batch_size=4, seq_len=16)
  starts = np.random.default_rng([1, 3]).integers(0, 2700 - 16, size=4)
  np.testing.assert_array_equal(batch, np.stack([ids[s : s + 17] for s in starts]))


def test_token_file_errors_name_the_problem(tmp_path):
  ids = _ids()
  ids.astype("<u2").tofile(tmp_path / "t.bin")
  with pytest.raises(ValueError, match=r"raw token file: give its dtype as data.token_dtype"):
    token_data.load_tokens(str(tmp_path / "t.bin"), eval_fraction=0.1, vocab_size=700)
  with pytest.raises(
    ValueError, match=r"token id 699 \(first at index [\d,]+\).*vocab_size is 256.*vocab_size=700"
  ):
    token_data.load_tokens(str(tmp_path / "t.bin"), eval_fraction=0.1, vocab_size=256, token_dtype="uint16")
  (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
  with pytest.raises(ValueError, match="3 bytes, not a positive multiple of 2"):
    token_data.token_array(tmp_path / "odd.bin", "uint16")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    token_data.token_array(tmp_path / "none.bin", "uint16")
  np.save(tmp_path / "f.npy", np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match="one-dimensional integer array"):
    token_data.token_array(tmp_path / "f.npy")
  with pytest.raises(ValueError, match="data.tokens and data.path both"):
    load_config(None, [f"data.tokens={tmp_path / 't.bin'}", f"data.path={tmp_path}"])


def test_token_fingerprint_follows_the_ids_not_the_path(tmp_path):
  ids = _ids()
  for name in ("a.bin", "b.bin"):
    ids.astype("<u2").tofile(tmp_path / name)
  changed = ids.copy()
  changed[2900] = (changed[2900] + 1) % 699  # a held-out id
  changed.astype("<u2").tofile(tmp_path / "c.bin")
  fps = [
    token_data.fingerprint(
      token_data.load_tokens(str(tmp_path / n), eval_fraction=0.1, vocab_size=700, token_dtype="uint16")
    )["sha256"]
    for n in ("a.bin", "b.bin", "c.bin")
  ]
  assert fps[0] == fps[1] != fps[2]


def test_segment_ids_and_loss_weights_by_hand():
  starts = np.array([0, 5, 9])
  np.testing.assert_array_equal(packing.segment_ids(starts, 3, 8), [1, 1, 2, 2, 2, 2, 3, 3])
  row = packing.packed_row(np.arange(8), np.array([1, 1, 1, 2, 2, 0, 0, 0]))
  np.testing.assert_array_equal(row[1], [0, 1, 1, 0, 1, 0, 0, 0])  # first of each document, padding: 0


def test_first_fit_places_every_piece_once_and_reports_its_padding():
  starts = np.array([0, 3, 20, 21, 30, 47, 60])  # lengths 3, 17, 1, 9, 17, 13, 10 (size 70)
  packed = packing.first_fit(starts, 70, 10, bins=2)
  # pieces by hand: documents cut at 10 tokens, one-token pieces dropped
  want = [(0, 3), (3, 10), (13, 7), (21, 9), (30, 10), (40, 7), (47, 10), (57, 3), (60, 10)]
  got = sorted(zip(packed.piece_start.tolist(), packed.piece_len.tolist(), strict=True))
  assert got == want
  for r in range(packed.num_rows):
    assert packed.piece_len[packed.row_ptr[r] : packed.row_ptr[r + 1]].sum() <= 10
  assert packed.num_rows == 7  # 3+7 | 10 | 9 | 10 | 7+3 | 10 | 10 (2 open rows)
  assert packing.padding_share(packed) == pytest.approx(1 - 69 / 70)
  tokens = np.arange(100, 170)
  rows = [packed.row(tokens, r) for r in range(packed.num_rows)]
  first = rows[0]  # pieces (0, 3) and (13, 7)
  np.testing.assert_array_equal(first[0], [100, 101, 102, 113, 114, 115, 116, 117, 118, 119])
  np.testing.assert_array_equal(first[2], [1, 1, 1, 2, 2, 2, 2, 2, 2, 2])


@pytest.mark.parametrize("pos_encoding", ["rope", "alibi"])
def test_a_packed_row_scores_each_document_as_if_alone(pos_encoding):
  cfg = ModelConfig(
    d_model=32, num_layers=2, num_heads=4, vocab_size=50, max_len=32, pos_encoding=pos_encoding
  )
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 50, n) for n in (6, 9, 3)]
  toks = np.concatenate([*docs, np.zeros(4, np.int64)])  # 18 real tokens, 4 padding: T + 1 = 22
  segs = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)] + [np.zeros(4, np.int64)])
  batch = jnp.asarray(packing.packed_row(toks, segs)[None])
  total, weight = steps.next_token_loss_sum(model, batch)
  ref_total, ref_weight = 0.0, 0
  for d in docs:  # each document alone, from position 0
    logits = np.asarray(model(jnp.asarray(d[None, :-1], jnp.int32)), np.float64)[0]
    logp = (
      logits
      - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
      - logits.max(-1, keepdims=True)
    )
    ref_total -= logp[np.arange(len(d) - 1), d[1:]].sum()
    ref_weight += len(d) - 1
  assert float(weight) == ref_weight == 15
  np.testing.assert_allclose(float(total), ref_total, rtol=2e-5)


def _cfg(tmp_path, workdir, *extra):
  return load_config(
    None,
    [
      f"workdir={tmp_path / workdir}",
      f"data.tokens={tmp_path / 't.bin'}",
      "seq_len=16",
      "batch_size=8",
      "num_steps=6",
      "warmup_steps=2",
      "eval_every=3",
      "eval_batches=2",
      "checkpoint_every=3",
      "sample_len=0",
      "model.d_model=32",
      "model.num_layers=2",
      "model.num_heads=4",
      "model.max_len=32",
      "model.vocab_size=700",
      *extra,
    ],
  )


def _params(cfg):
  mesh = sharding.make_mesh((-1, 1))
  _, state, shardings = trainer.create_state(cfg, mesh)
  mngr = checkpoint.manager(Path(cfg.workdir) / "checkpoints")
  restored, meta = checkpoint.restore_latest(mngr, checkpoint.abstract_with_shardings(state, shardings))
  mngr.close()
  return jax.tree.map(np.asarray, restored), meta


def test_concat_then_split_is_the_text_windows_with_segment_ids(text_file):
  corpus = data.load_corpus(text_file, max_bytes=20_000, eval_fraction=0.1)
  corpus = data.Corpus(**{**corpus.__dict__, "train_docs": np.array([0, 500, 1700, 1701])})
  make = packing.make_train_batch(corpus, "concat_then_split", 64)
  got = make(step=5, seed=2, batch_size=6, seq_len=64, rows=slice(2, 5))
  windows = data.train_batch(corpus.train, step=5, seed=2, batch_size=6, seq_len=64)[2:5]
  np.testing.assert_array_equal(got[:, 0], windows)  # today's batches, unchanged
  starts = np.random.default_rng([2, 5]).integers(0, corpus.train.size - 64, size=6)[2:5]
  for row, s in zip(got, starts, strict=True):
    doc = np.array([sum(int(i) >= b for b in (0, 500, 1700, 1701)) for i in range(s, s + 65)])
    np.testing.assert_array_equal(row[2], doc - doc[0] + 1)
    np.testing.assert_array_equal(row[1, 1:], doc[1:] == doc[:-1])


def test_a_packed_token_file_run_resumes_exactly(tmp_path):
  strategy = "first_fit"
  _ids(n=6000).astype("<u2").tofile(tmp_path / "t.bin")
  (tmp_path / "t.bin.json").write_text(json.dumps({"dtype": "uint16", "eot_token": 699}))
  straight = _cfg(tmp_path, "straight", f"data.packing={strategy}")
  result = trainer.train(straight, progress=False)
  assert np.isfinite(result.eval_bits_per_byte) and result.unit == "token"
  # Bits per token, named so (issue 46: the logs said bits/byte): metrics, summary, no byte key.
  workdir = Path(straight.workdir)
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert all("train_bits_per_token" in r and not any("per_byte" in k for k in r) for r in records)
  assert [r["step"] for r in records if "eval_bits_per_token" in r] == [3, 6]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["unit"] == "token" and summary["eval_bits_per_token"] == result.eval_bits_per_byte
  assert not any("per_byte" in k for k in summary)
  assert result.run["packing"]["strategy"] == strategy
  split = _cfg(tmp_path, "split", f"data.packing={strategy}", "stop_at=3")
  trainer.train(split, progress=False)
  ids = _ids(n=6000)
  ids[10] = (ids[10] + 1) % 699  # the data changed under the run: refused like text
  ids.astype("<u2").tofile(tmp_path / "c.bin")
  (tmp_path / "t.bin").rename(tmp_path / "keep.bin")
  (tmp_path / "c.bin").rename(tmp_path / "t.bin")
  with pytest.raises(ValueError, match="changed data"):
    trainer.train(_cfg(tmp_path, "split", f"data.packing={strategy}"), progress=False)
  (tmp_path / "keep.bin").replace(tmp_path / "t.bin")
  trainer.train(_cfg(tmp_path, "split", f"data.packing={strategy}"), progress=False)
  (a, meta_a), (b, meta_b) = _params(straight), _params(split)
  assert meta_a["data_fingerprint"] == meta_b["data_fingerprint"]
  jax.tree.map(np.testing.assert_array_equal, a, b)
