"""The schedule fitted to max_seconds (closed form, and a fitted run equals the run configured with
the fitted length) and progress output as lines in a log."""

import io
import json
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpe.train import checkpoint, loop, pacing, sharding, trainer
from jaxpe.train.config import load_config

COSTS = pacing.StepCosts(step=0.5, compile=4.0, eval=2.0, save=1.0)


def test_fit_num_steps_solves_the_budget():
  kw = dict(step=6, num_steps=550, warmup_steps=60, costs=COSTS, eval_every=200, checkpoint_every=100)
  # per step 0.5 + 2/200 + 1/100 = 0.52 s; usable 0.9 * 200 - 3 - 4 - 2 - 1 = 170 s -> 326 more steps.
  assert pacing.fit_num_steps(seconds_left=200.0, fixed_seconds=3.0, **kw) == 6 + 326
  assert pacing.fit_num_steps(seconds_left=1e6, **kw) == 550  # never longer than configured
  assert pacing.fit_num_steps(seconds_left=-5.0, **kw) == 61  # at least the warmup and one decay step
  assert pacing.fit_num_steps(seconds_left=-5.0, **{**kw, "step": 100}) == 101
  with pytest.raises(ValueError, match="margin"):
    pacing.fit_num_steps(seconds_left=1.0, margin=1.0, **kw)
  with pytest.raises(ValueError, match="eval_every"):
    pacing.fit_num_steps(seconds_left=1.0, **{**kw, "eval_every": 0})


def test_progress_in_a_log_is_lines_not_redraws():
  out = io.StringIO()
  with pacing.Progress(10, interactive=False, every_seconds=1e9, stream=out) as bar:
    for step in range(1, 11):
      bar.update(step, loss="1.000")
      if step == 4:
        bar.write("step 4: held-out 2.0 bits/byte")
        bar.set_total(10)
  assert "\r" not in out.getvalue()
  assert out.getvalue().splitlines() == [
    "step 1/10 loss 1.000",
    "step 4: held-out 2.0 bits/byte",
    "step 10/10 loss 1.000",
  ]
  out = io.StringIO()
  with pacing.Progress(3, interactive=False, every_seconds=0.0, stream=out) as bar:
    for step in (1, 2, 3):
      bar.update(step)
  assert out.getvalue().splitlines() == ["step 1/3", "step 2/3", "step 3/3"]


pytestmark = pytest.mark.usefixtures("standard_promotion")


def _cfg(workdir, text_file, *extra):
  return load_config(
    None,
    [
      f"workdir={workdir}",
      f"data.path={text_file}",
      "seq_len=32",
      "batch_size=8",
      "warmup_steps=8",
      "eval_every=100",
      "eval_batches=1",
      "checkpoint_every=100",
      "sample_len=0",
      "model.d_model=32",
      "model.num_layers=1",
      "model.num_heads=4",
      "model.max_len=32",
      *extra,
    ],
  )


def _saved(cfg):
  _, state, shardings = trainer.create_state(cfg, sharding.make_mesh((-1, 1)))
  with checkpoint.manager(Path(cfg.workdir) / "checkpoints") as mngr:
    return checkpoint.restore_latest(mngr, checkpoint.abstract_with_shardings(state, shardings))


def test_a_fitted_schedule_ends_complete_and_equals_the_configured_run(tmp_path, monkeypatch, capsys):
  root = Path(sysconfig.get_paths()["stdlib"])
  text_file = tmp_path / "corpus.txt"
  text_file.write_bytes((root / "textwrap.py").read_bytes())
  calls = []

  def fit(cfg, step, schedule_steps, start, step_s, first_dt):
    calls.append((step, schedule_steps))
    return 9  # what a slow machine would leave room for

  monkeypatch.setattr(loop, "fit_schedule", fit)
  budget = _cfg(tmp_path / "budget", text_file, "num_steps=14", "max_seconds=3600")
  result = trainer.train(budget, progress=False)
  assert calls == [(loop.FIT_AFTER_STEPS + 1, 14)]  # once, after the timed steps, within the warmup
  assert "now ends at step 9" in capsys.readouterr().out
  assert (result.step, result.num_steps) == (9, 9)
  records = [json.loads(line) for line in (tmp_path / "budget" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 10)) and records[5]["schedule_steps"] == 9
  state, meta = _saved(budget)
  assert (meta["step"], meta["schedule_steps"], meta["schedule_fitted"]) == (9, 9, True)

  configured = _cfg(tmp_path / "configured", text_file, "num_steps=9")  # no budget, no fit
  trainer.train(configured, progress=False)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), state, _saved(configured)[0]
  )

  calls.clear()
  again = trainer.train(budget, progress=False)  # resume: the fitted schedule is complete
  assert (again.step, again.num_steps, calls) == (9, 9, [])
