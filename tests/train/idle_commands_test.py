"""Issue 48: a command that does nothing writes nothing. The kind's members: ``jaxpe-train`` rerun on a
finished run (with the same or with other settings), ``jaxpe-sample`` (reads only) and ``jaxpe-study``
rerun on a finished study (``tests/study/study_test.py``). A finished run rerun with other settings
says which differ and leaves ``config.json`` describing its checkpoints, so ``jaxpe-sample`` still
reads them (main rewrote config.json with ``model.scan_layers=true`` and ``jaxpe-sample`` then called
the intact checkpoints damaged: exit 2). The greedy bytes are checked against a decoding loop without
the KV cache under the run's own layout."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.build import build_model
from jaxpe.train import load, sample, trainer
from jaxpe.train.config import load_config

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _overrides(run: Path, text_file: str) -> list[str]:
  return [
    f"workdir={run}",
    f"data.path={text_file}",
    "seq_len=32",
    "batch_size=8",
    "num_steps=2",
    "warmup_steps=1",
    "eval_batches=1",
    "sample_len=0",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_len=32",
  ]


def _snapshot(run: Path) -> dict[str, tuple[int, bytes]]:
  """Every file of the run but its lock (the guard a command holds while it looks): mtime and bytes."""
  return {
    str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes())
    for p in sorted(run.rglob("*"))
    if p.is_file() and p.name != "lock"
  }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, text_file) -> Path:
  run = tmp_path_factory.mktemp("idle") / "run"
  with jax.numpy_dtype_promotion("standard"):
    trainer.train(load_config(None, _overrides(run, text_file)), progress=False)
  return run


def _greedy_reference(run: Path, prompt: bytes, n: int) -> bytes:
  """Greedy bytes without the KV cache from the run's parameters, built in the run's own layout
  (loop layers: the layout the checkpoint holds) from the checkpoint's own config."""
  cfg = sample._run_config(run)
  model = build_model(cfg.model, load.trained_params(cfg))
  forward = nnx.jit(lambda m, x: m(x))
  tokens = list(prompt)
  for _ in range(n):
    padded = jnp.asarray([tokens + [0] * (len(prompt) + n - len(tokens))], jnp.int32)
    tokens.append(int(np.argmax(np.asarray(forward(model, padded)[0, len(tokens) - 1], np.float64))))
  return bytes(tokens)


def test_a_finished_run_rerun_with_other_settings_writes_nothing_and_says_what_differs(
  finished_run, text_file, capsysbinary
):
  run = finished_run
  before = _snapshot(run)
  reference = _greedy_reference(run, b"def ", 6)

  # The same settings: nothing to train, nothing written.
  capsysbinary.readouterr()
  trainer.train(load_config(None, _overrides(run, text_file)), progress=True)
  out = capsysbinary.readouterr().out.decode()
  assert "nothing to train" in out and "its files are left as they are" in out and "differ" not in out, out
  assert _snapshot(run) == before

  # Other settings (jaxpe-train --help's fourth example's keys): named, not applied, nothing written.
  other = _overrides(run, text_file) + ["model.scan_layers=true", "learning_rate=0.5", "eval_every=7"]
  trainer.train(load_config(None, other), progress=True)
  out = capsysbinary.readouterr().out.decode()
  assert "nothing to train" in out, out
  assert (
    "these settings differ from the run's (its checkpoint of step 2) and were not applied (config.json keeps "
    "the run's): eval_every: 500 -> 7, learning_rate: 0.003 -> 0.5, model.scan_layers: False -> True"
  ) in out, out
  assert _snapshot(run) == before
  assert json.loads((run / "config.json").read_text())["model"]["scan_layers"] is False

  # jaxpe-sample reads the intact checkpoint (main: exit 2, "no intact checkpoint") and writes nothing.
  capsysbinary.readouterr()
  argv = [str(run), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "6"]
  assert sample.main(argv) == 0
  assert capsysbinary.readouterr().out == reference + b"\n"
  assert _snapshot(run) == before


def test_a_checkpoint_is_read_in_the_layout_it_was_written_in(finished_run):
  """The loader takes the layer layout from the checkpoint's metadata, not from config.json: a
  config.json of the other scan_layers (a resume that changed it, then crashed before its first
  checkpoint; or an edit) still loads, converted into config.json's layout, with the same weights."""
  cfg = sample._run_config(finished_run)
  loop = load.trained_params(cfg)
  scanned_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"scan_layers": True})})
  scanned = load.trained_params(scanned_cfg)  # main: CheckpointError (tree structures do not match)
  # The scanned layout stacks the loop layout's per-layer arrays: blocks.<i>.<rest> -> blocks.<rest>[i].
  assert scanned.keys() == {k.replace("blocks.0.", "blocks.") for k in loop if not k.startswith("blocks.1.")}
  for key, value in scanned.items():
    if key.startswith("blocks."):
      rest = key.removeprefix("blocks.")
      np.testing.assert_array_equal(value, np.stack([loop[f"blocks.{i}.{rest}"] for i in range(2)]))
    else:
      np.testing.assert_array_equal(value, loop[key])
