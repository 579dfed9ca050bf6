"""The study's configuration: its rows (``ENCODINGS``, defined in ``jaxpe.study.rows``),
``StudyConfig`` and its YAML loader, and the ``ModelConfig`` each row trains and evaluates with.

Every model shares the data, seed, batch stream, budget and architecture; only ``model.pos_encoding``
(and the emulation order) differ. The eval-time RoPE scalings (linear interpolation, dynamic NTK,
YaRN) reuse the plain ``rope`` model's weights and change only ``rope_scaling`` at evaluation, as
they are used in practice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pydantic

from jaxpe.model.config import ModelConfig
from jaxpe.ops import checks as _checks
from jaxpe.study.rows import ENCODINGS, Encoding
from jaxpe.train import tasks
from jaxpe.train.config import TrainConfig, _merge, load_yaml_file, parse_overrides, with_data_path
from jaxpe.train.data_config import TaskConfig

__all__ = [
  "ENCODINGS",
  "Encoding",
  "StudyConfig",
  "eval_model_config",
  "load_study_config",
  "model_dir",
  "model_train_config",
  "streaming_sizes",
  "task_train_config",
]


class StudyConfig(pydantic.BaseModel):
  """A study: the shared training run (``train``), the encodings, the evaluation, and the retrieval
  tasks (``tasks``, each trained per encoding and seed with ``task_train`` over ``train``).

  ``train.workdir`` and ``train.model.pos_encoding`` are set per model (``<workdir>/models/<name>``;
  a task's models in ``<workdir>/models/<task>/<name>``); ``train.model.max_len`` is set to the
  training length (the learned table covers it only) and ``rope_alibi_context`` to the longest eval
  length. Every float key is finite (``allow_inf_nan=False``) and in the range its field gives.
  """

  model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

  workdir: str = "runs/study"
  encodings: tuple[str, ...] = tuple(ENCODINGS)
  eval_multiples: tuple[int, ...] = (1, 2, 4, 8)
  eval_windows: int = pydantic.Field(32, gt=1, description="W held-out windows of the longest length")
  eval_batch_size: int = pydantic.Field(8, gt=0, description="chunks per evaluation forward pass")
  seeds: int = pydantic.Field(
    1,
    gt=0,
    description="S models per encoding, trained with seeds train.seed + 0..S-1 (init and batch order)",
  )
  finetune_steps: int = pydantic.Field(
    50,
    ge=0,
    description="rope_pi_ft: Adam steps of position-interpolation fine-tuning at max(eval_multiples) T",
  )
  finetune_learning_rate: float = pydantic.Field(
    1e-3, gt=0, le=1, description="rope_pi_ft: the fine-tuning's constant Adam learning rate"
  )
  tasks: tuple[TaskConfig, ...] = pydantic.Field(
    (), description="retrieval tasks (jaxpe.train.tasks), distinct names; empty = no retrieval"
  )
  task_train: dict[str, Any] = pydantic.Field(
    default_factory=dict,
    description="train keys of the task models over train's (e.g. seq_len, num_steps, learning_rate, model.d_model)",
  )
  task_train_by_task: dict[str, dict[str, Any]] = pydantic.Field(
    default_factory=dict,
    description="per task name: train keys over task_train for that task's models (e.g. {mqar: {num_steps: 500}}); "
    "entries of tasks not in tasks are ignored",
  )
  task_init: dict[str, str] = pydantic.Field(
    default_factory=dict,
    description="curriculum: task -> an earlier task in tasks whose finished model of the same encoding and "
    "seed starts it (train.init_from); the task's models take the source's vocab_size; entries whose task is "
    "not in tasks are ignored",
  )
  task_samples: int = pydantic.Field(64, gt=1, description="held-out samples per task and eval length")
  train: TrainConfig = TrainConfig()

  @pydantic.model_validator(mode="before")
  @classmethod
  def _lists_to_tuples(cls, raw: Any) -> Any:
    if isinstance(raw, dict):
      raw = {k: tuple(v) if isinstance(v, list) and k != "task_train" else v for k, v in raw.items()}
      if isinstance(raw.get("train"), dict) and isinstance(raw["train"].get("mesh_shape"), list):
        raw["train"] = {**raw["train"], "mesh_shape": tuple(raw["train"]["mesh_shape"])}
    return raw

  @pydantic.model_validator(mode="after")
  def _check(self) -> StudyConfig:
    unknown = [e for e in self.encodings if e not in ENCODINGS]
    if unknown or not self.encodings or len(set(self.encodings)) != len(self.encodings):
      raise ValueError(f"encodings must be distinct names from {list(ENCODINGS)}, got {list(self.encodings)}")
    m = self.eval_multiples
    if not m or m[0] != 1 or any(b <= a or b % a for a, b in zip(m, m[1:])):
      raise ValueError(
        f"eval_multiples must start at 1, increase, and each divide the next (e.g. [1, 2, 4, 8]), got {list(m)}"
      )
    names = [t.name for t in self.tasks]
    if len(set(names)) != len(names):
      raise ValueError(f"tasks must have distinct names, got {names}")
    if self.train.init_from is not None:
      raise ValueError(
        f"train.init_from must be null in a study, got {self.train.init_from!r}: every model trains from its "
        "own random init (task_init starts a task's models from an earlier task's)"
      )
    _check_curriculum(self, names)
    if self.tasks:
      for where, keys in [("task_train", self.task_train)] + [
        (f"task_train_by_task.{k}", v) for k, v in self.task_train_by_task.items() if k in names
      ]:
        if "data" in keys:
          raise ValueError(f"{where} must not set data (the task is the data: give it under tasks)")
        if "init_from" in keys:
          raise ValueError(f"{where} must not set init_from (task_init starts a task from another's models)")
        _refuse_study_set_keys(where, keys)
      for (
        task
      ) in self.tasks:  # every task model's TrainConfig, and every eval length the generators must fill
        where = "task_train" + (
          f" / task_train_by_task.{task.name}" if task.name in self.task_train_by_task else ""
        )
        try:
          cfg = task_train_config(self, task)
          tasks.check_task_length(
            task, m[-1] * cfg.seq_len, f"max(eval_multiples) x the task seq_len ({task.name})"
          )
        except (ValueError, pydantic.ValidationError) as e:
          raise ValueError(f"{where} / tasks (task {task.name}): {e}") from None
      for target, source in self.task_init.items():  # the source's weights fit the target's models
        if target not in names:  # a task not run: ignored
          continue
        by_name = {t.name: task_train_config(self, t) for t in self.tasks if t.name in (target, source)}
        a, b = by_name[source], by_name[target]
        if (a.model, a.seq_len) != (b.model, b.seq_len):
          diff = sorted(k for k, v in b.model if getattr(a.model, k) != v)
          raise ValueError(
            f"task_init {target}: {source}: the two tasks' models must have the same architecture and "
            f"seq_len (the source's parameters start the target's), got model keys {diff} and seq_len "
            f"{a.seq_len} -> {b.seq_len} (set them in task_train, not task_train_by_task)"
          )
    for task in (None, *self.tasks):  # every row's model and StreamingLLM sizes, before any training
      for name in self.encodings:
        try:
          model_train_config(self, name, 0, task)
          streaming_sizes(self, name, task)
        except (ValueError, pydantic.ValidationError) as e:
          where = "train" if task is None else f"task {task.name} (task_train)"
          raise ValueError(f"encodings / {where}: {e}") from None
    return self

  @property
  def longest(self) -> int:
    """Longest eval length in tokens (``max(eval_multiples) * train.seq_len``)."""
    return self.eval_multiples[-1] * self.train.seq_len


STUDY_SET_KEYS = {
  "workdir": "each model's workdir is <workdir>/models/<task>/<name>",
  "sample_len": "a task model generates no text sample (sample_len 0)",
  "model.vocab_size": "a task model's vocabulary is its task's (the task_init source's)",
  "model.pos_encoding": "each model's encoding is its row's (encodings)",
  "model.max_len": "each model's max_len is its seq_len",
  "model.rope_alibi_context": "rope_alibi's context is the longest eval length",
  "model.rope_scaling": "the eval-time scalings are rows of encodings (rope_linear, ...)",
  "model.cope_npos_max": "cope's position count is the training length",
}
"""Train keys the study sets per model, over whatever ``task_train`` / ``task_train_by_task`` give:
given there they would be replaced without a word, so they are refused (issue 48 kind 6)."""


def _refuse_study_set_keys(where: str, keys: dict[str, Any]) -> None:
  """Refuses a ``STUDY_SET_KEYS`` key in ``keys`` (a ``task_train`` / ``task_train_by_task`` entry).

  Raises:
    ValueError: naming ``where``, the key and what the study sets it to.
  """
  for dotted, why in STUDY_SET_KEYS.items():
    section, _, key = dotted.rpartition(".")
    holder = keys.get(section) if section else keys
    if isinstance(holder, dict) and key in holder:
      raise ValueError(f"{where} must not set {dotted} (the study sets it: {why}), got {holder[key]!r}")


def _check_curriculum(study: StudyConfig, names: list[str]) -> None:
  """The per-task keys. ``task_train_by_task`` and ``task_init`` entries must name tasks
  (``tasks.TASK_NAMES``); an entry whose task is not run (not in ``tasks``: ``tasks=[]`` runs none) is
  ignored, as ``task_train`` is without tasks, so a config can keep the curriculum of tasks an override
  leaves out. A run task's ``task_init`` source must be run too, listed before it and not itself
  started from another (no chains), with a vocabulary at least the target's."""
  known = list(tasks.TASK_NAMES)
  unknown = sorted(set(study.task_train_by_task) - set(known))
  if unknown:
    raise ValueError(
      f"task_train_by_task names unknown tasks: {unknown} (task names: {known}; entries of tasks not in "
      f"tasks {names} are ignored)"
    )
  for target, source in study.task_init.items():
    if target not in known or source not in known:
      raise ValueError(
        f"task_init {target}: {source}: both must be task names ({known}; entries whose target is not in "
        f"tasks {names} are ignored)"
      )
    if target in names and source not in names:
      raise ValueError(
        f"task_init {target}: {source}: {target} is run but {source} is not in tasks ({names}): its models "
        f"must train first; add {source} before {target} in tasks, or drop task_init.{target}"
      )
  for target, source in study.task_init.items():
    where = f"task_init {target}: {source}"
    if target not in names:  # a task not run: its entry is ignored
      continue
    if source == target:
      raise ValueError(f"{where}: a task cannot start from its own models (name an earlier task of {names})")
    if names.index(source) >= names.index(target):
      raise ValueError(
        f"{where}: the source must be listed before the target in tasks ({names}), to train first"
      )
    if source in study.task_init:
      raise ValueError(f"{where}: {source} is itself started from {study.task_init[source]} (no chains)")
    by_name = {t.name: t for t in study.tasks}
    if tasks.vocab_size(by_name[target]) > tasks.vocab_size(by_name[source]):
      raise ValueError(
        f"{where}: the target's vocabulary ({tasks.vocab_size(by_name[target])} tokens) exceeds the "
        f"source's ({tasks.vocab_size(by_name[source])}); its models take the source's vocab_size"
      )


def task_train_config(study: StudyConfig, task: TaskConfig) -> TrainConfig:
  """The shared ``TrainConfig`` of ``task``'s models: ``study.train`` with ``study.task_train`` and
  ``study.task_train_by_task[task.name]`` merged over it, ``data.task`` = ``task``, ``model.vocab_size``
  = the task's (the source task's when ``study.task_init`` starts it from another) and no text sample.

  Raises:
    ValueError: keys the merged config refuses (pydantic's ``ValidationError``).
  """
  raw = _merge(study.train.model_dump(mode="python"), dict(study.task_train))
  raw = _merge(raw, dict(study.task_train_by_task.get(task.name, {})))
  vocab_of = {t.name: t for t in study.tasks}.get(study.task_init.get(task.name), task)
  raw["data"] = {**raw["data"], "task": task.model_dump(mode="python")}
  raw["model"] = {**raw["model"], "vocab_size": tasks.vocab_size(vocab_of)}
  raw["sample_len"] = 0
  return TrainConfig.model_validate(raw)


def load_study_config(
  path: str | Path, overrides: list[str] = (), *, data_path: str | None = None, unique_overrides: bool = False
) -> StudyConfig:
  """Reads a study YAML and applies ``key=value`` overrides (dotted keys, YAML values, e.g.
  ``train.num_steps=50`` or ``encodings=[rope,alibi]``) and ``data_path``.

  Args:
    path: the study YAML.
    overrides: ``key=value`` strings (``jaxpe.model.config.parse_overrides``), applied over the file.
    data_path: ``--data``: sets ``train.data.path`` verbatim (never YAML-parsed); cannot be combined
      with a ``train.data.path=`` override.
    unique_overrides: refuse a key given twice in ``overrides`` (the command line); else a later
      override replaces an earlier one.

  Raises:
    FileNotFoundError: ``path`` or ``data_path`` does not exist.
    ValueError: unknown keys, wrong types or values (pydantic's ``ValidationError``); a file that is
      not UTF-8, not valid YAML or gives a key twice (named with the line); a bad override.
  """
  raw = load_yaml_file(path, "study config")
  if isinstance(overrides, str):
    raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
  extra = parse_overrides(list(overrides), unique=_checks.check_bool("unique_overrides", unique_overrides))
  train_extra = extra.get("train") if isinstance(extra.get("train"), dict) else {}
  if data_path is not None and isinstance(train_extra.get("data"), dict) and "path" in train_extra["data"]:
    raise ValueError("--data and the override train.data.path= both set the data path; give one")
  raw = with_data_path(_merge(raw, extra), data_path, section=("train",))
  return StudyConfig.model_validate(raw)


def model_dir(name: str, seed: int = 0) -> str:
  """The directory name of encoding ``name``'s model of seed index ``seed`` under ``<workdir>/models``:
  ``name`` for seed 0 (the first edition's layout, so its finished models are reused), else
  ``name.seed<k>``."""
  return name if seed == 0 else f"{name}.seed{seed}"


def _base_config(study: StudyConfig, task: TaskConfig | None) -> TrainConfig:
  return study.train if task is None else task_train_config(study, task)


def model_train_config(
  study: StudyConfig, name: str, seed: int = 0, task: TaskConfig | None = None
) -> TrainConfig:
  """The ``TrainConfig`` of encoding ``name`` (its base model for the eval-time scalings) and seed index
  ``seed`` (``train.seed + seed``, in ``<workdir>/models/model_dir(name, seed)``); with ``task``, the
  task's model (``task_train_config``, in ``<workdir>/models/<task>/model_dir(name, seed)``), whose
  ``init_from`` is the same encoding and seed's model of the source task when ``study.task_init`` names one.

  Raises:
    KeyError: unknown name.
    ValueError: ``seed`` outside ``0 .. study.seeds - 1``.
  """
  if not _checks.is_int(seed) or not 0 <= seed < study.seeds:
    raise ValueError(f"seed must be an int in 0..{study.seeds - 1} (study.seeds - 1), got {seed!r}")
  seed = int(seed)
  enc = ENCODINGS[name]
  name = enc.base or name
  base = _base_config(study, task)
  raw = base.model_dump(mode="python")
  model = {**raw["model"], "max_len": base.seq_len, "rope_scaling": None, **ENCODINGS[name].model}
  if ENCODINGS[name].derived is not None:
    model.update(ENCODINGS[name].derived(base.seq_len, model["num_layers"]))
  if model["pos_encoding"] == "rope_alibi":
    model["rope_alibi_context"] = study.eval_multiples[-1] * base.seq_len
  if model["pos_encoding"] == "cope":  # P positions of the training length, the same at every eval length
    model["cope_npos_max"] = base.seq_len
  root = Path(study.workdir) / "models" / ("" if task is None else task.name)
  raw.update(model=model, seed=base.seed + seed, workdir=str(root / model_dir(name, seed)))
  if task is not None and task.name in study.task_init:  # the curriculum: from the source task's model
    source = next(t for t in study.tasks if t.name == study.task_init[task.name])
    raw["init_from"] = model_train_config(study, name, seed, source).workdir
  return TrainConfig.model_validate(raw)


def eval_model_config(
  study: StudyConfig, name: str, multiple: int, task: TaskConfig | None = None
) -> ModelConfig | None:
  """The ``ModelConfig`` evaluating encoding ``name`` (of ``task``'s models, or the text models) at
  ``multiple`` x the training length T, or None where it cannot run (learned positions beyond their
  table).

  ``max_len`` becomes the eval length (it only sets xPos's offset, which cancels in q.k). Eval-time
  scalings at m > 1: ``linear`` factor m; ``dynamic`` factor 1 with the training length as
  ``original_max_position_embeddings`` (base x m^(R/(R-2)) at length m T); ``yarn`` factor m over the
  training length (HF defaults beta_fast 32, beta_slow 1, attention factor 0.1 ln m + 1). At 1x they
  are the plain rope model. A ``finetuned`` row (``rope_pi_ft``) has linear factor M at every length.
  """
  base = model_train_config(study, name, task=task).model
  t = _base_config(study, task).seq_len
  length = multiple * t
  if base.pos_encoding == "learned" and length > base.max_len:
    return None
  update: dict[str, Any] = {"max_len": max(length, base.max_len)}
  scaling = ENCODINGS[name].scaling
  if ENCODINGS[name].finetuned:  # the factor it was fine-tuned with, at every length
    update["max_len"] = max(length, study.eval_multiples[-1] * t)
    update["rope_scaling"] = {"rope_type": scaling, "factor": float(study.eval_multiples[-1])}
  elif scaling is not None and multiple > 1:
    update["rope_scaling"] = {
      "linear": {"rope_type": "linear", "factor": float(multiple)},
      "dynamic": {"rope_type": "dynamic", "factor": 1.0, "original_max_position_embeddings": t},
      "yarn": {"rope_type": "yarn", "factor": float(multiple), "original_max_position_embeddings": t},
    }[scaling]
  return ModelConfig.model_validate({**base.model_dump(mode="python"), **update})


def streaming_sizes(study: StudyConfig, name: str, task: TaskConfig | None = None) -> tuple[int, int] | None:
  """``(start_size, recent_size)`` of row ``name``'s StreamingLLM evaluation (of ``task``'s models, or
  the text models): ``Encoding.streaming`` sinks and the last ``T - streaming`` tokens, T the
  training length, so the cache holds T tokens at positions ``0 .. T - 1``, the range the model was
  trained on (at 1x nothing is evicted: the plain forward); None for the other rows.

  Raises:
    KeyError: unknown name.
    ValueError: the row's sinks are not fewer than the training length (no recent window left).
  """
  sinks = ENCODINGS[name].streaming
  if sinks is None:
    return None
  t = _base_config(study, task).seq_len
  if not 0 <= sinks < t:
    raise ValueError(f"row {name}: its {sinks} sink tokens must be fewer than the training length {t}")
  return sinks, t - sinks


def cache_key(*parts: Any) -> str:
  """16 hex digits of the SHA-256 of ``parts`` as sorted JSON (non-JSON values by ``str``): the key
  the study's caches (evaluations, retrieval scores, fine-tuned weights) are stored under."""
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str, allow_nan=False).encode()).hexdigest()[
    :16
  ]
