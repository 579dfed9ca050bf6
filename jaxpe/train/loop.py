"""The training loop, once the workdir is locked and the checkpoint manager open: set up (held-out
data, mesh, state restored or created, steps), then per step: the batch, the update, the schedule
fitted to ``max_seconds`` (once), non-finite steps, evaluation, the logs and checkpoints; then the
end of the run (a signal's checkpoint, or the sample, the plot and ``summary.json``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpe.train import (
  checkpoint,
  data,
  evaluation,
  flops,
  input_pipeline,
  pacing,
  packing,
  run_checks,
  run_files,
  run_guard,
  run_log,
  sharding,
  steps,
)
from jaxpe.train import state as state_lib
from jaxpe.train.config import TrainConfig
from jaxpe.train.optimizer import learning_rate_schedule
from jaxpe.train.run_log import TrainResult
from jaxpe.train.steps import next_token_loss_sum

__all__ = ["FIT_AFTER_STEPS", "agree_on_stop", "fit_schedule", "run_training"]


FIT_AFTER_STEPS = 5
"""Timed steps (after each process's compiling first step) before the schedule is fitted to
``max_seconds``; within the default warmup, where the schedule does not depend on its length."""


def fit_schedule(
  cfg: TrainConfig, step: int, schedule_steps: int, start: float, step_s: float, first_dt: float
) -> int:
  """The schedule length that ends within ``cfg.max_seconds`` of ``start`` (``pacing.fit_num_steps``
  with this run's measured step time and estimates of evaluation, checkpoint, compile and sample)."""
  compile_s = max(first_dt - step_s, 0.0)
  costs = pacing.StepCosts(step=step_s, compile=compile_s, eval=cfg.eval_batches * step_s / 3, save=1.0)
  return pacing.fit_num_steps(
    step=step,
    num_steps=schedule_steps,
    warmup_steps=cfg.warmup_steps,
    seconds_left=cfg.max_seconds - (time.time() - start),
    costs=costs,
    eval_every=cfg.eval_every,
    checkpoint_every=cfg.checkpoint_every,
    fixed_seconds=1.5 * compile_s if cfg.sample_len else 0.5 * compile_s,  # eval compile, sample
  )


def agree_on_stop(stop: run_guard.StopRequest) -> bool:
  """True when any process received SIGTERM/SIGINT, so that all processes of a multi-process run
  stop after the same step. The decision rests only on the gathered values (all processes decide
  alike); a signal that arrives during the gather is seen at the next call. A process keeps its
  own signal (its exit status); one that received none takes the first other process's
  (``stop.from_process`` names it)."""
  if jax.process_count() == 1:
    return stop.signum is not None
  signums = np.asarray(multihost_utils.process_allgather(np.int32(stop.signum or 0))).ravel()
  senders = np.flatnonzero(signums)
  if senders.size == 0:
    return False
  if stop.signum is None:  # never overwrite this process's own signal
    stop.signum, stop.from_process = int(signums[senders[0]]), int(senders[0])
  return True


class _Training:
  """One run's loop; each method is one named step of it (``run_training`` calls them in order)."""

  def __init__(self, cfg, workdir, mngr, stop, saved_config, corpus, fingerprint, *, progress, start):
    self.cfg, self.workdir, self.mngr, self.stop, self.start = cfg, workdir, mngr, stop, start
    self.corpus, self.fingerprint, self.saved_config = corpus, fingerprint, saved_config
    self.primary = jax.process_index() == 0  # writes config.json, metrics, plot, summary; prints
    self.progress = progress and self.primary
    self.timing = pacing.StepTiming()
    self.unit = run_log.score_unit(cfg)  # what the bits are per: byte, token (data.tokens), answer (task)
    self.loss, self.eval_bpb = float("nan"), float("nan")
    self.peak: float | None = None  # the devices' peak FLOP/s for MFU (None: not known)

  def set_up(self) -> None:
    """Held-out data, mesh and shardings, the state (restored or created), the run files, steps."""
    cfg = self.cfg
    self.eval_set, self.unigram = evaluation.held_out(cfg, self.corpus)
    # a token-file run with a byte-level tokenizer: its held-out bits per byte too (else NaN)
    self.bytes_per_token = evaluation.held_out_bytes_per_token(self.corpus, self.eval_set)
    if cfg.data.packing is not None:  # packed once (first_fit), then rows by (seed, step)
      self.packed_batch = packing.make_train_batch(self.corpus, cfg.data.packing, cfg.seq_len)
    self.pipeline = None  # data.loader=grain: made once the step is known (set_up, after the restore)
    self.mesh = sharding.make_mesh(cfg.mesh_shape)
    micro_batch = cfg.batch_size // cfg.grad_accum_steps
    sharding.check_divisible(cfg.model, self.mesh, micro_batch, seq_len=cfg.seq_len, rules=cfg.logical_rules)
    self.batch_sharding = sharding.batch_sharding(self.mesh, cfg.logical_rules)
    self.run, self.state_shardings, meta = state_lib.restore_or_create(
      cfg, self.mngr, self.mesh, saved_config=self.saved_config, fingerprint=self.fingerprint
    )
    self.target = (
      self.run.schedule_steps if cfg.stop_at is None else min(self.run.schedule_steps, cfg.stop_at)
    )
    self.finished = meta is not None and self.run.step >= self.target  # a rerun of a finished run
    if meta is not None and self.primary and not self.finished:
      print(
        f"resumed from {self.workdir / 'checkpoints'} at step {self.run.step} "
        f"(schedule of {self.run.schedule_steps} steps)"
      )
    if cfg.data.loader == "grain":  # from the iterator state saved with the checkpoint restored (if any)
      self.pipeline = input_pipeline.for_run(cfg, self._batch_maker()[0], self.batch_sharding, self.run.step)
    if jax.process_count() > 1:  # every process has read the saved config before process 0 rewrites it
      multihost_utils.sync_global_devices("jaxpe: restored")
    self.meta = meta
    # config.json: a fresh run's now, a resumed run's with its first checkpoint (``save``); none if finished
    self.config_pending = self.primary and meta is not None and not self.finished
    if self.primary and meta is None:
      run_files.write_atomic(self.workdir / "config.json", cfg.model_dump_json(indent=2))
    if self.primary:  # a finished run's metrics are only read
      path, step = self.workdir / "metrics.jsonl", self.run.step
      previous = run_files.read_metrics(path) if self.finished else run_files.truncate_metrics(path, step)
      self.loss = next((r["loss"] for r in reversed(previous) if r["step"] <= self.run.step), self.loss)
    if self.primary and not self.finished and self.corpus is not None and self.corpus.tokenizer is not None:
      run_files.write_atomic(
        self.workdir / "tokenizer.json", self.corpus.tokenizer.read_text()
      )  # for jaxpe-sample
    self.info = run_log.run_info(
      self.mesh, state_lib.num_params(self.run.state), self.fingerprint, self.corpus
    )
    if cfg.data.packing is not None:  # the padding share of first_fit's rows (concat_then_split: none)
      self.info["packing"] = packing.report(cfg.data.packing, self.packed_batch, progress=self.progress)
    if self.run.init_from is not None:  # where the parameters started (summary.json's run.init_from)
      self.info["init_from"] = self.run.init_from
      if self.progress and meta is None:
        print(
          f"parameters from {self.run.init_from['path']} (its checkpoint of step {self.run.init_from['step']})"
        )
    # MFU: the model FLOPs of a token against the devices' peak (on CPU: a measured matmul ceiling).
    self.flops_per_token = flops.train_flops_per_token(cfg.model, cfg.seq_len)
    if not self.finished:  # each process measures its own devices (a CPU ceiling) and counts all
      rows = micro_batch * cfg.seq_len // self.mesh.size or 1
      local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
      self.peak, source = flops.peak_flops(local, cfg.model, rows, processes=jax.process_count())
      self.info["mfu_peak"] = {"flops_per_second": self.peak, "source": source}
    self.placement = dict(
      mesh=self.mesh,
      rules=cfg.logical_rules,
      state_shardings=self.state_shardings,
      batch_sharding=self.batch_sharding,
    )
    self.eval_step = steps.make_eval_step(self.run.graphdef, loss_fn=next_token_loss_sum, **self.placement)
    self._make_train_step()

  def _make_train_step(self) -> None:
    """The jitted train step, the learning-rate schedule and the target step of ``run.graphdef``
    (again after a fit: the optimizer is in ``graphdef``). A non-finite step is not applied: the
    state stays the last finite one (never saved otherwise)."""
    cfg, run = self.cfg, self.run
    self.train_step = steps.make_train_step(
      run.graphdef, grad_accum_steps=cfg.grad_accum_steps, loss_fn=next_token_loss_sum, **self.placement
    )
    self.lr = learning_rate_schedule(
      cfg.learning_rate,
      num_steps=run.schedule_steps,
      warmup_steps=cfg.warmup_steps,
      min_lr_ratio=cfg.min_lr_ratio,
    )
    self.target = run.schedule_steps if cfg.stop_at is None else min(run.schedule_steps, cfg.stop_at)

  def evaluate(self) -> float:
    """Held-out bits per byte of the current state."""
    return evaluation.evaluate(self.eval_step, self.run.state, self.eval_set, self.batch_sharding)

  def save(self) -> None:
    """Checkpoints the current step with what a resume needs (position, schedule, config, data)."""
    run = self.run
    meta = {
      "step": run.step,
      "data_position": run.step,
      "skipped_steps": run.skipped,
      "config": self.cfg.model_dump(mode="json"),
      "schedule_steps": run.schedule_steps,
      "schedule_fitted": run.fitted,
      "data_fingerprint": self.fingerprint,
      **({"init_from": run.init_from} if run.init_from is not None else {}),
    }
    if self.pipeline is not None:  # grain's iterator state, keyed by the step, before the checkpoint
      self.pipeline.save(self.workdir, run.step, kept=self.mngr.all_steps())
    checkpoint.save(self.mngr, run.step, run.state, meta)
    if self.config_pending:  # a resumed run's first checkpoint: config.json describes it from now on
      run_files.write_atomic(self.workdir / "config.json", self.cfg.model_dump_json(indent=2))
      self.config_pending = False

  def loop(self, log: run_log.RunLog) -> str:
    """Steps until the target (``num_steps``, the fitted schedule or ``stop_at``), a signal or
    ``max_seconds``; returns the reason (``run_log.STOP_REASONS``)."""
    while self.run.step < self.target:
      if agree_on_stop(self.stop):
        return "signal"
      record, finite = self.train_one_step()
      self.fit_schedule_once(record, log)
      if not finite:
        self.count_nonfinite(record, log)
      out_of_time = self.out_of_time()
      last = self.run.step == self.target or out_of_time
      if self.run.step % self.cfg.eval_every == 0 or last:
        self.eval_bpb = self.evaluate()
        held_out, line = run_log.held_out_report(
          self.run.step, self.eval_bpb, self.unit, self.unigram, self.bytes_per_token
        )
        record.update(held_out)
        log.write(line)
      log.step(record)
      if self.run.step % self.cfg.checkpoint_every == 0 or last:
        log.sync()  # what the checkpoint covers is on disk before it (metrics, TensorBoard)
        self.save()
      if out_of_time and self.run.step < self.target:
        return "max_seconds"
    return "schedule_done" if self.run.step >= self.run.schedule_steps else "stop_at"

  def _batch_maker(self) -> tuple[Any, tuple[int, ...]]:
    return input_pipeline.batch_maker(self.cfg, self.corpus, getattr(self, "packed_batch", None))

  def train_one_step(self) -> tuple[dict[str, Any], bool]:
    """One update on the step's batch (each process builds only its rows of the global batch);
    returns its record and whether it was finite (else it was not applied)."""
    cfg, run = self.cfg, self.run
    t_data = time.time()  # the wait for the batch (data_seconds): made here, or grain's prefetched
    make, shape = self._batch_maker()
    if self.pipeline is not None:  # grain: this process's rows, prefetched
      local = self.pipeline.next(run.step)
      batch = sharding.global_batch(lambda rows: local, self.batch_sharding, shape)
    else:
      batch = sharding.global_batch(
        lambda rows, step=run.step: make(step=step, rows=rows), self.batch_sharding, shape
      )
    data_dt = time.time() - t_data
    learning_rate = float(self.lr(run.updates))  # the rate this update uses
    t0 = time.time()
    run.state, out = self.train_step(run.state, batch)
    self.loss = float(out["loss"])  # waits for the step
    dt = time.time() - t0
    run.step += 1
    self.timing.add(dt, cfg.batch_size * cfg.seq_len)
    record = {
      "step": run.step,
      "loss": self.loss,
      "grad_norm": float(out["grad_norm"]),
      "tokens_per_second": self.timing.tokens_per_second,
      "model_flops_per_second": self.timing.tokens_per_second * self.flops_per_token,
      f"train_bits_per_{self.unit}": data.bits_per_byte(self.loss),
      "learning_rate": learning_rate,
      "step_seconds": dt,
      "data_seconds": data_dt,
    }
    if self.peak:
      record["mfu"] = record["model_flops_per_second"] / self.peak
    if not bool(out["finite"]):
      record["param_norm"] = float(out["param_norm"])
    return record, bool(out["finite"])

  def fit_schedule_once(self, record: dict[str, Any], log: run_log.RunLog) -> None:
    """After ``FIT_AFTER_STEPS`` timed steps, shortens the schedule to what fits in ``max_seconds``
    (once per run; all processes run process 0's schedule)."""
    cfg, run, timing = self.cfg, self.run, self.timing
    if run.fitted or cfg.max_seconds is None or timing.steps != FIT_AFTER_STEPS + 1:
      return
    run.fitted, step_s = True, timing.seconds / FIT_AFTER_STEPS
    new_steps = fit_schedule(cfg, run.step, run.schedule_steps, self.start, step_s, timing.first_dt)
    if jax.process_count() > 1:  # the processes' timings differ: all run process 0's schedule
      new_steps = int(multihost_utils.broadcast_one_to_all(np.int32(new_steps)))
    if new_steps < run.schedule_steps:
      log.write(
        f"step {run.step}: {step_s:.2f} s/step leaves room for {new_steps} of the {run.schedule_steps} steps in "
        f"max_seconds={cfg.max_seconds:g}: the schedule (warmup {cfg.warmup_steps}, cosine decay) now "
        f"ends at step {new_steps}"
        + ("" if run.step <= cfg.warmup_steps else " (fitted after the warmup: the decay so far differs)")
      )
      run.schedule_steps = new_steps
      run.graphdef = state_lib.with_schedule(run.graphdef, run.state, cfg, run.schedule_steps)
      self._make_train_step()
      timing.compiled = False
      log.bar.set_total(run.schedule_steps)
    record["schedule_steps"] = run.schedule_steps

  def count_nonfinite(self, record: dict[str, Any], log: run_log.RunLog) -> None:
    """A non-finite step (not applied) counts against ``skip_nonfinite``.

    Raises:
      run_guard.NonFiniteError: more than ``skip_nonfinite`` of them; the record is logged first.
    """
    run = self.run
    run.skipped += 1
    record["skipped"] = True
    if run.skipped > self.cfg.skip_nonfinite:
      log.append(record)
      raise run_guard.NonFiniteError(run_checks.nonfinite_message(record, run.skipped, self.cfg, self.mngr))
    log.write(
      f"step {run.step}: non-finite step, update skipped ({run.skipped} of {self.cfg.skip_nonfinite})"
    )

  def out_of_time(self) -> bool:
    """Whether ``max_seconds`` has passed (any process's clock: all stop at the same step)."""
    out_of_time = self.cfg.max_seconds is not None and time.time() - self.start > self.cfg.max_seconds
    if self.cfg.max_seconds is not None and jax.process_count() > 1:
      out_of_time = bool(np.any(multihost_utils.process_allgather(np.bool_(out_of_time))))
    return out_of_time

  def result(self, reason: str, *, eval_bpb: float, sample: str = "") -> TrainResult:
    """The run's ``TrainResult`` (tokens/s: this process's, else the last figure in the metrics)."""
    tokens_per_second = self.timing.tokens_per_second
    if not tokens_per_second and self.primary:  # no step timed here (none, or only the compiling one)
      records = reversed(run_files.read_metrics(self.workdir / "metrics.jsonl"))
      tokens_per_second = next((r["tokens_per_second"] for r in records if r.get("tokens_per_second")), 0.0)
    run = self.run
    return TrainResult(
      step=run.step,
      train_loss=self.loss,
      train_bits_per_byte=data.bits_per_byte(self.loss),
      eval_bits_per_byte=eval_bpb,
      unigram_bits_per_byte=self.unigram,
      tokens_per_second=tokens_per_second,
      wall_seconds=time.time() - self.start,
      sample=sample,
      num_steps=run.schedule_steps,
      completed=run.step >= run.schedule_steps,
      stop_reason=reason,
      run=self.info,
      unit=self.unit,
      bytes_per_token=self.bytes_per_token,
    )

  def already_finished(self) -> TrainResult:
    """A rerun of a run that had reached its target (the schedule's end, or ``stop_at``): nothing is
    trained, and ``summary.json`` (written when it finished) is kept and returned; only a missing or
    damaged summary, or one of another step, is written again (with the sample and an evaluation)."""
    run, cfg = self.run, self.cfg
    if run.step >= run.schedule_steps:
      what = f"finished: its schedule of {run.schedule_steps} steps is complete"
      hint = "to train more, start a new workdir"
    else:
      what = f"at stop_at={cfg.stop_at} (step {run.step} of {run.schedule_steps})"
      hint = "raise or drop stop_at to continue"
    saved = run_log.read_summary(self.workdir)
    kept = saved is not None and saved.step == run.step
    if self.primary:
      files = "its files are left as they are" if kept else "its missing summary.json and plot are written"
      print(f"the run in {self.workdir} is {what}; nothing to train ({hint}); {files}")
      print(run_checks.unapplied_settings(self.meta.get("config"), cfg, run.step), end="")
    if kept:
      return saved
    return self.finish("schedule_done" if run.step >= run.schedule_steps else "stop_at")

  def interrupted(self) -> None:
    """After a signal (all processes at the same step): the current step is saved and
    ``summary.json`` says so.

    Raises:
      run_guard.TrainingInterrupted: always, once the checkpoint is on disk.
    """
    if self.mngr.latest_step() != self.run.step:
      self.save()
    checkpoint.finish(self.mngr)  # the asynchronous save is on disk before the process exits
    if self.primary:
      run_log.write_summary(self.workdir, run_log.summary_dict(self.result("signal", eval_bpb=self.eval_bpb)))
    raise run_guard.TrainingInterrupted(
      f"stopped by {self.stop.name}{self.stop.origin} at step {self.run.step}; checkpoint saved in "
      f"{self.workdir / 'checkpoints'}: rerun the same command to resume",
      signum=self.stop.signum,
      step=self.run.step,
    )

  def finish(self, reason: str) -> TrainResult:
    """The end of a run that was not interrupted: the last save on disk, the sample, the final
    evaluation, and on process 0 ``loss.png`` and ``summary.json``."""
    checkpoint.finish(self.mngr)  # the last (asynchronous) save is complete before the run reports
    run = self.run
    if run.step < run.schedule_steps and self.primary:
      print(f"stopped at step {run.step} of {run.schedule_steps}; rerun with the same workdir to resume")
    tokenizer = self.corpus.tokenizer if self.corpus is not None else None
    sample = evaluation.sample_run(run.graphdef, run.state, self.cfg, tokenizer=tokenizer)
    final_eval = self.eval_bpb if not math.isnan(self.eval_bpb) else self.evaluate()
    result = self.result(reason, eval_bpb=final_eval, sample=sample)
    if not self.primary:
      result.tokens_per_second = 0.0
      return result
    run_files.plot_loss_curve(
      self.workdir / "metrics.jsonl", self.workdir / "loss.png", self.unigram, unit=self.unit
    )
    run_log.write_summary(self.workdir, run_log.summary_dict(result))
    return result


def run_training(
  cfg: TrainConfig,
  workdir: Path,
  mngr,
  stop: run_guard.StopRequest,
  saved_config: str | None,
  corpus: data.Corpus,
  fingerprint: dict[str, Any],
  *,
  progress: bool,
  start: float,
) -> TrainResult:
  """The body of ``trainer.train`` once the workdir is locked and the checkpoint manager open: set
  up, log the start, loop, then finish (or save and raise on a signal). Errors: see
  ``trainer.train``."""
  run = _Training(cfg, workdir, mngr, stop, saved_config, corpus, fingerprint, progress=progress, start=start)
  run.set_up()
  if run.finished:
    return run.already_finished()
  with run_log.RunLog(
    workdir, total=run.run.schedule_steps, initial=run.run.step, primary=run.primary, progress=run.progress
  ) as log:
    log.start(run.info, cfg.model_dump_json(indent=2))
    reason = run.loop(log)
  if reason == "signal" or agree_on_stop(stop):  # all processes reach this check at the same step
    run.interrupted()
  return run.finish(reason)
