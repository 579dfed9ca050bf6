"""Document packing (``data.packing``): rows of documents with segment ids, so that positions restart
and attention stays inside each document, and the loss scores only targets inside a document.

A packed batch is ``[B, 3, T + 1]`` int32: ``[:, 0]`` tokens, ``[:, 1]`` the 0/1 loss weight of each
token as a target, ``[:, 2]`` segment ids (1, 2, ... per document in the row; 0 = padding).
``jaxpe.train.steps.next_token_loss_sum`` gives the model ``segment_ids = [:, 2, :-1]`` (the decoder
then restarts positions per document and masks attention across documents, on every backend) and
scores target ``t`` with ``[:, 1, t]``.

The loss convention is maxtext's (``targets_segmentation``; levanter's ``LmExample`` masks alike): a
target is scored when it is a real token of the same document as its input, so padding is never a
target and the first token of each document in a row (whose input is the previous document's last
token, which it cannot see) is not scored. A document cut across rows continues in the next with
positions from 0 (maxtext's and levanter's ``concat_then_split`` do the same).

Strategies (names as maxtext's ``packing``):

- ``concat_then_split``: the text run's windows (``data.train_batch``: the same starts for the same
  ``(seed, step)``, all ``T + 1`` tokens real), with the segment ids of the documents they cut; no
  padding.
- ``first_fit``: each document cut into pieces of at most ``T + 1`` tokens (a piece of one token has
  no target and is dropped), the pieces placed in document order into the first of up to
  ``FIRST_FIT_BINS`` open rows with room (a new row when none has; a full piece takes a row of its
  own), rows padded with segment 0 (grain's ``FirstFitPackIterDataset`` packs alike, over
  ``num_packing_bins`` open rows). A step's rows are drawn from ``(seed, step)``, so a resumed run sees
  the same batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxpe.train import data

__all__ = [
  "FIRST_FIT_BINS",
  "PackedRows",
  "eval_batches",
  "first_fit",
  "make_train_batch",
  "packed_row",
  "padding_share",
  "report",
  "segment_ids",
]

FIRST_FIT_BINS = 64
"""Open rows first-fit packing chooses among (grain's ``num_packing_bins``)."""


def segment_ids(doc_starts: np.ndarray, lo: int, length: int) -> np.ndarray:
  """``[length]`` int32 segment ids (1 for the first document, then 2, ...) of the tokens
  ``lo .. lo + length - 1`` of a stream whose documents start at ``doc_starts`` (sorted, 0 first)."""
  idx = np.arange(lo, lo + length)
  doc = np.searchsorted(doc_starts, idx, side="right")
  return (doc - doc[0] + 1).astype(np.int32)


def packed_row(tokens: np.ndarray, segments: np.ndarray) -> np.ndarray:
  """``[3, L]`` int32 (tokens, loss weights, segment ids) of a row of ``L`` tokens and their segment
  ids (0 = padding): the weight of token t is 1 when it and token t - 1 are real tokens of one document."""
  weights = np.zeros_like(segments)
  weights[1:] = (segments[1:] == segments[:-1]) & (segments[1:] != 0)
  return np.stack([tokens.astype(np.int32), weights.astype(np.int32), segments.astype(np.int32)])


@dataclass(frozen=True)
class PackedRows:
  """First-fit rows of ``row_len`` tokens: row r holds the pieces ``row_ptr[r] .. row_ptr[r + 1] - 1``
  (``piece_start``, ``piece_len``: offsets in the token stream), in order."""

  row_len: int
  piece_start: np.ndarray
  piece_len: np.ndarray
  row_ptr: np.ndarray

  @property
  def num_rows(self) -> int:
    return int(self.row_ptr.size - 1)

  def row(self, tokens: np.ndarray, r: int) -> np.ndarray:
    """``[3, row_len]`` int32 ``packed_row`` of row ``r``, padded with token 0, segment 0."""
    toks = np.zeros(self.row_len, np.int64)
    segs = np.zeros(self.row_len, np.int32)
    at = 0
    for k, p in enumerate(range(self.row_ptr[r], self.row_ptr[r + 1])):
      s, n = int(self.piece_start[p]), int(self.piece_len[p])
      toks[at : at + n] = tokens[s : s + n]
      segs[at : at + n] = k + 1
      at += n
    return packed_row(toks, segs)


def first_fit(doc_starts: np.ndarray, size: int, row_len: int, *, bins: int = FIRST_FIT_BINS) -> PackedRows:
  """First-fit packing of the documents of a stream of ``size`` tokens (starting at ``doc_starts``)
  into rows of ``row_len`` tokens (see the module docstring).

  Raises:
    ValueError: no piece of at least 2 tokens (nothing to train on).
  """
  ends = np.append(doc_starts[1:], size)
  starts, lens = [], []
  for s, e in zip(doc_starts.tolist(), ends.tolist(), strict=True):
    for a in range(s, e, row_len):
      n = min(row_len, e - a)
      if n >= 2:
        starts.append(a)
        lens.append(n)
  if not starts:
    raise ValueError("packing found no document of 2 or more tokens")
  rem = np.full(bins, -1, np.int64)  # room left in each open row; -1 = slot unused
  slot_row = np.full(bins, -1, np.int64)
  piece_row = np.empty(len(starts), np.int64)
  rows = 0
  for i, n in enumerate(lens):
    if n == row_len:  # a full piece: a row of its own
      piece_row[i], rows = rows, rows + 1
      continue
    fits = np.flatnonzero(rem >= n)
    if fits.size:
      j = fits[0]
    else:  # a new row in place of the fullest open one (or an unused slot)
      j = int(rem.argmin())
      slot_row[j], rem[j], rows = rows, row_len, rows + 1
    piece_row[i] = slot_row[j]
    rem[j] -= n
  order = np.argsort(piece_row, kind="stable")
  row_ptr = np.concatenate([[0], np.cumsum(np.bincount(piece_row, minlength=rows))]).astype(np.int64)
  return PackedRows(row_len, np.asarray(starts, np.int64)[order], np.asarray(lens, np.int64)[order], row_ptr)


def padding_share(packed: PackedRows) -> float:
  """The share of padding tokens in ``packed``'s rows."""
  return 1.0 - float(packed.piece_len.sum()) / (packed.num_rows * packed.row_len)


def report(strategy: str, make: Callable[..., np.ndarray], *, progress: bool) -> dict[str, object]:
  """``{"strategy", "padding_share"}`` of a run's ``make_train_batch`` (first_fit: its rows' padding
  share; concat_then_split: 0), printed as one line with ``progress``."""
  packed = getattr(make, "packed", None)
  share = padding_share(packed) if packed is not None else 0.0
  if progress:
    print(f"packing: {strategy}, {share:.2%} of the training rows' tokens are padding")
  return {"strategy": strategy, "padding_share": share}


def _docs(corpus: data.Corpus, side: str) -> np.ndarray:
  docs = getattr(corpus, f"{side}_docs")
  return np.zeros(1, np.int64) if docs is None else docs


def make_train_batch(corpus: data.Corpus, strategy: str, seq_len: int) -> Callable[..., np.ndarray]:
  """``make(step=, seed=, batch_size=, seq_len=, rows=)`` -> the step's packed batch ``[B, 3, T + 1]``
  (or its ``rows``) of ``corpus.train`` with ``strategy`` (``concat_then_split`` or ``first_fit``),
  deterministic in ``(seed, step)``; row i is the same whatever the slice.

  Raises:
    ValueError: an unknown strategy; see ``first_fit``.
  """
  tokens, docs = corpus.train, _docs(corpus, "train")
  if strategy == "concat_then_split":

    def make(*, step, seed, batch_size, seq_len, rows=slice(None)):
      windows = data.train_batch(
        tokens, step=step, seed=seed, batch_size=batch_size, seq_len=seq_len, rows=rows
      )
      rng = np.random.default_rng([seed, step])  # the starts train_batch drew
      starts = rng.integers(0, tokens.size - seq_len, size=batch_size)[rows]
      return np.stack(
        [packed_row(w, segment_ids(docs, int(s), seq_len + 1)) for w, s in zip(windows, starts, strict=True)]
      )

    return make
  if strategy != "first_fit":
    raise ValueError(f"data.packing must be concat_then_split or first_fit, got {strategy!r}")
  packed = first_fit(docs, tokens.size, seq_len + 1)

  def make_ff(*, step, seed, batch_size, seq_len, rows=slice(None)):
    picks = np.random.default_rng([seed, step]).integers(0, packed.num_rows, size=batch_size)[rows]
    return np.stack([packed.row(tokens, int(r)) for r in picks])

  make_ff.packed = packed  # for the padding share in the run's report
  return make_ff


def eval_batches(
  corpus: data.Corpus, strategy: str, *, batch_size: int, seq_len: int, num_batches: int
) -> list[np.ndarray]:
  """Fixed held-out packed batches ``[B, 3, T + 1]``: ``concat_then_split``: ``data.eval_batches``'
  windows with their segment ids; ``first_fit``: up to ``num_batches * B`` first-fit rows of
  ``corpus.eval`` spread evenly.

  Raises:
    ValueError: fewer than ``batch_size`` windows or rows in the held-out data.
  """
  tokens, docs = corpus.eval, _docs(corpus, "eval")
  if strategy == "concat_then_split":
    plain = data.eval_batches(tokens, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches)
    n_windows = (tokens.size - 1) // seq_len
    want = sum(len(b) for b in plain)
    idx = np.linspace(0, n_windows - 1, want).astype(np.int64)
    rows = np.stack(
      [
        packed_row(w, segment_ids(docs, int(i) * seq_len, seq_len + 1))
        for w, i in zip(np.concatenate(plain), idx, strict=True)
      ]
    )
  else:
    packed = first_fit(docs, tokens.size, seq_len + 1)
    if packed.num_rows < batch_size:
      raise ValueError(
        f"held-out data packs into {packed.num_rows} rows of seq_len + 1 = {seq_len + 1} tokens, fewer than "
        f"batch_size = {batch_size}"
      )
    want = min(num_batches * batch_size, packed.num_rows - packed.num_rows % batch_size)
    idx = np.linspace(0, packed.num_rows - 1, want).astype(np.int64)
    rows = np.stack([packed.row(tokens, int(r)) for r in idx])
  return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
