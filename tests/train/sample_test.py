"""``jaxpe-sample WORKDIR`` (issue 37, item 10): text from a trained run's latest checkpoint, greedy
or sampled, with tokens/s. The greedy bytes are checked against a decoding loop written here without
the KV cache (the full prefix through the model at each step)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.train import load, sample, trainer
from jaxpe.train.config import load_config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, text_file):
  run = tmp_path_factory.mktemp("sample") / "run"
  overrides = [f"workdir={run}", f"data.path={text_file}", "seq_len=32", "batch_size=8", "num_steps=4"]
  overrides += ["warmup_steps=1", "eval_batches=1", "sample_len=0", "model.d_model=32", "model.num_layers=1"]
  overrides += ["model.num_heads=4", "model.max_len=32", "learning_rate=1e-2"]
  with jax.numpy_dtype_promotion("standard"):
    trainer.train(load_config(None, overrides), progress=False)
  return run


def _greedy_without_cache(workdir, prompt: bytes, n: int) -> bytes:
  """Greedy bytes from the full prefix at every step (no KV cache): the prefix right-padded to one
  length, so one compiled forward serves every step (the model is causal: padding after position t
  does not change its logits)."""
  from flax import nnx

  model = load.load_trained(sample._run_config(workdir))
  forward = nnx.jit(lambda m, x: m(x))
  tokens = list(prompt)
  for _ in range(n):
    padded = jnp.asarray([tokens + [0] * (len(prompt) + n - len(tokens))], jnp.int32)
    logits = np.asarray(forward(model, padded)[0, len(tokens) - 1], np.float64)
    tokens.append(int(np.argmax(logits)))
  return bytes(tokens[len(prompt) :])


def test_greedy_sample_matches_a_decoding_loop_without_cache(workdir, capsysbinary):
  assert sample.main([str(workdir), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "12"]) == 0
  captured = capsysbinary.readouterr()
  expected = b"def " + _greedy_without_cache(workdir, b"def ", 12)
  assert captured.out == expected + b"\n"  # the model's bytes as they are (issue 48 kind 7)
  line = captured.err.decode().strip()
  assert (
    line.startswith("jaxpe-sample: checkpoint step 4: 12 tokens in ") and " tokens/s (compilation" in line
  ), line
  # top-k 1 sampling is greedy whatever the temperature; a prompt file gives the same bytes.
  (workdir.parent / "prompt.txt").write_text("def ")
  argv = [
    str(workdir),
    "--prompt-file",
    str(workdir.parent / "prompt.txt"),
    "--top-k",
    "1",
    "--max-new-tokens",
    "12",
  ]
  assert sample.main(argv) == 0
  assert capsysbinary.readouterr().out == expected + b"\n"
  # --text: the same bytes decoded as UTF-8 with replacement characters.
  assert sample.main([*argv, "--text"]) == 0
  assert capsysbinary.readouterr().out == (expected.decode(errors="replace") + "\n").encode()


def test_prompt_bytes_that_are_not_utf8_reach_the_model_as_they_are(workdir, capsysbinary):
  """Issue 48 kind 7: a byte-level model's prompt file is bytes, not UTF-8 text (main replaced each
  invalid byte by U+FFFD's three bytes before the model saw it). Members: --prompt-file, --prompt (the
  argument's own bytes), sample_bytes(bytes), and the output (the model's bytes on stdout)."""
  prompt = b"\xff\xfe\x80def \xc3("
  (workdir.parent / "bytes.bin").write_bytes(prompt)
  expected = prompt + _greedy_without_cache(workdir, prompt, 8)
  argv = [str(workdir), "--prompt-file", str(workdir.parent / "bytes.bin"), "--temperature", "0"]
  assert sample.main([*argv, "--max-new-tokens", "8"]) == 0
  assert capsysbinary.readouterr().out == expected + b"\n"
  # A command-line argument with undecodable bytes reaches Python surrogate-escaped: its bytes are the prompt.
  argv = [str(workdir), "--prompt", os.fsdecode(prompt), "--temperature", "0", "--max-new-tokens", "8"]
  assert sample.main(argv) == 0
  assert capsysbinary.readouterr().out == expected + b"\n"
  got, stats = sample.sample_bytes(workdir, prompt, max_new_tokens=8, temperature=0.0)
  assert got == expected and stats["tokens"] == 8
  with pytest.raises(TypeError, match="prompt must be str or bytes, got list"):
    sample.sample_bytes(workdir, [1, 2], max_new_tokens=8)


def test_streaming_sample_matches_a_fresh_forward_over_sinks_and_window(workdir, capsys):
  """``--streaming 2,5`` (issue 47): greedy bytes of a fresh forward over [the first 2 bytes, the
  last 5] at positions 0..6 at every step (exact on this one-layer model), past max_len = 32."""
  from flax import nnx

  argv = [str(workdir), "--prompt", "def f(x", "--temperature", "0", "--max-new-tokens", "40"]
  assert sample.main([*argv, "--streaming", "2,5"]) == 0
  model = load.load_trained(sample._run_config(workdir))
  forward = nnx.jit(lambda m, x: m(x)[0, -1])
  tokens = list(b"def f(x")
  for _ in range(40):
    window = tokens[:2] + tokens[-5:]
    tokens.append(int(np.argmax(np.asarray(forward(model, jnp.asarray([window], jnp.int32))))))
  assert capsys.readouterr().out == bytes(tokens).decode(errors="replace") + "\n"


def test_sampling_is_seeded(workdir):
  text, stats = sample.sample(workdir, "x", max_new_tokens=100, temperature=1.0, top_k=None, seed=5)
  again, _ = sample.sample(workdir, "x", max_new_tokens=100, temperature=1.0, top_k=None, seed=5)
  assert text == again and stats["tokens"] == 100 and stats["tokens_per_second"] > 0


@pytest.mark.parametrize(
  "argv, words",
  [
    (["{missing}"], "WORKDIR '{missing}' does not exist"),
    (["{workdir}", "--prompt", ""], "the prompt is empty"),
    (["{workdir}", "--temperature", "-1"], "temperature"),
    (["{workdir}", "--max-new-tokens", "0"], "max_new_tokens"),
    (["{workdir}", "--streaming=-1,4"], "streaming start_size (sink tokens) must be >= 0, got -1"),
    (["{workdir}", "--top-k", "-1"], "--top-k must be >= 0 (0 = all bytes), got -1"),
  ],
)
def test_errors_are_one_line(workdir, capsys, argv, words):
  fill = {"workdir": str(workdir), "missing": str(workdir.parent / "nothing")}
  assert sample.main([a.format(**fill) for a in argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("jaxpe-sample: error: ") and words.format(**fill) in err and "\n" not in err, err


def test_a_task_run_is_refused_naming_the_task(tmp_path, capsys):
  """A run on a synthetic task (``data.task``, vocabulary of its symbols) holds no text model: one line
  naming the task (before: ``top_k must be in [1, vocab_size=18], got 40`` for the default
  ``--top-k`` the user never gave, or the prompt's bytes out of the vocabulary)."""
  from jaxpe.train.config import TrainConfig

  cfg = TrainConfig(
    workdir=str(tmp_path),
    seq_len=32,
    sample_len=0,
    data=dict(task=dict(name="copy", num_symbols=16)),
    model=dict(vocab_size=18, d_model=16, num_heads=2, num_layers=1, max_len=32),
  )
  (tmp_path / "config.json").write_text(cfg.model_dump_json())
  assert sample.main([str(tmp_path), "--prompt", "import os"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("jaxpe-sample: error: ") and "synthetic task 'copy' (data.task, 18 symbols)" in err, (
    err
  )
