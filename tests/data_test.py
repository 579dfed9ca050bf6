"""Byte corpus discovery, the held-out split and training windows, against references written here
(SHA-256 of relative paths, explicit file lists, enumerated window starts)."""

import hashlib
import math

import numpy as np
import pytest

from jaxpe import data


def _h(rel):
  return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2**64


def _names(pred, n, prefix="f"):
  """The first n names f0.txt, f1.txt, ... whose path hash satisfies pred."""
  out, i = [], 0
  while len(out) < n:
    name = f"{prefix}{i}.txt"
    if pred(_h(name)):
      out.append(name)
    i += 1
  return out


def test_directory_skips_hidden_and_binary_files_but_keeps_suffixless_text(tmp_path):
  files = {
    "README": b"plain text without a suffix\n",
    "LICENSE": b"MIT\n",
    "a.py": b"x = 1\n",
    "sub/b.md": b"# title\n",
    ".hidden.txt": b"hidden file\n",
    ".git/HEAD": b"ref: refs/heads/main\n",
    ".git/objects/ab/cdef": b"x\x00binary object",
    "sub/.cache/c.txt": b"cached\n",
    "prog": b"\x7fELF\x00\x01\x02",
    "late_nul.txt": b"a" * 5000 + b"\x00",
    "pic.png": b"not read: suffix",
  }
  for rel, content in files.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_bytes(content)
  root, found = data.corpus_files(str(tmp_path))
  assert root == tmp_path
  assert [str(f.relative_to(tmp_path)) for f in found] == ["LICENSE", "README", "a.py", "sub/b.md"]
  with pytest.raises(ValueError, match="binary"):
    data.corpus_files(str(tmp_path / "prog"))
  # A NUL byte after the first 8 KiB does not make a file binary.
  (tmp_path / "long.txt").write_bytes(b"b" * 9000 + b"\x00")
  assert "long.txt" in [f.name for f in data.corpus_files(str(tmp_path))[1]]


@pytest.mark.parametrize("fraction", [0.05, 0.5])
def test_small_directory_without_held_out_file_holds_out_the_smallest_hash(tmp_path, fraction):
  names = _names(lambda h: h >= fraction, 2)  # both hash into train
  for i, name in enumerate(names):
    (tmp_path / name).write_bytes(bytes([65 + i]) * 100)
  corpus = data.load_corpus(str(tmp_path), max_bytes=10_000, eval_fraction=fraction)
  held = min(names, key=_h)
  train = [n for n in sorted(names) if n != held]
  assert corpus.eval.tobytes() == (tmp_path / held).read_bytes()
  assert corpus.train.tobytes() == b"".join((tmp_path / n).read_bytes() for n in train)


def test_small_directory_without_training_file_trains_on_all_but_the_smallest_hash(tmp_path):
  names = _names(lambda h: h < 0.9, 3)  # all hash into held-out at eval_fraction 0.9
  for i, name in enumerate(names):
    (tmp_path / name).write_bytes(bytes([65 + i]) * 50)
  corpus = data.load_corpus(str(tmp_path), max_bytes=10_000, eval_fraction=0.9)
  held = min(names, key=_h)
  assert corpus.eval.tobytes() == (tmp_path / held).read_bytes()
  assert corpus.train.tobytes() == b"".join((tmp_path / n).read_bytes() for n in sorted(names) if n != held)


def test_adding_training_files_never_changes_the_held_out_bytes(tmp_path):
  fraction, max_bytes = 0.3, 1000
  held = _names(lambda h: h < fraction, 2, prefix="h")
  train = _names(lambda h: h >= fraction, 2, prefix="t")
  for i, name in enumerate(held + train):
    (tmp_path / name).write_bytes(bytes([65 + i]) * 400)
  before = data.load_corpus(str(tmp_path), max_bytes=max_bytes, eval_fraction=fraction)
  held_cap = math.ceil(fraction * max_bytes)
  assert before.eval.tobytes() == b"".join((tmp_path / n).read_bytes() for n in sorted(held))[:held_cap]
  assert before.train.size == max_bytes - held_cap
  # A large training file that sorts first: with one cap over the sorted list it took the whole budget.
  (new,) = _names(lambda h: h >= fraction, 1, prefix="a")
  (tmp_path / new).write_bytes(b"z" * 5000)
  after = data.load_corpus(str(tmp_path), max_bytes=max_bytes, eval_fraction=fraction)
  np.testing.assert_array_equal(after.eval, before.eval)
  assert after.train.tobytes() == b"z" * (max_bytes - held_cap)


def test_single_file_is_split_by_bytes(tmp_path):
  (tmp_path / "one.txt").write_bytes(bytes(range(1, 101)))
  corpus = data.load_corpus(str(tmp_path / "one.txt"), max_bytes=80, eval_fraction=0.25)
  assert corpus.train.tolist() == list(range(1, 61)) and corpus.eval.tolist() == list(range(61, 81))


def test_train_batch_uses_every_window_including_the_last_byte():
  seq_len, n = 8, 12
  tokens = np.arange(n, dtype=np.uint8)
  starts = set()
  for step in range(200):
    x = data.train_batch(tokens, step=step, seed=0, batch_size=4, seq_len=seq_len)
    assert x.shape == (4, seq_len + 1) and x.dtype == np.int32
    for row in x:
      np.testing.assert_array_equal(row, np.arange(row[0], row[0] + seq_len + 1))
      starts.add(int(row[0]))
  assert starts == set(range(n - seq_len))  # 0 .. n - seq_len - 1: the last window ends at byte n - 1
  exact = data.train_batch(tokens[: seq_len + 1], step=0, seed=0, batch_size=2, seq_len=seq_len)
  np.testing.assert_array_equal(exact, np.stack([np.arange(seq_len + 1)] * 2))
  with pytest.raises(ValueError, match="seq_len \\+ 1"):
    data.train_batch(tokens[:seq_len], step=0, seed=0, batch_size=2, seq_len=seq_len)
