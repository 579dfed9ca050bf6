"""Hostile inputs for the command lines (train/train.py, train/study.py), their config keys and the data
path, walking the tables of docs/contracts.md (section "Command lines and config keys"): each bad value is
one line naming the argument (exit status 2), never a misread value, a raw exception or lost data.

The command lines run in-process (``main(argv)``); only the cases that must train run a real (one- to
three-step, tiny) run. References are the schema's declared ranges (walked key by key) and file contents
written here."""

import importlib
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import annotated_types
import jax
import pydantic
import pytest

from jaxpe import study
from jaxpe.train import config as config_lib
from jaxpe.train import data, memory_check, run_files, run_guard, trainer
from jaxpe.train.config import TrainConfig, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _load(name: str):
  # train/<name>.py is a wrapper of this module (the jaxpe-<name> command), which the tests patch
  return importlib.import_module(f"jaxpe.{name}.cli")


@pytest.fixture(scope="module")
def train_cli():
  return _load("train")


@pytest.fixture(scope="module")
def study_cli():
  return _load("study")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
  """cwd = tmp_path, holding files named like YAML values and comments."""
  monkeypatch.chdir(tmp_path)
  for name in ("null", "~", "my text #2.txt", "yes", "[1, 2]"):
    (tmp_path / name).write_text(f"text of the file {name}\n" * 50)
  (tmp_path / "dup.yaml").write_text("seq_len: 32\nseq_len: 64\n")
  (tmp_path / "dup_study.yaml").write_text("workdir: a\ntrain:\n  seq_len: 32\n  seq_len: 64\n")
  return tmp_path


# (argv, regex of the one error line). Exit status 2 for each.
TRAIN_ERRORS = [
  # --data: verbatim, must exist, once
  (["--data", "nope"], r"--data: data path 'nope' does not exist"),
  (["--data", ""], r"--data got an empty path"),
  (["--data", "null", "data.path=null"], r"--data and the override data\.path= both set the data path"),
  # overrides: each key once, a value, no YAML comment, key=value form
  (["num_steps=3", "num_steps=5"], r"override 'num_steps' is given twice"),
  (["model={d_model: 64}", "model.d_model=32"], r"override 'model\.d_model' is given twice"),
  (["model.d_model=32", "model={d_model: 64}"], r"override 'model' is given twice"),
  (["seed=1", "seed.x=2"], r"override 'seed\.x': 'seed' is already given as a value"),
  (["workdir=runs/a #2"], r"override workdir='runs/a #2': YAML reads the text after ' #' as a comment"),
  (["data.path=my text #2.txt"], r"YAML reads the text after ' #' as a comment"),
  (["workdir="], r"override workdir='' has no value; write workdir=null"),
  (["model..d_model=3"], r"override key 'model\.\.d_model' has an empty part"),
  (["=3"], r"override must look like key=value, got '=3'"),
  (["num_steps"], r"override must look like key=value, got 'num_steps'"),
  (["model={d_model: 1, d_model: 2}"], r"override model=.*duplicate key 'd_model'"),
  (["mesh_shape=[1"], r"override mesh_shape='\[1' line 1 column 3"),
  # values YAML reads as another type than the schema's: refused, not coerced
  (["workdir=1e3"], r"workdir: Input should be a valid string \(got 1000\.0\)"),
  (
    ["workdir=true"],
    r"workdir: Input should be a valid string \(got True\)",
  ),  # YAML 1.2: 2024-01-01, yes are strings
  (["sample_prompt=true"], r"sample_prompt: Input should be a valid string \(got True\)"),
  (["workdir=''"], r"workdir: String should have at least 1 character"),
  (["data.path=''"], r"data\.path: String should have at least 1 character"),
  (["num_steps=1e3"], r"num_steps: Input should be a valid integer \(got 1000\.0\)"),
  (["num_steps=true"], r"num_steps: Input should be a valid integer \(got True\)"),
  (["learning_rate=true"], r"learning_rate: Input should be a valid number \(got True\)"),
  (["learning_rate=.nan"], r"learning_rate: Input should be a finite number"),
  (["learning_rate=nan"], r"learning_rate: Input should be a valid number"),  # YAML 1.2: the string 'nan'
  (["model.layernorm_eps=-.inf"], r"model\.layernorm_eps: Input should be a finite number"),
  (["data.eval_fraction=1"], r"data\.eval_fraction: Input should be less than 1"),
  (["seed=-1"], r"seed: Input should be greater than or equal to 0"),
  (["seed=18446744073709551616"], r"seed: Input should be less than or equal to 9223372036854775807"),
  (["eval_every=0"], r"eval_every: Input should be greater than 0"),
  (["checkpoint_every=0"], r"checkpoint_every: Input should be greater than 0"),
  (["keep_checkpoints=0"], r"keep_checkpoints: Input should be greater than 0"),
  (["seq_len=1"], r"seq_len: Input should be greater than 1"),
  (
    ["mesh_shape=[]"],
    r"mesh_shape takes 4 sizes \(data, fsdp, tensor, context\), 3 \(data, fsdp, tensor\) or the old 2 "
    r"\(data, model\), got \[\]",
  ),
  (["mesh_shape=[1, 1, 1, 1, 1]"], r"mesh_shape takes 4 sizes"),
  (
    ["mesh_shape=[0, 1, 1]"],
    r"mesh_shape \(data, fsdp, tensor, context\) takes positive sizes and at most one -1",
  ),
  (["mesh_shape=[-1, -1, 1]"], r"takes positive sizes and at most one -1, got \[-1, -1, 1, 1\]"),
  (["mesh_shape=[1, 1, 1, 8]", "seq_len=60"], r"seq_len \(60\) must be divisible by 2 x 8 = 16"),
  (["mesh_shape=[a, 1, 1]"], r"mesh_shape\.0: Input should be a valid integer"),
  (["logical_rules.batch=[]"], r"logical_rules\.batch is an empty list; write null"),
  (["logical_rules.batch=[data, data]"], r"logical_rules\.batch names a mesh axis twice"),
  (["batch_size=6", "grad_accum_steps=4"], r"batch_size \(6\) must be divisible by grad_accum_steps \(4\)"),
  (["model.vocab_size=100"], r"model\.vocab_size \(100\) must be >= 256"),
  (["model.pos_encoding=learned", "seq_len=128"], r"seq_len \(128\) must be <= model\.max_len \(64\)"),
  (["model.d_model=10"], r"d_model \(10\) must be divisible by num_heads"),
  (["sample_prompt=''"], r"sample_prompt must be non-empty when sample_len > 0"),
  (["model.bogus=1"], r"model\.bogus: Extra inputs are not permitted"),
  # huge: refused before any work, naming what to shrink
  (
    ["model.d_model=65536", "model.num_layers=64"],
    # 49,154.6 GiB once; the tests' 8 CPU devices share the host's memory and replicate the state
    r"this run needs at least 393,2\d\d\.\d GiB \(3,298,568,568,832 parameters .* held 8 times: .* make model\.d_model",
  ),
  (["model.vocab_size=100000000"], r"needs at least .* GiB \(6,400,\d{3},\d{3} parameters"),
  (
    ["sample_len=1000000000000"],
    r"sample_len \(1000000000000\) must be <= max\(model\.max_len, 4096\) = 4096",
  ),
  (["sample_len=2000000000", "model.max_len=2000000000"], r"needs at least .* GiB .*sample_len smaller"),
  (["batch_size=1048576", "seq_len=65536"], r"needs at least .* GiB .*seq_len"),
  # files
  (
    ["--config", "dup.yaml"],
    r"config file 'dup\.yaml' line 2 column 1: duplicate key 'seq_len' \(first given on line 1\)",
  ),
  (["--config", "none.yaml"], r"config file 'none\.yaml' does not exist"),
  (["--config", "."], r"config file '\.' is a directory; give a YAML file"),
]


@pytest.mark.parametrize("argv, message", TRAIN_ERRORS, ids=[" ".join(a)[:60] for a, _ in TRAIN_ERRORS])
def test_train_command_line_refuses_in_one_line(train_cli, in_tmp, capsys, monkeypatch, argv, message):
  monkeypatch.setattr(trainer, "train", lambda cfg: pytest.fail(f"trained with {cfg}"))
  base = [] if "--config" in argv else ["--config", TINY]
  assert train_cli.main([*base, *argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("train.py: error: ") and err.count("\n") == 1, err
  assert re.search(message, err), err


# Refused at the start of the run (they depend on the devices: 8 fake CPU devices here), before a step.
START_ERRORS = [
  (
    ["mesh_shape=[3, 1, 1]"],
    r"mesh_shape \[3, 1, 1, 1\] does not fit 8 devices \(data \* fsdp \* tensor \* context must equal 8",
  ),
  (["mesh_shape=[1, 1, 8]"], r"num_heads \(4\) must be divisible by the mesh axes \['tensor'\] \(size 8\)"),
  (["grad_accum_steps=8"], r"batch_size / grad_accum_steps \(1\) must be divisible by the mesh axes"),
  (["batch_size=4096"], r"held-out data has [\d]+ bytes, fewer than batch_size \* seq_len"),
  (
    ["seq_len=60000", "model.max_len=60000"],
    r"held-out data has [\d]+ bytes, fewer than batch_size \* seq_len",
  ),
]


@pytest.mark.parametrize("argv, message", START_ERRORS, ids=[" ".join(a)[:60] for a, _ in START_ERRORS])
def test_train_refuses_at_start_what_depends_on_devices_and_data(
  train_cli, tmp_path, text_file, capsys, argv, message
):
  base = ["--config", TINY, "--data", text_file, f"workdir={tmp_path / 'w'}", "batch_size=8", "sample_len=0"]
  base = [a for a in base if a.split("=")[0] not in {b.split("=")[0] for b in argv}]
  with jax.numpy_dtype_promotion("standard"):
    assert train_cli.main([*base, *argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("train.py: error: ") and err.count("\n") == 1, err
  assert re.search(message, err), err
  assert not (tmp_path / "w" / "checkpoints" / "1").exists()


STUDY_ERRORS = [
  (["--data", "nope"], r"--data: data path 'nope' does not exist"),
  (["--data", "null", "train.data.path=x"], r"--data and the override train\.data\.path= both set"),
  (["train.num_steps=3", "train.num_steps=4"], r"override 'train\.num_steps' is given twice"),
  (
    ["--config", "dup_study.yaml"],
    r"study config 'dup_study\.yaml' line 4 column 3: duplicate key 'seq_len'",
  ),
  (["train.data.path=a #b"], r"YAML reads the text after ' #' as a comment"),
  (["eval_windows=1"], r"eval_windows: Input should be greater than 1"),
  (["encodings=[]"], r"encodings must be distinct names"),
  (["encodings=[rope, rope]"], r"encodings must be distinct names"),
  (["eval_multiples=[1, 3, 4]"], r"eval_multiples must start at 1, increase, and each divide the next"),
  (["train.model.d_model=65536", "train.model.num_layers=64"], r"this run needs at least .* GiB"),
]


@pytest.mark.parametrize("argv, message", STUDY_ERRORS, ids=[" ".join(a)[:60] for a, _ in STUDY_ERRORS])
def test_study_command_line_refuses_in_one_line(study_cli, in_tmp, capsys, monkeypatch, argv, message):
  monkeypatch.setattr(study_cli, "run_study", lambda s: pytest.fail(f"ran {s}"))
  assert study_cli.main([*argv, "--quick"] if "--config" not in argv else argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("study.py: error: ") and err.count("\n") == 1, err
  assert re.search(message, err), err


@pytest.mark.parametrize("name", ["null", "~", "my text #2.txt", "yes", "[1, 2]"])
def test_data_is_a_path_taken_verbatim_by_both_command_lines(train_cli, study_cli, in_tmp, monkeypatch, name):
  """--data null / '~' trained on the built-in corpus and 'my text #2.txt' on the file 'my text'."""
  seen = {}
  monkeypatch.setattr(memory_check, "check_fits_memory", lambda cfg: None)  # tested above; costs a trace

  def capture(cfg):
    seen["train"] = cfg
    raise run_guard.RunError("captured")

  monkeypatch.setattr(trainer, "train", capture)
  assert train_cli.main(["--config", TINY, "--data", name]) == 2
  assert seen["train"].data.path == name and Path(seen["train"].data.path).read_text().startswith("text of")

  def capture_study(s):
    seen["study"] = s
    raise run_guard.RunError("captured")

  monkeypatch.setattr(study_cli, "run_study", capture_study)
  assert study_cli.main(["--quick", "--data", name]) == 2
  assert seen["study"].train.data.path == name


def _leaves(model: type[pydantic.BaseModel], prefix: str = ""):
  """(dotted key, field) for every leaf key of the schema (sections are walked into)."""
  for name, field in model.model_fields.items():
    args = typing.get_args(field.annotation) or (field.annotation,)
    sections = [a for a in args if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
    if sections:
      yield from _leaves(sections[0], f"{prefix}{name}.")
    else:
      yield f"{prefix}{name}", field


def _hostile(field) -> list[str]:
  """Override values outside ``field``'s declared type and range (read from the schema: the
  contract table's 'accepted' column)."""
  args = set(typing.get_args(field.annotation)) | {field.annotation}
  values = []
  if str not in args:
    values.append("'text'")  # a quoted string where no string is accepted
  if str in args or typing.get_origin(field.annotation) is typing.Literal:
    values.append("[1, 2]")
  if bool in args:
    values.append("2")
  for meta in field.metadata:
    if isinstance(meta, annotated_types.Gt):
      values.append(str(meta.gt))
    if isinstance(meta, annotated_types.Ge):
      values.append(str(meta.ge - (1 if int in args and float not in args else 1e-3)))
    if isinstance(meta, annotated_types.Lt):
      values.append(str(meta.lt))
    if isinstance(meta, annotated_types.Le):
      values.append(str(meta.le + 1))
  if float in args:
    values += [".nan", ".inf", "-.inf"]
  if int in args and float not in args:
    values.append("1.5")
  return values


CASES = [(key, value) for key, field in _leaves(TrainConfig) for value in _hostile(field)]


def test_the_walk_covers_every_key():
  keys = {key for key, _ in CASES}
  assert {"seed", "seq_len", "data.eval_fraction", "model.d_model", "model.rope_scaling.factor"} <= keys
  assert {"distributed.process_id", "logical_rules.batch", "mesh_shape", "sample_prompt", "workdir"} <= keys
  assert len(keys) == len(list(_leaves(TrainConfig)))


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_every_config_key_refuses_values_outside_its_range_naming_the_key(key, value):
  with pytest.raises(ValueError) as info:
    load_config(None, [f"{key}={value}"])
  line = run_guard.one_line(info.value)
  assert key.split(".")[-1] in line and "\n" not in line, line


@pytest.mark.parametrize(
  "fn, args, error, message",
  [
    (parse_overrides, ("num_steps=3",), TypeError, r"overrides must be a list of 'key=value' strings"),
    (parse_overrides, ([3],), TypeError, r"overrides must be strings 'key=value', got int 3"),
    (parse_overrides, (["a=1", "a=2"],), None, None),  # the library: a later value replaces (scripts layer)
    (load_config, (None, "seed=1"), TypeError, r"overrides must be a list"),
    (load_config, (None, ["seed=1", "seed.x=2"]), ValueError, r"'seed' is not a section"),
    (data.load_corpus, (None,), TypeError, None),  # keyword-only sizes
    (data.scan_corpus, ("",), ValueError, r"data path is empty"),
    (data.scan_corpus, (3,), TypeError, r"data path must be a string, got int"),
    (data.scan_corpus, ("/nonexistent/x",), FileNotFoundError, r"data path '/nonexistent/x' does not exist"),
    (config_lib.with_data_path, ({}, 3), TypeError, r"--data takes a path string, got int"),
    (study.load_study_config, ("nope.yaml",), FileNotFoundError, r"study config 'nope.yaml' does not exist"),
  ],
)
def test_library_entry_points(fn, args, error, message):
  if error is None:
    fn(*args)
    return
  with pytest.raises(error, match=message):
    fn(*args)


@pytest.mark.parametrize(
  "max_bytes, eval_fraction, error, message",
  [
    (0, 0.1, ValueError, r"max_bytes must be > 0, got 0"),
    (-5, 0.1, ValueError, r"max_bytes must be > 0"),
    (1.5, 0.1, TypeError, r"max_bytes must be an int, got float"),
    (True, 0.1, TypeError, r"max_bytes must be an int, got bool"),
    (100, 0.0, ValueError, r"eval_fraction must be in \(0, 1\), got 0.0"),
    (100, 1.0, ValueError, r"eval_fraction must be in \(0, 1\)"),
    (100, float("nan"), ValueError, r"eval_fraction must be in \(0, 1\), got nan"),
    (100, "0.1", TypeError, r"eval_fraction must be a float, got str"),
  ],
)
def test_load_corpus_sizes(text_file, max_bytes, eval_fraction, error, message):
  with pytest.raises(error, match=message):
    data.load_corpus(text_file, max_bytes=max_bytes, eval_fraction=eval_fraction)


def test_a_data_directory_is_read_by_content_reported_and_a_deleted_workdir_stops_the_run(
  train_cli, tmp_path, text_file, monkeypatch, capsys
):
  """One tiny real run: --data DIR trains on every text file whatever its name (Apache-2.0, LGPL-2.1,
  .html, .json were skipped without a word), says what went where, and the workdir deleted after
  step 1 stops the run with one line and status 2 (was exit 0, later metrics lost, the lock gone)."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  text = Path(text_file).read_bytes()
  names = ["Apache-2.0", "LGPL-2.1", "page.html", "table.json", "notes"]
  for i, name in enumerate(names):
    (corpus / name).write_bytes(text[i * 6000 : (i + 1) * 6000])
  (corpus / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 10)
  workdir = tmp_path / "run"
  batch = data.train_batch

  def delete_after_step_1(*args, step, **kwargs):
    if step == 1:  # the batch of step 2: step 1 is written
      shutil.rmtree(workdir)
    return batch(*args, step=step, **kwargs)

  monkeypatch.setattr(data, "train_batch", delete_after_step_1)
  argv = ["--config", TINY, "--data", str(corpus), f"workdir={workdir}", "num_steps=3", "sample_len=0"]
  argv += [
    "seq_len=16",
    "batch_size=8",
    "eval_every=100",
    "eval_batches=1",
    "model.d_model=32",
    "model.num_layers=1",
  ]
  with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 steps
    assert train_cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert f"data: {corpus}: 5 text files" in out, out
  assert re.search(r"training: [\d,]+ bytes from \d files", out) and "held-out: " in out
  assert "skipped 1: 1 binary (image.png)" in out, out
  found = data.load_corpus(str(corpus), max_bytes=2_000_000, eval_fraction=0.05)
  assert sorted(f.name for f, _ in found.train_files + found.held_files) == sorted(names)
  assert found.train.size + found.eval.size == 5 * 6000
  assert err.strip().splitlines()[-1] == (
    f"train.py: error: workdir {str(workdir)!r} was deleted, moved or replaced during the run (its "
    "metrics.jsonl is gone or another file); stopped at step 2 without writing more (the last checkpoint, "
    "if it still exists, resumes the run)"
  ), err
  assert not workdir.exists()  # not recreated by a later checkpoint


_EXIT_STRESS = r"""
import asyncio, importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("run_guard", sys.argv[1])
run_guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_guard)
loop = asyncio.new_event_loop()
loop.close()

class Callback:  # like tensorstore's: its finaliser calls into the closed loop of a failed write
  def __del__(self):
    loop.call_soon_threadsafe(print)

def noise():
  while True:
    Callback()

def body():
  for _ in range(4):
    threading.Thread(target=noise, daemon=True).start()
  Callback()
  raise ValueError("could not write checkpoint step 2")

run_guard.exit_process(run_guard.run_cli("train.py", body))
"""


def test_a_failed_run_prints_exactly_its_one_line_while_background_threads_raise(tmp_path):
  """The flaky fault test's cause: background threads printing 'Event loop is closed' tracebacks
  around the error line. Four threads raise them without pause while the run fails and exits; 10
  processes, each must print exactly the one line (was a traceback fragment glued to it)."""
  script = tmp_path / "stress.py"
  script.write_text(_EXIT_STRESS)
  env = dict(os.environ, PYTHONPATH="")
  for _ in range(10):
    proc = subprocess.run(
      [sys.executable, str(script), str(ROOT / "jaxpe" / "train" / "run_guard.py")],
      capture_output=True,
      text=True,
      timeout=60,
      env=env,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "train.py: error: could not write checkpoint step 2\n", proc.stderr[:2000]


def test_the_noise_filter_passes_every_other_unraisable_exception(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
  run_guard.drop_closed_event_loop_noise()
  run_guard.drop_closed_event_loop_noise()  # once only

  class Bad:
    def __init__(self, exc):
      self.exc = exc

    def __del__(self):
      raise self.exc

  import asyncio

  loop = asyncio.new_event_loop()
  loop.close()

  class Closed:
    def __del__(self):
      loop.call_soon_threadsafe(print)

  Closed()
  Bad(RuntimeError("Event loop is closed"))  # not from asyncio: passed on
  Bad(ValueError("other"))
  assert [type(e).__name__ + ": " + str(e) for e in seen] == [
    "RuntimeError: Event loop is closed",
    "ValueError: other",
  ]


@pytest.mark.parametrize("kind", ["foreign files", "a file", "under a file"])
def test_a_workdir_holding_other_files_is_refused_and_nothing_is_overwritten(tmp_path, text_file, kind):
  """A directory with config.json / metrics.jsonl / summary.json / loss.png that no jaxpe run wrote was
  trained in, replacing them (found by the reviewer); a workdir that is a file gave a raw errno 17."""
  work = tmp_path / "w"
  if kind == "a file":
    work.write_text("USER")
    before = {work: "USER"}
    message = r"workdir '.*w' exists and is not a directory"
  elif kind == "under a file":  # gave a raw errno 20 after reading the data
    work.write_text("USER")
    before = {work: "USER"}
    work = work / "sub"
    message = r"workdir '.*w/sub': its parent '.*w' is a file, not a directory"
  else:
    work.mkdir()
    before = {work / n: f"USER {n}" for n in (*run_files.RUN_FILES, "notes.txt")}
    message = r"workdir '.*w' holds config\.json, metrics\.jsonl, summary\.json, loss\.png but no jaxpe run"
  for path, text in before.items():
    path.write_text(text)
  cfg = load_config(TINY, [f"workdir={work}", "num_steps=1"], data_path=text_file)
  with pytest.raises(ValueError, match=message):
    trainer.train(cfg, progress=False)
  assert {p: p.read_text() for p in before} == before
  assert not (tmp_path / "w").is_dir() or not (tmp_path / "w" / "checkpoints").exists()
