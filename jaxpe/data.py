"""Byte-level text data: corpus discovery, a deterministic held-out split, and batches.

Tokens are bytes (vocab 256). The default corpus is the Python standard library's own ``.py``
sources (found through ``sysconfig``), present on every machine with Python.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text", "")


def stdlib_files() -> list[Path]:
  """Sorted ``.py`` files of the running Python's standard library (site-packages excluded)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  return sorted(
    p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
  )


def corpus_files(path: str | None) -> tuple[Path, list[Path]]:
  """``(root, files)`` for ``--data PATH`` (a text file or a directory of text files), or the stdlib.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: ``path`` is a directory without text files, or the files are empty.
  """
  if path is None:
    return Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
  p = Path(path)
  if not p.exists():
    raise FileNotFoundError(f"data path {str(p)!r} does not exist")
  if p.is_file():
    files = [p]
  else:
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    if not files:
      raise ValueError(f"data path {str(p)!r} holds no text files (suffixes {TEXT_SUFFIXES})")
  return (p if p.is_dir() else p.parent), files


@dataclass(frozen=True)
class Corpus:
  """Train and held-out byte streams (uint8)."""

  train: np.ndarray
  eval: np.ndarray
  num_files: int


def _is_heldout(rel: str, fraction: float) -> bool:
  h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
  return h / 2**64 < fraction


def load_corpus(path: str | None, *, max_bytes: int, eval_fraction: float) -> Corpus:
  """Reads the corpus and splits it deterministically.

  Directories are split by file (a file's place is fixed by the hash of its relative path, so the
  split does not depend on which other files exist); a single file is split by its last
  ``eval_fraction`` of bytes. At most ``max_bytes`` bytes are read (files in sorted order).

  Raises:
    FileNotFoundError, ValueError: see ``corpus_files``; also when the train or held-out part is
      empty.
  """
  root, files = corpus_files(path)
  train, held, total = [], [], 0
  for f in files:
    if total >= max_bytes:
      break
    data = f.read_bytes()[: max_bytes - total]
    total += len(data)
    if len(files) == 1:
      cut = int(len(data) * (1 - eval_fraction))
      train.append(data[:cut])
      held.append(data[cut:])
    elif _is_heldout(str(f.relative_to(root)), eval_fraction):
      held.append(data)
    else:
      train.append(data)
  train_arr = np.frombuffer(b"".join(train), np.uint8)
  eval_arr = np.frombuffer(b"".join(held), np.uint8)
  where = path or "the Python standard library"
  if train_arr.size == 0 or eval_arr.size == 0:
    raise ValueError(
      f"data path {where!r} gave {train_arr.size} training and {eval_arr.size} held-out bytes; "
      "both must be non-empty (add text or change data.eval_fraction)"
    )
  return Corpus(train=train_arr, eval=eval_arr, num_files=len(files))


def train_batch(tokens: np.ndarray, *, step: int, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
  """Random windows of ``seq_len + 1`` bytes for training step ``step``.

  Deterministic in ``(seed, step)``, so a resumed run continues with exactly the batches it would
  have seen: the data position is the step.

  Returns:
    ``[batch_size, seq_len + 1]`` int32.
  """
  if tokens.size <= seq_len + 1:
    raise ValueError(f"training data has {tokens.size} bytes; seq_len + 1 = {seq_len + 1} needed")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, tokens.size - seq_len - 1, size=batch_size)
  return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int, num_batches: int) -> list[np.ndarray]:
  """Fixed held-out windows: consecutive non-overlapping ``seq_len + 1`` windows spread evenly.

  Returns:
    up to ``num_batches`` arrays ``[batch_size, seq_len + 1]`` int32.
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
  """Entropy (bits) of the byte distribution of ``tokens`` itself: the best context-free model."""
  counts = np.bincount(tokens, minlength=256).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())


def bits_per_byte(mean_nats_per_token: float) -> float:
  """Cross-entropy in nats per byte -> bits per byte."""
  return mean_nats_per_token / math.log(2)
