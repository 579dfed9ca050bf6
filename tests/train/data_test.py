"""Byte corpus discovery, the held-out split and training windows, against references written here
(SHA-256 of relative paths, explicit file lists, enumerated window starts)."""

import hashlib
import math

import numpy as np
import pytest

from jaxpe.train import data


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


def test_directory_reads_text_by_content_and_skips_hidden_and_binary_files(tmp_path):
  files = {
    "README": b"plain text without a suffix\n",
    "LICENSE": b"MIT\n",
    "Apache-2.0": b"Apache License, Version 2.0\n",  # was skipped: '.0' read as a suffix
    "LGPL-2.1": b"GNU Lesser General Public License\n",
    "index.html": b"<html>text</html>\n",  # was skipped: suffix
    "data.json": b'{"a": 1}\n',
    "latin1.txt": "caf\u00e9 cr\u00e8me\n".encode("latin-1"),  # not UTF-8 but text
    "a.py": b"x = 1\n",
    "sub/b.md": b"# title\n",
    "empty.txt": b"",
    ".hidden.txt": b"hidden file\n",
    ".git/HEAD": b"ref: refs/heads/main\n",
    ".git/objects/ab/cdef": b"x\x00binary object",
    "sub/.cache/c.txt": b"cached\n",
    "prog": b"\x7fELF\x00\x01\x02",
    "late_nul.txt": b"a" * 5000 + b"\x00",
    "pic.txt": bytes(range(1, 32)) * 4 + b"\xff\xfe",  # no NUL, not UTF-8, mostly control bytes
    "real.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
  }
  for rel, content in files.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_bytes(content)
  found = data.scan_corpus(str(tmp_path))
  assert found.root == tmp_path
  text = ["Apache-2.0", "LGPL-2.1", "LICENSE", "README", "a.py", "data.json", "empty.txt", "index.html"]
  text += ["latin1.txt", "sub/b.md"]
  assert [str(f.relative_to(tmp_path)) for f in found.files] == text
  assert data.corpus_files(str(tmp_path)) == (tmp_path, found.files)
  skipped = {str(f.relative_to(tmp_path)): why.split(":")[0] for f, why in found.skipped}
  assert skipped == {
    ".git": "hidden folder",
    ".hidden.txt": "hidden",
    "sub/.cache": "hidden folder",
    "late_nul.txt": "binary",
    "pic.txt": "binary",
    "prog": "binary",
    "real.png": "binary",
  }
  (tmp_path / "linked").symlink_to(tmp_path / "sub", target_is_directory=True)
  (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
  again = {str(f.relative_to(tmp_path)): why for f, why in data.scan_corpus(str(tmp_path)).skipped}
  assert again["linked"] == "link to a folder (not followed)" and again["broken"] == "not a regular file"
  with pytest.raises(ValueError, match="binary: a NUL byte"):
    data.corpus_files(str(tmp_path / "prog"))
  # A NUL byte after the first 8 KiB does not make a file binary.
  (tmp_path / "long.txt").write_bytes(b"b" * 9000 + b"\x00")
  assert "long.txt" in [f.name for f in data.corpus_files(str(tmp_path))[1]]


def test_the_corpus_says_which_files_and_bytes_went_to_each_side_and_what_was_skipped(tmp_path):
  names = _names(lambda h: h < 0.5, 1, prefix="h") + _names(lambda h: h >= 0.5, 4, prefix="t")
  for i, name in enumerate(names):
    (tmp_path / name).write_bytes(bytes([65 + i]) * (100 + i))
  (tmp_path / "z.bin").write_bytes(b"\x00" * 10)
  corpus = data.load_corpus(str(tmp_path), max_bytes=250, eval_fraction=0.5)
  held_name, train_names = names[0], sorted(names[1:])
  # Reference: 125 held-out bytes from the one held file (100 bytes), 125 training bytes in sorted order.
  assert [(f.name, n) for f, n in corpus.held_files] == [(held_name, 100)]
  assert [(f.name, n) for f, n in corpus.train_files] == [(train_names[0], 101), (train_names[1], 24)]
  assert [f.name for f in corpus.unread] == train_names[2:]
  lines = corpus.describe().splitlines()
  assert lines[0] == f"data: {tmp_path}: 5 text files"
  assert lines[1] == f"  training: 125 bytes from 2 files ({train_names[0]}, {train_names[1]})"
  assert lines[2] == f"  held-out: 100 bytes from 1 file ({held_name})"
  assert lines[3] == f"  not read (data.max_bytes reached): 2 ({', '.join(train_names[2:])})"
  assert lines[4] == "  skipped 1: 1 binary (z.bin)"


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
