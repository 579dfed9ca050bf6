"""Synthetic retrieval tasks generated on the fly from a seed (``data.task``, ``TaskConfig``): the
trainer's data source when a run trains on a task instead of text, and the study's retrieval samples.

A sample of length L is ``[2, L + 1]`` int32: row 0 the tokens (inputs ``[:-1]``, next-token targets
``[1:]``), row 1 the answer mask (1 where the token is an answer: the loss and the accuracies count only
those targets). A batch is ``[B, 2, L + 1]``. Token ids: 0 padding, 1 separator, symbols from 2
(``vocab_size``). What each task holds is ``TaskConfig``'s docstring; the distances grow with L (MQAR:
n = L // spacing pairs, the queries in the last 2n tokens, the i-th query of key k
L + 1 - 2n + 2i - 2k tokens after it; copy: every answer n + 1 tokens
after its source, n up to L // 2; flipflop: (L + 1) // 2 instruction-bit pairs, L >= 3).

Deterministic: sample i of training step s under seed r is drawn from
``numpy.random.default_rng([0, r, s, i])``, held-out sample i from ``[1, r, i]``, so a resumed run sees the
same batches and a process building rows ``rows`` of a batch builds the same rows as one building all.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.train.data_config import TaskConfig

__all__ = [
  "GENERATOR_VERSION",
  "MIN_LENGTH",
  "TASK_NAMES",
  "answer_bits",
  "check_task_run",
  "check_task_length",
  "fingerprint",
  "held_out",
  "min_length",
  "sample",
  "task_batch",
  "vocab_size",
]

GENERATOR_VERSION = 1
"""Bumped when a generator's output for the same config and seed changes (it enters ``fingerprint``)."""
PAD, SEP, FIRST = 0, 1, 2
WRITE, READ, IGNORE, BIT0 = FIRST, FIRST + 1, FIRST + 2, FIRST + 3  # flipflop


def vocab_size(task: TaskConfig) -> int:
  """V: the token ids the task uses (padding, separator and its symbols)."""
  if task.name == "mqar":
    return FIRST + task.num_keys + task.num_values
  if task.name == "copy":
    return FIRST + task.num_symbols
  return BIT0 + 2


def answer_bits(task: TaskConfig) -> float:
  """Chance cross-entropy of one answer in bits: log2 of the answers' alphabet (mqar: values; copy:
  symbols; flipflop: 2 bits), the reference a trained model must beat (the trainer's "unigram")."""
  return math.log2({"mqar": task.num_values, "copy": task.num_symbols, "flipflop": 2}[task.name])


MIN_LENGTH = {"copy": 2, "flipflop": 3}
"""The shortest length each task fills with an answerable sample (mqar: ``spacing``): copy one symbol,
the separator and its copy; flipflop a write and its bit, then a read (its bit, the answer, is the
target of L = 3; at L = 2 the one instruction would be a read with no earlier write)."""


def min_length(task: TaskConfig) -> int:
  """The shortest length L of an answerable sample of ``task`` (``MIN_LENGTH``; mqar: ``spacing``)."""
  return task.spacing if task.name == "mqar" else MIN_LENGTH[task.name]


def check_task_length(task: TaskConfig, length: int, what: str = "length") -> None:
  """Refuses a length L the task cannot fill with answerable samples.

  Raises:
    ValueError: L < ``min_length`` (mqar: ``spacing``, one pair; copy: 2; flipflop: 3, a write before
      the read); mqar with L // spacing pairs > ``num_keys``; copy with L // 2 > ``num_symbols`` (the
      keys / symbols of a sample are distinct). The message names ``what`` and the range.
  """
  low = min_length(task)
  if not _checks.is_int(length) or length < low:
    raise ValueError(
      f"{what} must be an int >= {low} for task {task.name} (the shortest length whose samples have an "
      f"answer), got {length!r}"
    )
  if task.name == "mqar" and length // task.spacing > task.num_keys:
    raise ValueError(
      f"{what} {length} needs {length // task.spacing} distinct mqar keys (L // spacing); data.task.num_keys "
      f"is {task.num_keys}"
    )
  if task.name == "copy" and length // 2 > task.num_symbols:
    raise ValueError(
      f"{what} {length} needs up to {length // 2} distinct copy symbols (L // 2); data.task.num_symbols is "
      f"{task.num_symbols}"
    )


def check_task_run(task: TaskConfig, *, vocab_size: int, seq_len: int, sample_len: int) -> None:
  """The ``TrainConfig`` checks of a task run: ``model.vocab_size`` >= the task's, ``seq_len`` fits,
  no text sample (``sample_len`` 0).

  Raises:
    ValueError: naming the key.
  """
  need = globals()["vocab_size"](task)
  if vocab_size < need:
    raise ValueError(
      f"model.vocab_size ({vocab_size}) must be >= {need}, the token ids of data.task {task.name}"
    )
  check_task_length(task, seq_len, "seq_len")
  if sample_len:
    raise ValueError(
      f"sample_len must be 0 with data.task (a text sample of a {task.name} model), got {sample_len}"
    )


def _mqar(rng: np.random.Generator, task: TaskConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
  n = length // task.spacing
  keys = rng.choice(task.num_keys, n, replace=False) + FIRST
  values = rng.integers(0, task.num_values, n) + FIRST + task.num_keys
  order = rng.permutation(n)
  tokens = np.zeros(length + 1, np.int32)
  q = length + 1 - 2 * n  # the queries start here
  tokens[0 : 2 * n : 2], tokens[1 : 2 * n : 2] = keys, values
  tokens[q::2], tokens[q + 1 :: 2] = keys[order], values[order]
  mask = np.zeros(length + 1, np.int32)
  mask[q + 1 :: 2] = 1
  return tokens, mask


def _copy(rng: np.random.Generator, task: TaskConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
  n = int(rng.integers(max(1, length // 8), length // 2 + 1))
  span = rng.choice(task.num_symbols, n, replace=False) + FIRST
  tokens = np.zeros(length + 1, np.int32)
  tokens[:n], tokens[n], tokens[n + 1 : 2 * n + 1] = span, SEP, span
  mask = np.zeros(length + 1, np.int32)
  mask[n + 1 : 2 * n + 1] = 1
  return tokens, mask


def _flipflop(rng: np.random.Generator, task: TaskConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
  m = (length + 1) // 2
  p = (1.0 - task.ignore) / 2
  ops = rng.choice(np.array([WRITE, READ, IGNORE]), m, p=[p, p, task.ignore])
  ops[0], ops[-1] = WRITE, READ  # every sample has an answer, the last one at its end
  bits = rng.integers(0, 2, m)
  written = np.maximum.accumulate(np.where(ops == WRITE, np.arange(m), 0))  # index of the last write
  bits = np.where(ops == READ, bits[written], bits)
  tokens = np.zeros(length + 1, np.int32)
  tokens[0 : 2 * m : 2], tokens[1 : 2 * m : 2] = ops, bits + BIT0
  mask = np.zeros(length + 1, np.int32)
  mask[1 : 2 * m : 2] = ops == READ
  return tokens, mask


_GENERATORS = {"mqar": _mqar, "copy": _copy, "flipflop": _flipflop}
TASK_NAMES = tuple(_GENERATORS)
"""The task names (``TaskConfig.name``)."""


def sample(task: TaskConfig, length: int, seed_seq: list[int]) -> np.ndarray:
  """One ``[2, length + 1]`` int32 sample (tokens, answer mask) from ``numpy.random.default_rng(seed_seq)``.

  Raises:
    ValueError: ``check_task_length``'s.
  """
  check_task_length(task, length)
  length = int(length)  # a numpy integer too
  return np.stack(_GENERATORS[task.name](np.random.default_rng(seed_seq), task, length))


def task_batch(
  task: TaskConfig, *, step: int, seed: int, batch_size: int, seq_len: int, rows: slice = slice(None)
) -> np.ndarray:
  """Training batch of step ``step``: ``[B, 2, T + 1]`` int32 (or its ``rows``), sample i from
  ``default_rng([0, seed, step, i])``: the same batches on a resume and whatever the process count."""
  return np.stack([sample(task, seq_len, [0, seed, step, i]) for i in range(batch_size)[rows]])


def held_out(task: TaskConfig, *, seed: int, count: int, length: int) -> np.ndarray:
  """``[count, 2, length + 1]`` int32 held-out samples (``default_rng([1, seed, i])``), disjoint in seed
  space from every training batch."""
  return np.stack([sample(task, length, [1, seed, i]) for i in range(count)])


def fingerprint(task: TaskConfig) -> dict[str, object]:
  """The data fingerprint of a task run (``jaxpe.train.data.fingerprint``'s keys): ``sha256`` of the
  task config and ``GENERATOR_VERSION``, so a checkpoint or a finished study model trained on another
  task, vocabulary or generator is refused; ``train_bytes``/``eval_bytes``/``files`` are 0 and ``task``
  names it."""
  text = json.dumps(
    {"task": task.model_dump(mode="json"), "version": GENERATOR_VERSION}, sort_keys=True, allow_nan=False
  )
  return {
    "sha256": hashlib.sha256(text.encode()).hexdigest(),
    "train_bytes": 0,
    "eval_bytes": 0,
    "files": 0,
    "task": task.name,
  }
