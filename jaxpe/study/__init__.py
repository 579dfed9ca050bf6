# ruff: noqa: E402  (the extra is checked before the imports that need it)
"""Train short, test long: one small model per positional encoding, evaluated at 1x..8x its training length.

Every model is trained by ``jaxpe.train.trainer.train`` on the same data, seed, batch stream, budget
and architecture; only ``model.pos_encoding`` (and the emulation order) differ. The eval-time RoPE
scalings (linear interpolation, dynamic NTK, YaRN) reuse the plain ``rope`` model's weights and
change only ``rope_scaling`` at evaluation; position interpolation's fine-tuned arm (``rope_pi_ft``)
fine-tunes them with its factor first. One module per step:

- ``config``: the rows (``ENCODINGS``), ``StudyConfig``, the train and eval ``ModelConfig`` of a row.
- ``evaluation``: held-out windows and chunks, bits/byte by position, the emulation check.
- ``models``: train (or resume, or reuse when finished on the same data) a row's model; PI fine-tuning.
- ``retrieval``: scores on the synthetic retrieval tasks (``jaxpe.train.tasks``, re-exported here:
  ``TaskConfig``, ``task_batch``, ``held_out``), combined over samples and seeds, the emulation check.
- ``retrieval_run``: the retrieval step (task models trained by the ordinary trainer, every row scored).
- ``report``: table cells, paired differences, ``study.md`` and the plots.
- ``run``: ``run_study``, from training (or resuming) to the written outputs.

Outputs in ``<workdir>``: ``study.md`` (table, settings, emulation check), ``study.json`` (every
number, per-window means and per-position curves), ``bits_per_byte.png`` (bits/byte against eval
length) and ``loss_vs_position.png``. ``load_trained`` / ``trained_params`` (a trained run's latest
checkpoint) live in ``jaxpe.train.load`` and are re-exported here.

Sources: Press et al., "Train Short, Test Long" (ALiBi, arXiv 2108.12409); linear position
interpolation (Chen et al., arXiv 2306.15595); dynamic NTK (bloc97/emozilla 2023, HF
``_compute_dynamic_ntk_parameters``); YaRN (Peng et al., arXiv 2309.00071); xPos (arXiv 2212.10554).
Needs the ``train`` extra (``jaxpe.errors.MissingExtraError`` names it otherwise).
"""

from jaxpe.errors import require_extra

require_extra("train", "jaxpe.study")

from jaxpe.study.config import (
  ENCODINGS,
  Encoding,
  StudyConfig,
  eval_model_config,
  load_study_config,
  model_dir,
  model_train_config,
  streaming_sizes,
  task_train_config,
)
from jaxpe.study.evaluation import chunks, emulation_check, evaluate, study_windows, token_nll, token_scores
from jaxpe.study.models import StudyInterrupted, finetune, train_model
from jaxpe.study.report import (
  cell,
  markdown,
  paired,
  plot_bits_per_byte,
  plot_loss_vs_position,
  plot_retrieval,
  retrieval_markdown,
)
from jaxpe.study.retrieval import METRICS, combine_task, paired_task, score_task, task_emulation
from jaxpe.study.retrieval_run import EVAL_SEED, finetuned_params, run_retrieval
from jaxpe.study.run import run_study
from jaxpe.study.seeds import combine_seeds, paired_seeds
from jaxpe.train.data_config import TaskConfig
from jaxpe.train.load import load_trained, trained_params
from jaxpe.train.tasks import held_out, task_batch

__all__ = [
  "ENCODINGS",
  "EVAL_SEED",
  "METRICS",
  "Encoding",
  "StudyConfig",
  "StudyInterrupted",
  "TaskConfig",
  "cell",
  "chunks",
  "combine_seeds",
  "combine_task",
  "emulation_check",
  "eval_model_config",
  "evaluate",
  "finetune",
  "finetuned_params",
  "held_out",
  "load_study_config",
  "load_trained",
  "markdown",
  "model_dir",
  "model_train_config",
  "paired",
  "paired_seeds",
  "paired_task",
  "plot_bits_per_byte",
  "plot_loss_vs_position",
  "plot_retrieval",
  "retrieval_markdown",
  "run_retrieval",
  "run_study",
  "score_task",
  "streaming_sizes",
  "study_windows",
  "task_batch",
  "task_emulation",
  "task_train_config",
  "token_nll",
  "token_scores",
  "train_model",
  "trained_params",
]
