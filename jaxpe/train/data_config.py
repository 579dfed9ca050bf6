"""The ``data:`` section of a training run: byte-level text (``path``, ``max_bytes``, ...) or a
synthetic retrieval task (``task``, ``TaskConfig``; the generators are ``jaxpe.train.tasks``).

Kept apart from ``jaxpe.train.config`` so the task generators can read their config without the
YAML loading; ``jaxpe.train.config`` re-exports ``DataConfig``.
"""

from __future__ import annotations

from typing import Literal

import pydantic

from jaxpe.model.config import StrictConfig

__all__ = ["DataConfig", "TaskConfig"]


class TaskConfig(StrictConfig):
  """A synthetic retrieval task generated on the fly from the run's seed (``jaxpe.train.tasks``):
  tokens plus a loss mask on the answer tokens. Token ids: 0 padding, 1 separator, symbols from 2.

  - ``mqar`` (multi-query associative recall, Arora et al. arXiv 2312.04927): at length L,
    n = L // ``spacing`` key-value pairs (distinct keys from ``num_keys``, values from ``num_values``),
    padding, then the n keys again in a random order, each followed by its value (the answer), ending
    the sample (the queries take its last 2n tokens).
  - ``copy`` (Jelassi et al. arXiv 2402.01032): a string of n distinct symbols (from ``num_symbols``; n
    uniform in [max(1, L // 8), L // 2]), the separator, then the string again (the answers).
  - ``flipflop`` (Liu et al. arXiv 2306.00946): (L + 1) // 2 instruction-bit pairs (L >= 3; an odd L's
    last bit is the sample's last target); write (p (1 - ``ignore``) / 2), read (the same), ignore
    (``ignore``); the first is a write and the last a read; the bit after each read is the answer (the
    last bit written).
  """

  name: Literal["mqar", "copy", "flipflop"] = "mqar"
  num_keys: int = pydantic.Field(
    128, gt=0, description="mqar: distinct keys (>= L // spacing at the longest length L)"
  )
  num_values: int = pydantic.Field(64, gt=1, description="mqar: values")
  spacing: int = pydantic.Field(
    8, ge=4, description="mqar: sample tokens per pair (n = L // spacing pairs; 4 = no padding)"
  )
  num_symbols: int = pydantic.Field(
    256, gt=0, description="copy: distinct symbols (>= L // 2 at the longest length L)"
  )
  ignore: float = pydantic.Field(
    0.8, ge=0, lt=1, description="flipflop: probability of an ignore instruction (Liu et al.: 0.8)"
  )


class DataConfig(StrictConfig):
  """Byte-level text, a token file (``tokens``), or with ``task`` a synthetic retrieval task (then the
  text keys are unused)."""

  omit_at_default = ("tokens", "token_dtype", "eot_token", "tokenizer", "packing", "loader", "grain_workers")

  path: str | None = pydantic.Field(
    None,
    min_length=1,
    description="text file or directory of text files, taken verbatim (no ~ expansion); None = Python "
    "stdlib sources. ``--data PATH`` sets it without YAML parsing",
  )
  max_bytes: int = pydantic.Field(
    16_000_000,
    gt=0,
    description="cap on corpus bytes read: eval_fraction of it held-out, the rest training (each side's "
    "files in sorted order)",
  )
  eval_fraction: float = pydantic.Field(
    0.05, gt=0, lt=1, description="held-out share of files (by path hash) or of a single file's bytes"
  )
  allow_changed: bool = pydantic.Field(
    False,
    description="resume although the data's bytes changed since the checkpoint (its fingerprint "
    "differs); the batch stream then differs from the saved run's. false = refuse such a resume",
  )
  task: TaskConfig | None = pydantic.Field(
    None,
    description="a synthetic retrieval task (jaxpe.train.tasks) instead of text: batches [B, 2, T + 1] of "
    "tokens and answer mask, the loss on the answer tokens only; null = text",
  )
  tokens: str | None = pydantic.Field(
    None,
    min_length=1,
    description="a flat token file instead of text: .bin (uint16/uint32 ids as nanoGPT writes them; the "
    "dtype from token_dtype or the PATH.json sidecar jaxpe-tokenize writes) or .npy, memory-mapped; the "
    "last eval_fraction of its tokens held out; ids checked against model.vocab_size; null = text",
  )
  token_dtype: Literal["uint16", "uint32"] | None = pydantic.Field(
    None, description="dtype of a .bin token file; null = from its PATH.json sidecar (.npy: its header)"
  )
  eot_token: int | None = pydantic.Field(
    None,
    ge=0,
    description="end-of-document token id of a token file: a document ends with it (packing's documents); "
    "null = the sidecar's, else the file is one document",
  )
  tokenizer: str | None = pydantic.Field(
    None,
    min_length=1,
    description="tokenizer.json (HF tokenizers) of a token file, copied into the run so jaxpe-sample "
    "decodes with it; null = the one the sidecar names, else none (byte-level text runs need none)",
  )
  packing: Literal["concat_then_split", "first_fit"] | None = pydantic.Field(
    None,
    description="documents (files; a token file's eot_token) in rows with segment ids: positions restart and "
    "attention stays within each document, the loss skips each document's first token and padding. "
    "concat_then_split = today's windows with segment ids; first_fit = whole documents (cut at seq_len + 1) "
    "first-fit into padded rows; null = windows without segment ids",
  )

  loader: Literal["numpy", "grain"] = pydantic.Field(
    "numpy",
    description="numpy = each batch made when its step starts; grain = the same batches from a grain "
    "pipeline (jaxpe.train.input_pipeline), prefetched by grain_workers threads, its iterator state saved "
    "with each checkpoint",
  )
  grain_workers: int = pydantic.Field(2, gt=0, le=64, description="grain: threads that prefetch batches")

  @pydantic.model_validator(mode="after")
  def _check_source(self) -> DataConfig:
    if self.tokens is not None and self.path is not None:
      raise ValueError("data.tokens and data.path both name the data; give one (a token file or text)")
    if self.tokens is not None and self.task is not None:
      raise ValueError("data.tokens and data.task both name the data; give one")
    if self.packing is not None and self.task is not None:
      raise ValueError("data.packing packs text or token documents; a data.task run has none")
    return self
