"""Byte-level text data: corpus discovery, a deterministic held-out split, and batches.

Tokens are bytes (vocab 256). The default corpus is the Python standard library's own ``.py``
sources (found through ``sysconfig``), present on every machine with Python.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text", "")
"""Suffixes read from a data directory ("" keeps suffix-less text such as README and LICENSE)."""
BINARY_SNIFF_BYTES = 8192
"""A file with a NUL byte in its first this many bytes is binary and skipped."""


def stdlib_files() -> list[Path]:
  """Sorted ``.py`` files of the running Python's standard library (site-packages excluded)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  return sorted(
    p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
  )


def is_binary(path: Path) -> bool:
  """True when the first ``BINARY_SNIFF_BYTES`` bytes of ``path`` contain a NUL byte."""
  with path.open("rb") as f:
    return b"\0" in f.read(BINARY_SNIFF_BYTES)


def corpus_files(path: str | None) -> tuple[Path, list[Path]]:
  """``(root, files)`` for ``--data PATH`` (a text file or a directory of text files), or the stdlib.

  In a directory, files are found recursively and kept when their suffix is in ``TEXT_SUFFIXES``,
  no component of their path below the directory starts with ``"."`` (hidden files and folders
  such as ``.git`` are skipped) and they are not binary (``is_binary``). Files are sorted.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: ``path`` is a binary file, or a directory without text files.
  """
  if path is None:
    return Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
  p = Path(path)
  if not p.exists():
    raise FileNotFoundError(f"data path {str(p)!r} does not exist")
  if p.is_file():
    if is_binary(p):
      raise ValueError(f"data path {str(p)!r} is binary (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes)")
    return p.parent, [p]
  files = []
  for dirpath, dirnames, filenames in os.walk(p):
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # prune hidden folders (.git)
    for name in filenames:
      f = Path(dirpath) / name
      if not name.startswith(".") and f.suffix.lower() in TEXT_SUFFIXES and f.is_file() and not is_binary(f):
        files.append(f)
  files.sort()
  if not files:
    raise ValueError(
      f"data path {str(p)!r} holds no text files (suffixes {TEXT_SUFFIXES}, not hidden, no NUL bytes)"
    )
  return p, files


@dataclass(frozen=True)
class Corpus:
  """Train and held-out byte streams: ``train [n_train]`` and ``eval [n_eval]`` uint8 (bytes are
  tokens); ``num_files`` files were found."""

  train: np.ndarray
  eval: np.ndarray
  num_files: int


def _path_hash(rel: str) -> float:
  """A file's place in [0, 1), from the SHA-256 of its relative path."""
  return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2**64


def split_files(root: Path, files: list[Path], *, eval_fraction: float) -> tuple[list[Path], list[Path]]:
  """``(train, held_out)`` files, each in the order of ``files``.

  A file is held out when the hash of its path relative to ``root`` (``_path_hash``) is below
  ``eval_fraction``, so its side does not depend on which other files exist. When that leaves
  either side empty (a small directory), the file with the smallest hash is held out and all
  others train. Needs at least two files.
  """
  hashes = {f: _path_hash(str(f.relative_to(root))) for f in files}
  held = [f for f in files if hashes[f] < eval_fraction]
  if not held or len(held) == len(files):
    held = [min(files, key=hashes.__getitem__)]
  train = [f for f in files if f not in held]
  return train, held


def _read_until(files: list[Path], cap: int) -> bytes:
  parts, total = [], 0
  for f in files:
    if total >= cap:
      break
    chunk = f.read_bytes()[: cap - total]
    parts.append(chunk)
    total += len(chunk)
  return b"".join(parts)


def load_corpus(path: str | None, *, max_bytes: int, eval_fraction: float) -> Corpus:
  """Reads the corpus and splits it deterministically into training and held-out bytes.

  Directories (and the stdlib) are split by file first (``split_files``: a file's side is fixed
  by the hash of its relative path); then at most ``ceil(eval_fraction * max_bytes)`` held-out
  and ``max_bytes`` minus that many training bytes are read, each side's files in sorted order.
  So adding or removing training files never changes the held-out bytes. A single file is split
  by bytes: its first ``max_bytes`` bytes, the last ``eval_fraction`` of them held out.

  Args:
    path: a text file, a directory, or None for the Python standard library's sources.
    max_bytes: cap on bytes read (train + held-out), > 0.
    eval_fraction: held-out share of files (directories) or bytes (one file), in (0, 1).

  Raises:
    FileNotFoundError, ValueError: see ``corpus_files``; also ValueError when the train or
      held-out part is empty.
  """
  root, files = corpus_files(path)
  if len(files) == 1:
    data = files[0].read_bytes()[:max_bytes]
    cut = int(len(data) * (1 - eval_fraction))
    train, held = data[:cut], data[cut:]
  else:
    train_files, held_files = split_files(root, files, eval_fraction=eval_fraction)
    held_cap = math.ceil(eval_fraction * max_bytes)
    train = _read_until(train_files, max_bytes - held_cap)
    held = _read_until(held_files, held_cap)
  train_arr = np.frombuffer(train, np.uint8)
  eval_arr = np.frombuffer(held, np.uint8)
  where = path or "the Python standard library"
  if train_arr.size == 0 or eval_arr.size == 0:
    raise ValueError(
      f"data path {where!r} gave {train_arr.size} training and {eval_arr.size} held-out bytes; "
      "both must be non-empty (add text or change data.eval_fraction / data.max_bytes)"
    )
  return Corpus(train=train_arr, eval=eval_arr, num_files=len(files))


def train_batch(
  tokens: np.ndarray, *, step: int, seed: int, batch_size: int, seq_len: int, rows: slice = slice(None)
) -> np.ndarray:
  """Random windows of ``seq_len + 1`` bytes for training step ``step``.

  Deterministic in ``(seed, step)``, so a resumed run continues with exactly the batches it would
  have seen: the data position is the step. Every window start ``0 .. n - seq_len - 1`` is possible,
  so the last byte is used.

  Args:
    tokens: ``[n]`` uint8 training bytes, ``n >= seq_len + 1``.
    step: training step (0-based); seed: the run's seed; batch_size: B; seq_len: T.
    rows: the rows of the global batch to read (a process's share in a multi-process run); the
      window starts are drawn for all B rows, so row i is the same whatever the slice.

  Returns:
    ``[B, T + 1]`` int32 (inputs ``[:, :-1]``, next-token targets ``[:, 1:]``), or the ``rows``
    of it.

  Raises:
    ValueError: fewer than ``seq_len + 1`` tokens.
  """
  if tokens.size < seq_len + 1:
    raise ValueError(f"training data has {tokens.size} bytes; seq_len + 1 = {seq_len + 1} needed")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, tokens.size - seq_len, size=batch_size)  # high is exclusive
  return np.stack([tokens[s : s + seq_len + 1] for s in starts[rows]]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int, num_batches: int) -> list[np.ndarray]:
  """Fixed held-out windows: ``seq_len + 1``-byte windows starting at multiples of ``seq_len``
  (adjacent windows share one byte), spread evenly over ``tokens``.

  Args:
    tokens: ``[n]`` uint8 held-out bytes.

  Returns:
    up to ``num_batches`` arrays ``[B, T + 1]`` int32 (B = batch_size, T = seq_len), as many as
    fit.

  Raises:
    ValueError: fewer than ``batch_size`` windows fit in ``tokens``.
  """
  n_windows = (tokens.size - 1) // seq_len
  if n_windows < batch_size:
    raise ValueError(
      f"held-out data has {tokens.size} bytes, fewer than batch_size * seq_len = {batch_size * seq_len}"
    )
  want = min(num_batches * batch_size, n_windows - n_windows % batch_size)
  idx = np.linspace(0, n_windows - 1, want).astype(np.int64)
  windows = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).astype(np.int32)
  return [windows[i : i + batch_size] for i in range(0, want, batch_size)]


def unigram_bits_per_byte(tokens: np.ndarray) -> float:
  """Entropy in bits per byte of the byte distribution of ``tokens`` (any shape, integers in
  ``[0, 256)``) itself: the cross-entropy of the best context-free model, for reference."""
  counts = np.bincount(tokens, minlength=256).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0: one distinct byte gives 0.0, not -0.0


def bits_per_byte(mean_nats_per_token: float) -> float:
  """Cross-entropy in nats per byte (token) -> bits per byte (divides by ln 2)."""
  return mean_nats_per_token / math.log(2)


def fingerprint(path: str | None, corpus: Corpus) -> dict[str, object]:
  """What identifies the bytes a run trains and evaluates on, for checkpoints and for the processes
  of a multi-process run to compare: ``sha256`` (hex) of the file list (paths relative to the data
  root, in order), the training bytes and the held-out bytes actually used (``corpus.train``,
  ``corpus.eval``: after ``max_bytes`` and the split), with ``train_bytes``, ``eval_bytes`` and
  ``files`` (counts) for messages.

  A changed file, an added or removed file, or prepended text all change ``sha256``; the path
  string itself does not enter it (the same corpus under another mount point is the same data).

  Raises:
    FileNotFoundError, ValueError: see ``corpus_files`` (``path`` no longer exists).
  """
  root, files = corpus_files(path)
  h = hashlib.sha256()
  for f in files:
    h.update(str(f.relative_to(root)).encode(errors="surrogateescape") + b"\0")
  for side in (corpus.train, corpus.eval):
    h.update(len(side).to_bytes(8, "little"))
    h.update(np.ascontiguousarray(side, np.uint8).tobytes())
  return {
    "sha256": h.hexdigest(),
    "train_bytes": int(corpus.train.size),
    "eval_bytes": int(corpus.eval.size),
    "files": len(files),
  }
