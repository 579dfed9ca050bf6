"""Byte-level text data: corpus discovery, a deterministic held-out split, and batches.

Tokens are bytes (vocab 256). The default corpus is the Python standard library's own ``.py``
sources (found through ``sysconfig``), present on every machine with Python.
"""

from __future__ import annotations

import codecs
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpe.ops import checks as _checks

BINARY_SNIFF_BYTES = 8192
"""How many leading bytes of a file decide whether it is text (``is_binary``)."""
CONTROL_SHARE = 0.1
"""A file whose first bytes are not UTF-8 is binary when more than this share of them are control
bytes (below 0x20 other than tab, newline, carriage return, form feed, backspace, escape; or 0x7f)."""
_TEXT_CONTROLS = frozenset(b"\t\n\r\f\b\x1b")


def stdlib_files() -> list[Path]:
  """Sorted ``.py`` files of the running Python's standard library (site-packages excluded)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  return sorted(
    p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
  )


def binary_reason(path: Path) -> str | None:
  """Why ``path`` is not text, or None for text; decided by content, never by name or suffix.

  Looks at the first ``BINARY_SNIFF_BYTES`` bytes: a NUL byte makes a file binary (images, archives,
  compiled code); otherwise UTF-8 text is text, and other bytes (Latin-1 text, say) are text unless
  more than ``CONTROL_SHARE`` of them are control bytes. An empty file is text.

  Raises:
    OSError: ``path`` cannot be read.
  """
  with path.open("rb") as f:
    head = f.read(BINARY_SNIFF_BYTES)
  if b"\0" in head:
    return f"binary: a NUL byte in its first {BINARY_SNIFF_BYTES} bytes"
  try:
    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut character at the end is fine
    return None
  except UnicodeDecodeError:
    pass
  controls = sum(1 for b in head if (b < 0x20 and b not in _TEXT_CONTROLS) or b == 0x7F)
  if controls > CONTROL_SHARE * len(head):
    return f"binary: not UTF-8 and {controls / len(head):.0%} control bytes in its first {len(head)} bytes"
  return None


def is_binary(path: Path) -> bool:
  """True when ``binary_reason(path)`` gives a reason (a NUL byte, or not UTF-8 and mostly control
  bytes, in the first ``BINARY_SNIFF_BYTES`` bytes)."""
  return binary_reason(path) is not None


@dataclass(frozen=True)
class CorpusFiles:
  """What a data path holds: ``root`` (a directory, or a single file's parent), the text ``files``
  (sorted) and the ``skipped`` ones as ``(path, reason)`` (hidden, binary, unreadable, not a regular
  file), sorted by path."""

  root: Path
  files: list[Path]
  skipped: list[tuple[Path, str]]


def scan_corpus(path: str | None) -> CorpusFiles:
  """The text files of ``--data PATH`` (a text file or a directory), or of the stdlib (None).

  ``path`` is taken verbatim (no ``~`` expansion, no YAML). In a directory, files are found
  recursively; a file is skipped, with its reason, when a component of its path below the directory
  starts with ``"."`` (hidden files and folders such as ``.git``: pruned, reported as one entry
  per hidden folder), when it is binary (``binary_reason``, by content: any name or suffix is read
  when its bytes are text), unreadable, or not a regular file (sockets, broken links).

  Raises:
    TypeError: ``path`` is not a string or None.
    ValueError: ``path`` is empty, a binary file, or a directory without text files (the skipped
      files counted by reason).
    FileNotFoundError: ``path`` does not exist.
    OSError: a single-file ``path`` cannot be read.
  """
  if path is None:
    return CorpusFiles(Path(sysconfig.get_paths()["stdlib"]), stdlib_files(), [])
  if not isinstance(path, str):
    raise TypeError(f"data path must be a string, got {type(path).__name__}")
  if not path:
    raise ValueError("data path is empty; give a text file or a directory")
  p = Path(path)
  if not p.exists():
    raise FileNotFoundError(f"data path {str(p)!r} does not exist")
  if not p.is_dir():
    if not p.is_file():
      raise ValueError(f"data path {str(p)!r} is not a regular file or a directory")
    reason = binary_reason(p)
    if reason:
      raise ValueError(f"data path {str(p)!r} is {reason}")
    return CorpusFiles(p.parent, [p], [])
  files: list[Path] = []
  skipped: list[tuple[Path, str]] = []

  def unreadable(e: OSError) -> None:  # a folder that cannot be listed
    skipped.append((Path(e.filename), f"unreadable folder: {e.strerror or e}"))

  for dirpath, dirnames, filenames in os.walk(p, onerror=unreadable):
    for d in sorted(dirnames):
      if d.startswith("."):  # prune hidden folders (.git)
        skipped.append((Path(dirpath) / d, "hidden folder"))
      elif (Path(dirpath) / d).is_symlink():  # os.walk does not follow them (no loops)
        skipped.append((Path(dirpath) / d, "link to a folder (not followed)"))
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    for name in filenames:
      f = Path(dirpath) / name
      if name.startswith("."):
        skipped.append((f, "hidden"))
        continue
      if not f.is_file():
        skipped.append((f, "not a regular file"))
        continue
      try:
        reason = binary_reason(f)
      except OSError as e:
        reason = f"unreadable: {e.strerror or e}"
      if reason:
        skipped.append((f, reason))
      else:
        files.append(f)
  files.sort()
  skipped.sort()
  if not files:
    raise ValueError(
      f"data path {str(p)!r} holds no text files ({_skip_summary(p, skipped) or 'it is empty'})"
    )
  return CorpusFiles(p, files, skipped)


def corpus_files(path: str | None) -> tuple[Path, list[Path]]:
  """``(root, files)`` of ``scan_corpus(path)``: the sorted text files of a data path.

  Raises:
    see ``scan_corpus``.
  """
  found = scan_corpus(path)
  return found.root, found.files


def _short_list(root: Path, paths: list[Path], n: int = 3) -> str:
  names = [str(f.relative_to(root)) if f.is_relative_to(root) else str(f) for f in paths[:n]]
  return ", ".join(names) + (f", ... ({len(paths) - n} more)" if len(paths) > n else "")


def _skip_summary(root: Path, skipped: list[tuple[Path, str]]) -> str:
  """``"skipped 3: 2 hidden (.env, x/.a), 1 binary (a.png)"`` (kinds: hidden, hidden folder, binary,
  unreadable, not a regular file), or ``""``."""
  if not skipped:
    return ""
  groups: dict[str, list[Path]] = {}
  for f, why in skipped:
    groups.setdefault(why.split(":")[0], []).append(f)
  parts = [f"{len(items)} {kind} ({_short_list(root, items)})" for kind, items in groups.items()]
  return f"skipped {len(skipped)}: " + ", ".join(parts)


@dataclass(frozen=True)
class Corpus:
  """Train and held-out byte streams: ``train [n_train]`` and ``eval [n_eval]`` uint8 (bytes are
  tokens); ``num_files`` text files were found.

  Where the bytes came from: ``train_files`` / ``held_files`` are the files read into each side
  (``(path, bytes read)``, in reading order; for a single file both name it), ``unread`` the text
  files not read because ``max_bytes`` was reached, ``skipped`` the ``(path, reason)`` of files
  that are not text (``scan_corpus``), ``root`` the data directory (``where`` names the data path).
  ``describe()`` says all of it in a few lines.

  ``unit`` is ``"bytes"`` (text) or ``"tokens"`` (a token file, ``jaxpe.train.token_data``: then
  ``train``/``eval`` are memory-mapped ids of any integer dtype). ``train_docs`` / ``eval_docs``:
  ``[d]`` int64 start offsets of the documents (files; a token file's ``eot_token``) in each side,
  0 first (``jaxpe.train.packing``); None = one document. ``tokenizer``: the ``tokenizer.json`` of a
  token file (``jaxpe.train.tokenize``), None = none (bytes).
  """

  train: np.ndarray
  eval: np.ndarray
  num_files: int
  where: str = ""
  root: Path | None = None
  train_files: tuple[tuple[Path, int], ...] = ()
  held_files: tuple[tuple[Path, int], ...] = ()
  unread: tuple[Path, ...] = ()
  skipped: tuple[tuple[Path, str], ...] = ()
  unit: str = "bytes"
  train_docs: np.ndarray | None = None
  eval_docs: np.ndarray | None = None
  tokenizer: Path | None = None

  def describe(self) -> str:
    """Lines for the start of a run: the data path, the text files found, the bytes and files (a
    short list) on each side, the files not read (``data.max_bytes``) and the skipped ones by reason."""
    root = self.root or Path(".")
    kind = "token" if self.unit == "tokens" else "text"
    lines = [f"data: {self.where}: {self.num_files} {kind} file{'s' * (self.num_files != 1)}"]
    for side, arr, files in (
      ("training", self.train, self.train_files),
      ("held-out", self.eval, self.held_files),
    ):
      lines.append(
        f"  {side}: {arr.size:,} {self.unit} from {len(files)} file{'s' * (len(files) != 1)} "
        f"({_short_list(root, [f for f, _ in files])})"
      )
    if self.unread:
      lines.append(
        f"  not read (data.max_bytes reached): {len(self.unread)} ({_short_list(root, list(self.unread))})"
      )
    if self.skipped:
      lines.append(f"  {_skip_summary(root, list(self.skipped))}")
    return "\n".join(lines)


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


def _read_until(files: list[Path], cap: int) -> tuple[bytes, list[tuple[Path, int]], list[Path]]:
  """The first ``cap`` bytes of ``files`` in order, the ``(file, bytes read)`` that gave them and the
  files not reached."""
  parts, read, total = [], [], 0
  for i, f in enumerate(files):
    if total >= cap:
      return b"".join(parts), read, files[i:]
    chunk = f.read_bytes()[: cap - total]
    parts.append(chunk)
    read.append((f, len(chunk)))
    total += len(chunk)
  return b"".join(parts), read, []


def load_corpus(path: str | None, *, max_bytes: int, eval_fraction: float) -> Corpus:
  """Reads the corpus and splits it deterministically into training and held-out bytes.

  Directories (and the stdlib) are split by file first (``split_files``: a file's side is fixed
  by the hash of its relative path); then at most ``ceil(eval_fraction * max_bytes)`` held-out
  and ``max_bytes`` minus that many training bytes are read, each side's files in sorted order.
  So adding or removing training files never changes the held-out bytes. A single file is split
  by bytes: its first ``max_bytes`` bytes, the last ``eval_fraction`` of them held out. Which files
  are text is decided by content (``scan_corpus``); ``Corpus.describe()`` reports the split.

  Args:
    path: a text file, a directory (taken verbatim), or None for the Python standard library's sources.
    max_bytes: cap on bytes read (train + held-out), an int > 0.
    eval_fraction: held-out share of files (directories) or bytes (one file), a float in (0, 1).

  Raises:
    TypeError: ``max_bytes`` not an int, ``eval_fraction`` not a real number.
    FileNotFoundError, ValueError: see ``scan_corpus``; also ValueError for ``max_bytes`` <= 0,
      ``eval_fraction`` outside (0, 1), or when the train or held-out part is empty.
  """
  if not _checks.is_int(max_bytes):
    raise TypeError(f"max_bytes must be an int, got {type(max_bytes).__name__}")
  max_bytes = int(max_bytes)
  if max_bytes <= 0:
    raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
  if not isinstance(eval_fraction, (int, float)) or isinstance(eval_fraction, bool):
    raise TypeError(f"eval_fraction must be a float, got {type(eval_fraction).__name__}")
  if not 0 < eval_fraction < 1:  # also refuses NaN
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
  found = scan_corpus(path)
  root, files = found.root, found.files
  unread: list[Path] = []
  if len(files) == 1:
    data = files[0].read_bytes()[:max_bytes]
    cut = int(len(data) * (1 - eval_fraction))
    train, held = data[:cut], data[cut:]
    train_read, held_read = [(files[0], len(train))], [(files[0], len(held))]
  else:
    train_files, held_files = split_files(root, files, eval_fraction=eval_fraction)
    held_cap = math.ceil(eval_fraction * max_bytes)
    train, train_read, unread_train = _read_until(train_files, max_bytes - held_cap)
    held, held_read, unread_held = _read_until(held_files, held_cap)
    unread = sorted(unread_train + unread_held)
  train_arr = np.frombuffer(train, np.uint8)
  eval_arr = np.frombuffer(held, np.uint8)
  where = path if path is not None else "the Python standard library"
  train_docs = np.cumsum([0] + [n for _, n in train_read[:-1]], dtype=np.int64)
  held_docs = np.cumsum([0] + [n for _, n in held_read[:-1]], dtype=np.int64)
  if len(files) == 1:  # one file split by bytes: each side is one document
    train_docs = held_docs = np.zeros(1, np.int64)
  if train_arr.size == 0 or eval_arr.size == 0:
    raise ValueError(
      f"data path {where!r} gave {train_arr.size} training and {eval_arr.size} held-out bytes; "
      "both must be non-empty (add text or change data.eval_fraction / data.max_bytes)"
    )
  return Corpus(
    train=train_arr,
    eval=eval_arr,
    num_files=len(files),
    where=str(where),
    root=root,
    train_files=tuple(train_read),
    held_files=tuple(held_read),
    unread=tuple(unread),
    skipped=tuple(found.skipped),
    train_docs=_starts(train_docs, train_arr.size),
    eval_docs=_starts(held_docs, eval_arr.size),
  )


def _starts(starts: np.ndarray, size: int) -> np.ndarray:
  """Document starts without repeats (empty files) or ends (an empty last file)."""
  starts = np.unique(starts)
  return starts[starts < size]


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


def fingerprint(corpus: Corpus) -> dict[str, object]:
  """What identifies the bytes a run trains and evaluates on, for checkpoints and for the processes
  of a multi-process run to compare: ``sha256`` (hex) of the files read into each side (paths
  relative to the data root, in reading order, with the bytes read from each), the training bytes
  and the held-out bytes actually used (``corpus.train``, ``corpus.eval``: after ``max_bytes`` and
  the split), with ``train_bytes``, ``eval_bytes`` and ``files`` (counts) for messages.

  A changed file, an added or removed file, or prepended text all change ``sha256``; the path
  string itself does not enter it (the same corpus under another mount point is the same data).
  """
  root = corpus.root or Path(".")
  files = [f for f, _ in corpus.train_files] + [f for f, _ in corpus.held_files]
  h = hashlib.sha256()
  for side_files in (corpus.train_files, corpus.held_files):
    h.update(len(side_files).to_bytes(8, "little"))
    for f, n in side_files:
      rel = f.relative_to(root) if f.is_relative_to(root) else f
      h.update(str(rel).encode(errors="surrogateescape") + b"\0" + n.to_bytes(8, "little"))
  for side in (corpus.train, corpus.eval):
    h.update(len(side).to_bytes(8, "little"))
    h.update(np.ascontiguousarray(side, np.uint8).tobytes())
  return {
    "sha256": h.hexdigest(),
    "train_bytes": int(corpus.train.size),
    "eval_bytes": int(corpus.eval.size),
    "files": len(set(files)),
  }
