"""``jaxpe-tokenize`` (issue 46): a user's text files -> a BPE tokenizer trained here, a token file
that decodes back to the files' text, and a packed run on it that ``jaxpe-sample`` decodes."""

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from jaxpe.train import evaluation, sample, tokenize, trainer
from jaxpe.train.config import load_config

pytestmark = pytest.mark.usefixtures("standard_promotion")

NAMES = ("textwrap.py", "shlex.py", "bisect.py")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
  root = tmp_path_factory.mktemp("texts")
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  for name in NAMES:
    shutil.copyfile(stdlib / name, root / name)
  (root / ".hidden").write_text("not read")
  return root


@pytest.fixture(scope="module")
def tokenized(texts, tmp_path_factory):
  out = tmp_path_factory.mktemp("tok")
  assert tokenize.main([str(texts), "--out", str(out), "--vocab-size", "400"]) == 0
  return out


def test_the_token_file_decodes_back_to_the_documents(texts, tokenized, capsys):
  meta = json.loads((tokenized / "tokens.bin.json").read_text())
  ids = np.fromfile(tokenized / "tokens.bin", "<u2")
  assert meta["dtype"] == "uint16" and meta["documents"] == 3 and meta["tokens"] == ids.size
  assert meta["vocab_size"] <= 400 and int(ids.max()) < meta["vocab_size"]
  tok = tokenize.load_tokenizer(tokenized / "tokenizer.json")
  eot = meta["eot_token"]
  assert tok.id_to_token(eot) == tokenize.EOT
  ends = np.flatnonzero(ids == eot)
  assert ends.size == 3 and ends[-1] == ids.size - 1  # each document ends with the end-of-document token
  docs = np.split(ids, ends[:-1] + 1)
  for name, doc in zip(sorted(NAMES), docs, strict=True):  # in sorted order
    assert tokenize.decode(tok, doc[:-1]) == (texts / name).read_text()
  assert ids.size < 0.6 * sum((texts / n).stat().st_size for n in NAMES)  # BPE merges: fewer ids than bytes


def test_a_given_tokenizer_encodes_alike_and_errors_are_one_line(texts, tokenized, tmp_path, capsys):
  capsys.readouterr()
  assert (
    tokenize.main(
      [
        str(texts / "shlex.py"),
        "--out",
        str(tmp_path / "again"),
        "--tokenizer",
        str(tokenized / "tokenizer.json"),
      ]
    )
    == 0
  )
  printed = capsys.readouterr().out.splitlines()
  assert printed[-1].startswith(
    f"jaxpe-train data.tokens={tmp_path / 'again' / 'tokens.bin'} model.vocab_size="
  )
  tok = tokenize.load_tokenizer(tokenized / "tokenizer.json")
  want = [*tok.encode((texts / "shlex.py").read_text()).ids, tok.token_to_id(tokenize.EOT)]
  np.testing.assert_array_equal(np.fromfile(tmp_path / "again" / "tokens.bin", "<u2"), want)
  assert tokenize.main([str(texts), "--out", str(tmp_path / "x"), "--vocab-size", "100"]) == 2
  assert (
    capsys.readouterr().err.strip()
    == "jaxpe-tokenize: error: --vocab-size must be >= 257 (256 bytes and <|endoftext|>), got 100"
  )


def test_a_packed_run_on_the_token_file_samples_with_its_tokenizer(tokenized, tmp_path):
  meta = json.loads((tokenized / "tokens.bin.json").read_text())
  cfg = load_config(
    None,
    [
      f"workdir={tmp_path / 'run'}",
      f"data.tokens={tokenized / 'tokens.bin'}",
      f"model.vocab_size={meta['vocab_size']}",
      "data.packing=first_fit",
      "seq_len=32",
      "batch_size=8",
      "num_steps=3",
      "eval_every=3",
      "eval_batches=1",
      "sample_len=6",
      "model.d_model=32",
      "model.num_layers=1",
      "model.num_heads=4",
      "model.max_len=32",
    ],
  )
  result = trainer.train(cfg, progress=False)
  assert result.sample.startswith(cfg.sample_prompt) and len(result.sample) > len(cfg.sample_prompt)
  # Bits per token, and per byte of the held-out text the scored tokens stand for (issue 46).
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
  assert summary["unit"] == "token" and 1 < summary["bytes_per_token"] < 20
  assert summary["eval_bits_per_byte"] == pytest.approx(
    summary["eval_bits_per_token"] / summary["bytes_per_token"]
  )
  assert record["eval_bits_per_byte"] == pytest.approx(summary["eval_bits_per_byte"])
  assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (tokenized / "tokenizer.json").read_bytes()
  text, stats = sample.sample(tmp_path / "run", "import ", max_new_tokens=5, temperature=0.0)
  assert text.startswith("import ") and stats["tokens"] == 5


def test_bytes_per_token_count_the_text_each_scored_token_stands_for(texts, tokenized):
  tok = tokenize.load_tokenizer(tokenized / "tokenizer.json")
  table = tokenize.token_bytes(tok)
  ids = np.fromfile(tokenized / "tokens.bin", "<u2")
  docs = np.split(ids, np.flatnonzero(ids == tok.token_to_id(tokenize.EOT))[:-1] + 1)
  for name, doc in zip(sorted(NAMES), docs, strict=True):  # the files' UTF-8 bytes; the end token: none
    assert int(table[doc].sum()) == (texts / name).stat().st_size
  rng = np.random.default_rng(0)
  windows = rng.choice(ids, (2, 9))
  packed = np.stack([rng.choice(ids, (2, 9)), rng.integers(0, 2, (2, 9)), np.ones((2, 9), int)], 1)
  scored = [*windows[:, 1:].ravel(), *packed[:, 0, 1:][packed[:, 1, 1:] != 0]]
  want = sum(len(tok.decode([int(i)], skip_special_tokens=True).encode()) for i in scored) / len(scored)
  corpus = type("C", (), {"unit": "tokens", "tokenizer": tokenized / "tokenizer.json"})
  assert evaluation.held_out_bytes_per_token(corpus, [windows, packed]) == pytest.approx(want)
  assert np.isnan(evaluation.held_out_bytes_per_token(None, [windows]))  # a task: no bytes
