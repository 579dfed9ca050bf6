"""How a training run paces itself: the schedule fitted to a time budget, and progress output.

``fit_num_steps`` answers "how many optimizer steps fit in what is left of ``max_seconds``?" from the
step time measured after the first steps, so the learning-rate schedule (warmup + cosine decay) can
be shortened to end within the budget instead of being cut off mid-decay. ``Progress`` is a tqdm bar
on a terminal and a plain line every ``every_seconds`` in a log file or CI (no carriage-return
redraws). ``StepTiming`` keeps a process's step times (the compiling first step apart) for
tokens/s.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm


@dataclass(frozen=True)
class StepCosts:
  """Measured and estimated seconds of the parts of a run (all wall seconds on this machine).

  ``step``: one timed train step (compiled); ``compile``: one train-step compilation (the first
  step's time minus ``step``); ``eval``: one evaluation of ``eval_batches`` batches (estimated as
  ``eval_batches * step / 3``: a forward pass costs about a third of forward + backward + update);
  ``save``: one checkpoint.
  """

  step: float
  compile: float
  eval: float
  save: float


def fit_num_steps(
  *,
  step: int,
  num_steps: int,
  warmup_steps: int,
  seconds_left: float,
  costs: StepCosts,
  eval_every: int,
  checkpoint_every: int,
  fixed_seconds: float = 0.0,
  margin: float = 0.1,
) -> int:
  """The schedule length (total optimizer steps, ``<= num_steps``) that ends within the budget.

  Solves ``fixed + compile + (F - step) * per_step + evals + saves <= (1 - margin) * seconds_left``
  for the largest F, where ``per_step = costs.step + costs.eval / eval_every + costs.save /
  checkpoint_every`` (the periodic evaluations and checkpoints spread over the steps), one more
  evaluation and checkpoint at the end, and one recompilation of the train step for the new
  schedule. ``fixed_seconds`` covers what runs once after the last step (e.g. the sample).

  Args:
    step: optimizer steps already done (>= 0).
    num_steps: the configured schedule length (> 0); the result never exceeds it.
    warmup_steps: the warmup length; the result is at least ``warmup_steps + 1`` (a schedule
      shorter than its warmup has no decay), and at least ``step + 1``.
    seconds_left: wall seconds left in the budget (may be <= 0: then the smallest allowed F).
    costs: see ``StepCosts``.
    eval_every, checkpoint_every: periods in steps (> 0).
    fixed_seconds: one-off seconds after the last step (>= 0).
    margin: fraction of ``seconds_left`` kept free for the noise of a shared machine, in [0, 1).

  Returns:
    F, ``max(step + 1, warmup_steps + 1)`` capped at ``num_steps``, at most ``num_steps``.

  Raises:
    ValueError: negative ``step``/``warmup_steps``/``fixed_seconds``, non-positive
      ``num_steps``/``eval_every``/``checkpoint_every`` or step time, ``margin`` outside [0, 1).
  """
  for name, value, ok in (
    ("step", step, step >= 0),
    ("num_steps", num_steps, num_steps > 0),
    ("warmup_steps", warmup_steps, warmup_steps >= 0),
    ("eval_every", eval_every, eval_every > 0),
    ("checkpoint_every", checkpoint_every, checkpoint_every > 0),
    ("costs.step", costs.step, costs.step > 0),
    ("fixed_seconds", fixed_seconds, fixed_seconds >= 0),
    ("margin", margin, 0 <= margin < 1),
  ):
    if not ok:
      raise ValueError(f"{name} out of range, got {value}")
  per_step = costs.step + costs.eval / eval_every + costs.save / checkpoint_every
  usable = (1 - margin) * seconds_left - fixed_seconds - costs.compile - costs.eval - costs.save
  fitted = step + max(0, math.floor(usable / per_step))
  return min(num_steps, max(fitted, step + 1, warmup_steps + 1))


class Progress:
  """Progress of a run: a tqdm bar when stderr is a terminal, else one line on ``stream`` every
  ``every_seconds`` (and at the first and last step), so a log file gets lines, not redraws.

  ``update(step, **figures)`` after each step; ``write(text)`` for a message line; ``total`` may be
  changed (a fitted schedule). Use as a context manager (closes the bar).
  """

  def __init__(
    self,
    total: int,
    initial: int = 0,
    *,
    enabled: bool = True,
    interactive: bool | None = None,
    every_seconds: float = 30.0,
    stream: TextIO | None = None,
  ):
    self.total, self.enabled, self.every_seconds = total, enabled, every_seconds
    self._stream = stream
    self.interactive = sys.stderr.isatty() if interactive is None else interactive
    self._bar = None
    if enabled and self.interactive:
      self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
    self._last_line = -math.inf

  @property
  def stream(self) -> TextIO:
    return self._stream or sys.stdout

  def set_total(self, total: int) -> None:
    self.total = total
    if self._bar is not None:
      self._bar.total = total
      self._bar.refresh()

  def write(self, text: str) -> None:
    if self._bar is not None:
      self._bar.write(text)
    else:
      print(text, file=self.stream, flush=True)

  def update(self, step: int, **figures: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.set_postfix(**figures, refresh=False)
      self._bar.update(step - self._bar.n)
      return
    now = time.monotonic()
    if now - self._last_line >= self.every_seconds or step >= self.total:
      self._last_line = now
      shown = " ".join(f"{k} {v}" for k, v in figures.items())
      print(f"step {step}/{self.total} {shown}".rstrip(), file=self.stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@dataclass
class StepTiming:
  """This process's step times: the first step (and the first after a fit) compiles and is not
  counted in tokens/s."""

  tokens: int = 0
  seconds: float = 0.0
  steps: int = 0  # steps this process ran
  first_dt: float = 0.0
  compiled: bool = False

  def add(self, dt: float, tokens: int) -> None:
    self.steps += 1
    if self.compiled:
      self.tokens, self.seconds = self.tokens + tokens, self.seconds + dt
    else:
      self.first_dt, self.compiled = self.first_dt or dt, True

  @property
  def tokens_per_second(self) -> float:
    return self.tokens / self.seconds if self.seconds else 0.0
