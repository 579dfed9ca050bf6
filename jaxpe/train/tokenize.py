"""The ``jaxpe-tokenize`` command: a user's text files -> a token file a run reads (``data.tokens``).

jaxpe-tokenize my_texts/ --out data/mine --vocab-size 4096             # train a BPE tokenizer here
jaxpe-tokenize my_texts/ --out data/mine --tokenizer other/tokenizer.json   # or use one you have

Trains a byte-level BPE tokenizer with Hugging Face ``tokenizers`` on the text files given (locally,
nothing downloaded; ``BpeTrainer`` over the files' text, the 256 byte symbols always in the vocabulary,
so any text encodes), or loads a ``tokenizer.json``; then encodes each text file as one document
followed by the end-of-document token ``<|endoftext|>`` and writes, in ``--out``:

- ``tokens.bin``: the ids, ``uint16`` when the vocabulary fits, else ``uint32`` (nanoGPT's layout);
- ``tokens.bin.json``: the sidecar ``{"dtype", "vocab_size", "eot_token", "tokenizer", "documents",
  "tokens"}`` that ``data.tokens`` reads (``jaxpe.train.token_data``);
- ``tokenizer.json``: the tokenizer; a run copies it into its workdir and ``jaxpe-sample`` decodes with it.

Files are found as ``jaxpe-train --data`` finds them (``jaxpe.train.data.scan_corpus``: text by
content, hidden and binary files skipped), in sorted order, read as UTF-8 (other bytes replaced).
The last line printed is the ``jaxpe-train`` command for the token file. Byte-level text (no
tokenizer) stays ``jaxpe-train``'s default. Exit status: 0 done, 2 a usage error (one line).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from jaxpe.errors import require_extra
from jaxpe.train import data, run_files, run_guard, token_data

__all__ = [
  "EOT",
  "decode",
  "encode",
  "load_tokenizer",
  "main",
  "run",
  "token_bytes",
  "tokenize_files",
  "train_tokenizer",
]

EOT = "<|endoftext|>"
"""The end-of-document token's text (GPT-2's), a special token of every tokenizer trained here."""


def _tokenizers():
  require_extra("train", "jaxpe-tokenize", ("tokenizers",))
  import tokenizers

  return tokenizers


def train_tokenizer(texts, vocab_size: int):
  """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (an iterable of strings) with
  ``vocab_size`` entries at most (the 256 byte symbols and ``EOT`` included; GPT-2's byte-level
  pre-tokenizer and decoder). Source: Sennrich et al., arXiv 1508.07909 (BPE); Radford et al. 2019 (GPT-2's
  byte-level BPE), as ``tokenizers`` implements them.

  Raises:
    ValueError: ``vocab_size`` below 257 (the bytes and ``EOT``).
  """
  if vocab_size < 257:
    raise ValueError(f"--vocab-size must be >= 257 (256 bytes and {EOT}), got {vocab_size}")
  tk = _tokenizers()
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[EOT],
    initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def load_tokenizer(path: str | Path):
  """The ``tokenizers.Tokenizer`` in the ``tokenizer.json`` at ``path``.

  Raises:
    FileNotFoundError: no such file. ValueError: not a tokenizer file.
  """
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"tokenizer {str(p)!r} does not exist")
  try:
    return _tokenizers().Tokenizer.from_file(str(p))
  except Exception as e:  # tokenizers raises its own Exception type
    raise ValueError(f"{str(p)!r} is not a tokenizers tokenizer.json: {e}") from None


def encode(tokenizer, text: str) -> list[int]:
  """``text``'s ids (``tokenizer`` None: its UTF-8 bytes, byte-level)."""
  return list(text.encode()) if tokenizer is None else tokenizer.encode(text).ids


def decode(tokenizer, ids) -> str:
  """The text of ``ids`` (``tokenizer`` None: bytes decoded as UTF-8 with replacement characters)."""
  ids = [int(i) for i in ids]
  if tokenizer is None:
    return bytes(ids).decode("utf-8", errors="replace")
  return tokenizer.decode(ids, skip_special_tokens=False)


def token_bytes(tokenizer) -> np.ndarray | None:
  """``[V]`` int64: the bytes of text each id stands for, for a byte-level tokenizer (its decoder
  ``ByteLevel``: GPT-2's, every tokenizer ``jaxpe-tokenize`` trains; each character of a vocabulary
  entry is one byte, by GPT-2's byte-to-unicode table); added and special tokens (``EOT``) stand for
  none. None for other tokenizers (their entries' bytes are not their lengths). Source: Radford et
  al. 2019 (GPT-2's ``bytes_to_unicode``), as ``tokenizers``' ``ByteLevel`` implements it."""
  if type(tokenizer.decoder).__name__ != "ByteLevel":
    return None
  table = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), np.int64)
  for text, i in tokenizer.get_vocab(with_added_tokens=False).items():
    table[i] = len(text)
  for i in tokenizer.get_added_tokens_decoder():
    table[i] = 0
  return table


def tokenize_files(
  inputs: list[str], out: str | Path, *, vocab_size: int = 4096, tokenizer: str | None = None
) -> dict:
  """Writes ``tokens.bin``, ``tokens.bin.json`` and ``tokenizer.json`` in ``out`` (see the module
  docstring) from the text files of ``inputs`` (files or directories); returns the sidecar dict.

  Raises:
    FileNotFoundError, ValueError: an input that does not exist or holds no text
      (``data.scan_corpus``); a tokenizer without ``EOT``; see ``train_tokenizer``, ``load_tokenizer``.
  """
  if not inputs:
    raise ValueError("give at least one text file or directory")
  files: list[Path] = []
  for path in inputs:
    files += data.scan_corpus(path).files
  files = sorted(set(files))
  out = Path(out)

  def texts():
    for f in files:
      yield f.read_bytes().decode("utf-8", errors="replace")

  tok = load_tokenizer(tokenizer) if tokenizer is not None else train_tokenizer(texts(), vocab_size)
  eot = tok.token_to_id(EOT)
  if eot is None:
    raise ValueError(
      f"the tokenizer has no {EOT} token (the end of each document); add it as a special token"
    )
  vocab = tok.get_vocab_size(with_added_tokens=True)
  dtype = np.uint16 if vocab <= 2**16 else np.uint32
  out.mkdir(parents=True, exist_ok=True)
  count = 0
  with open(out / "tokens.bin", "wb") as f:
    for text in texts():
      ids = np.asarray([*tok.encode(text).ids, eot], dtype).astype(np.dtype(dtype).newbyteorder("<"))
      f.write(ids.tobytes())
      count += ids.size
  if tokenizer is not None and Path(tokenizer).resolve() != (out / "tokenizer.json").resolve():
    shutil.copyfile(tokenizer, out / "tokenizer.json")
  elif tokenizer is None:
    tok.save(str(out / "tokenizer.json"))
  meta = {
    "dtype": np.dtype(dtype).name,
    "vocab_size": vocab,
    "eot_token": eot,
    "tokenizer": "tokenizer.json",
    "documents": len(files),
    "tokens": count,
  }
  (out / ("tokens.bin" + token_data.SIDECAR_SUFFIX)).write_text(run_files.json_text(meta, indent=2) + "\n")
  return meta


def main(argv: list[str] | None = None, *, prog: str = "jaxpe-tokenize") -> int:
  """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
  parser = argparse.ArgumentParser(
    prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "inputs", nargs="+", help="text files or directories (read as jaxpe-train --data reads them)"
  )
  parser.add_argument(
    "--out", required=True, help="output folder (tokens.bin, tokens.bin.json, tokenizer.json)"
  )
  parser.add_argument(
    "--vocab-size", type=int, default=4096, help="BPE vocabulary to train, >= 257 (default: 4096)"
  )
  parser.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of training one")
  parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
  args = parser.parse_args(argv)

  def body() -> int:
    meta = tokenize_files(args.inputs, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer)
    bin_path = Path(args.out) / "tokens.bin"
    print(
      f"{prog}: {meta['documents']} documents, {meta['tokens']:,} tokens ({meta['dtype']}, vocabulary "
      f"{meta['vocab_size']}, end of document {meta['eot_token']}) in {bin_path}"
    )
    print(f"jaxpe-train data.tokens={bin_path} model.vocab_size={meta['vocab_size']} data.packing=first_fit")
    return 0

  return run_guard.run_cli(prog, body, debug=args.debug)


def run(prog: str = "jaxpe-tokenize") -> None:
  """The console entry point: ``main()`` on ``sys.argv``, then exit with its status."""
  run_guard.exit_process(main(prog=prog))


if __name__ == "__main__":
  run()
