"""Token files: a flat array of token ids on disk, read memory-mapped (``data.tokens``).

Two formats: a ``.bin`` file of raw little-endian ``uint16`` or ``uint32`` ids, as nanoGPT's
``prepare.py`` writes them (``np.memmap(path, dtype)``; the dtype from ``data.token_dtype`` or the
``PATH.json`` sidecar ``jaxpe-tokenize`` writes), and a ``.npy`` file (``np.load(mmap_mode="r")``: the
dtype from its header; any unsigned or signed integer dtype of one dimension). Nothing is read into
memory beyond what a batch takes, except one pass that finds the largest id (checked against
``model.vocab_size``) and the fingerprint's hash.

The split, like a single text file's: the first ``1 - eval_fraction`` of the tokens train, the rest is
held out. Documents (for ``data.packing``) end with ``eot_token`` when one is set.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jaxpe.train import data

__all__ = ["SIDECAR_SUFFIX", "doc_starts", "fingerprint", "load_tokens", "read_sidecar", "token_array"]

SIDECAR_SUFFIX = ".json"
"""``tokens.bin`` -> ``tokens.bin.json``: ``{"dtype", "vocab_size", "eot_token", "tokenizer"}`` (the
tokenizer's file name relative to the sidecar's folder); every key optional."""
_CHUNK = 1 << 24  # tokens per pass of the max / hash loops (64 MiB of uint32)


def read_sidecar(path: Path) -> dict:
  """The sidecar ``PATH.json`` of a token file as a dict, ``{}`` when there is none.

  Raises:
    ValueError: the sidecar is not a JSON object.
  """
  side = Path(str(path) + SIDECAR_SUFFIX)
  if not side.is_file():
    return {}
  try:
    meta = json.loads(side.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f"token file sidecar {str(side)!r} is not valid JSON: {e}") from None
  if not isinstance(meta, dict):
    raise ValueError(f"token file sidecar {str(side)!r} must hold a JSON object, got {type(meta).__name__}")
  return meta


def token_array(path: str | Path, token_dtype: str | None = None) -> np.ndarray:
  """The ids of the token file ``path``, memory-mapped read-only: ``[n]`` of the file's dtype.

  Args:
    path: a ``.npy`` file (one-dimensional integers) or a raw ``.bin`` (any other suffix) file.
    token_dtype: ``"uint16"`` or ``"uint32"`` for a raw file; None = the sidecar's ``dtype``.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: a raw file without a dtype (neither ``token_dtype`` nor a sidecar ``dtype``), a
      dtype other than uint16 / uint32, a size not a multiple of the dtype's, an empty file; a
      ``.npy`` that is not one-dimensional integers, or a ``token_dtype`` that contradicts its header.
  """
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"data.tokens {str(p)!r} does not exist (or is not a regular file)")
  if p.suffix == ".npy":
    arr = np.load(p, mmap_mode="r", allow_pickle=False)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(
        f"data.tokens {str(p)!r} must hold a one-dimensional integer array, got {arr.dtype} of shape {arr.shape}"
      )
    if token_dtype is not None and np.dtype(token_dtype) != arr.dtype:
      raise ValueError(f"data.token_dtype={token_dtype!r} but {str(p)!r}'s header says {arr.dtype}")
  else:
    dtype = token_dtype or read_sidecar(p).get("dtype")
    if dtype is None:
      raise ValueError(
        f"data.tokens {str(p)!r} is a raw token file: give its dtype as data.token_dtype=uint16 (nanoGPT's "
        f'GPT-2 files) or uint32, or a sidecar {str(p) + SIDECAR_SUFFIX!r} with a "dtype" key'
      )
    if dtype not in ("uint16", "uint32"):
      raise ValueError(f"token file dtype must be uint16 or uint32, got {dtype!r}")
    size, width = p.stat().st_size, np.dtype(dtype).itemsize
    if size == 0 or size % width:
      raise ValueError(
        f"data.tokens {str(p)!r} has {size} bytes, not a positive multiple of {width} ({dtype} ids)"
      )
    arr = np.memmap(p, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
  if arr.size == 0:
    raise ValueError(f"data.tokens {str(p)!r} holds no tokens")
  return arr


def _max_id(arr: np.ndarray) -> tuple[int, int]:
  """``(largest id, its first index)`` of ``arr``, read in chunks; also the smallest id's check."""
  best, where, low = -1, 0, 0
  for i in range(0, arr.size, _CHUNK):
    chunk = np.asarray(arr[i : i + _CHUNK])
    j = int(chunk.argmax())
    if int(chunk[j]) > best:
      best, where = int(chunk[j]), i + j
    low = min(low, int(chunk.min()))
  if low < 0:
    raise ValueError(f"token ids must be >= 0, the file holds {low}")
  return best, where


def doc_starts(tokens: np.ndarray, eot_token: int | None) -> np.ndarray:
  """``[d]`` int64 start offsets of the documents in ``tokens`` (0 first): a document ends with
  ``eot_token`` (the token after each one starts the next); one document when None."""
  if eot_token is None:
    return np.zeros(1, np.int64)
  ends = [
    np.flatnonzero(np.asarray(tokens[i : i + _CHUNK]) == eot_token) + i for i in range(0, tokens.size, _CHUNK)
  ]
  after = np.concatenate([np.zeros(1, np.int64), *(e.astype(np.int64) + 1 for e in ends)])
  return after[after < tokens.size]


def load_tokens(
  path: str,
  *,
  eval_fraction: float,
  vocab_size: int,
  token_dtype: str | None = None,
  eot_token: int | None = None,
  tokenizer: str | None = None,
) -> data.Corpus:
  """A ``data.Corpus`` of the token file ``path`` (``token_array``): ``train`` the first
  ``n - ceil(n * eval_fraction)`` ids, ``eval`` the rest (memory-mapped views), documents from
  ``eot_token`` (or the sidecar's ``eot_token``), ``tokenizer`` the ``tokenizer.json`` given or the
  one the sidecar names (relative to its folder), else None.

  Raises:
    see ``token_array``; ValueError: an id >= ``vocab_size`` (naming the largest id, where it is and
    the vocab size it needs), a side with fewer than 2 tokens. FileNotFoundError: a ``tokenizer``
    (given or named by the sidecar) that does not exist.
  """
  p = Path(path)
  arr = token_array(p, token_dtype)
  largest, where = _max_id(arr)
  if largest >= vocab_size:
    raise ValueError(
      f"data.tokens {str(p)!r} holds token id {largest} (first at index {where:,}), but model.vocab_size is "
      f"{vocab_size}: ids must be < model.vocab_size; set model.vocab_size={largest + 1} or more"
    )
  meta = read_sidecar(p)
  eot = eot_token if eot_token is not None else meta.get("eot_token")
  tok = Path(tokenizer) if tokenizer is not None else None
  if tok is None and isinstance(meta.get("tokenizer"), str):
    tok = p.parent / meta["tokenizer"]
  if tok is not None and not tok.is_file():
    raise FileNotFoundError(f"tokenizer {str(tok)!r} of data.tokens {str(p)!r} does not exist")
  n = arr.size
  cut = n - int(np.ceil(n * eval_fraction))
  train, held = arr[:cut], arr[cut:]
  if train.size < 2 or held.size < 2:
    raise ValueError(
      f"data.tokens {str(p)!r} gave {train.size} training and {held.size} held-out tokens "
      f"(eval_fraction {eval_fraction}); both need at least 2"
    )
  starts = doc_starts(arr, eot)
  return data.Corpus(
    train=train,
    eval=held,
    num_files=1,
    where=str(p),
    root=p.parent,
    train_files=((p, int(train.size)),),
    held_files=((p, int(held.size)),),
    unit="tokens",
    train_docs=starts[starts < cut],
    eval_docs=np.concatenate([[0], starts[starts > cut] - cut]).astype(np.int64),
    tokenizer=tok,
  )


def fingerprint(corpus: data.Corpus) -> dict[str, object]:
  """``data.fingerprint`` of a token corpus: the SHA-256 of the dtype and of each side's ids (their
  bytes, little-endian), read in chunks; the path does not enter it."""
  h = hashlib.sha256()
  h.update(str(corpus.train.dtype.newbyteorder("<")).encode() + b"\0")
  for side in (corpus.train, corpus.eval):
    h.update(int(side.size).to_bytes(8, "little"))
    for i in range(0, side.size, _CHUNK):
      h.update(
        np.ascontiguousarray(side[i : i + _CHUNK]).astype(side.dtype.newbyteorder("<"), copy=False).tobytes()
      )
  return {
    "sha256": h.hexdigest(),
    "train_bytes": int(corpus.train.nbytes),  # the ids' bytes (the messages' sizes)
    "eval_bytes": int(corpus.eval.nbytes),
    "train_tokens": int(corpus.train.size),
    "eval_tokens": int(corpus.eval.size),
    "files": 1,
  }
