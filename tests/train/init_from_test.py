"""``init_from`` (a run started from another run's parameters): a fresh run holds exactly the source
checkpoint's parameters (against the arrays read back from the source's checkpoint with numpy), in
their shardings on a sharded mesh, with a fresh optimizer; a resume takes the run's own checkpoint
(the source is not read); the errors name ``init_from`` (other shapes, a missing source, the run's own
workdir, a changed ``init_from`` on resume); a config without it dumps as before (no key); on resume
``init_from`` and ``data.path`` compare as the path they name however written (``run_checks.PATH_KEYS``)."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpe.errors import CheckpointError
from jaxpe.train import checkpoint, load, run_checks, sharding, state, trainer
from jaxpe.train.config import TrainConfig, load_config

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _cfg(workdir, *extra) -> TrainConfig:
  return load_config(
    None,
    [
      f"workdir={workdir}",
      "data.task={name: copy, num_symbols: 16}",
      "model.vocab_size=18",
      "seq_len=16",
      "batch_size=8",
      "num_steps=4",
      "warmup_steps=1",
      "eval_every=4",
      "eval_batches=1",
      "checkpoint_every=4",
      "sample_len=0",
      "model.d_model=16",
      "model.num_layers=2",
      "model.num_heads=2",
      "model.max_len=16",
      *extra,
    ],
  )


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A finished 4-step run and its parameters as saved, read back from the checkpoint directly."""
  workdir = tmp_path_factory.mktemp("init_from") / "source"
  cfg = _cfg(workdir)
  with jax.numpy_dtype_promotion("standard"):
    trainer.train(cfg, progress=False)
  mngr = checkpoint.manager(workdir / "checkpoints", read_only=True)
  _, abstract = state.abstract_state(cfg, sharding.make_mesh((-1, 1, 1, 1)))
  saved, meta = checkpoint.restore_latest(mngr, abstract)
  mngr.close()
  params = {
    ".".join(map(str, k)): np.asarray(v[...])
    for k, v in nnx.to_flat_state(nnx.filter_state(saved[0], nnx.Param))
  }
  return workdir, params, meta["step"]


def _model_params(st) -> dict[str, np.ndarray]:
  return {
    ".".join(map(str, k)): np.asarray(v[...])
    for k, v in nnx.to_flat_state(nnx.filter_state(st[0], nnx.Param))
  }


def _fresh(cfg, mesh_shape=(-1, 1, 1, 1)):
  mesh = sharding.make_mesh(mesh_shape)
  with checkpoint.manager(Path(cfg.workdir) / "checkpoints") as mngr:
    return state.restore_or_create(cfg, mngr, mesh, saved_config=None, fingerprint={"sha256": "x"})


def test_a_fresh_run_starts_from_the_source_parameters_on_a_sharded_mesh(source, tmp_path):
  workdir, params, step = source
  assert step == 4
  cfg = _cfg(tmp_path / "run", f"init_from={workdir}", "mesh_shape=[2, 2, 2, 1]")
  run, shardings, meta = _fresh(cfg, cfg.mesh_shape)
  assert meta is None and run.step == 0 and run.init_from == {"path": str(workdir), "step": 4}
  got = _model_params(run.state)
  assert got.keys() == params.keys()
  for name in params:
    np.testing.assert_array_equal(got[name], params[name], err_msg=name)
  random = _model_params(state.create_state(_cfg(tmp_path / "other"), sharding.make_mesh((-1, 1, 1, 1)))[1])
  assert any(not np.array_equal(random[n], params[n]) for n in params)  # the check can fail
  # in their shardings (fsdp x tensor splits the projections), and the optimizer is a fresh one
  flat_sh = dict(nnx.to_flat_state(nnx.filter_state(shardings[0], nnx.Param)))
  split = 0
  for path, var in nnx.to_flat_state(nnx.filter_state(run.state[0], nnx.Param)):
    assert var[...].sharding == flat_sh[path].get_value(), path
    split += len({str(s.index) for s in var[...].addressable_shards}) > 1
  assert split > 0
  opt = run.state[1]
  assert int(np.asarray(opt["step"][...])) == 0
  moments = [np.asarray(x) for x in jax.tree.leaves(opt["opt_state"]) if np.ndim(x) > 0]
  assert moments and all(not m.any() for m in moments)


def test_a_scanned_run_starts_from_a_loop_source(source, tmp_path):
  workdir, params, _ = source
  run, _, _ = _fresh(_cfg(tmp_path / "scan", f"init_from={workdir}", "model.scan_layers=true"))
  got = _model_params(run.state)
  for name, value in got.items():
    if name.startswith("blocks."):
      rest = name.removeprefix("blocks.")
      for i in range(2):
        np.testing.assert_array_equal(value[i], params[f"blocks.{i}.{rest}"], err_msg=name)
    else:
      np.testing.assert_array_equal(value, params[name], err_msg=name)


def test_training_records_the_source_and_a_resume_takes_its_own_checkpoint(source, tmp_path):
  workdir, params, _ = source
  copy = tmp_path / "copy_of_source"
  shutil.copytree(workdir, copy)
  cfg = _cfg(tmp_path / "run", f"init_from={copy}", "num_steps=2", "checkpoint_every=2")
  with jax.numpy_dtype_promotion("standard"):
    result = trainer.train(cfg, progress=False)
  assert result.run["init_from"] == {"path": str(copy), "step": 4}
  assert json.loads((tmp_path / "run" / "config.json").read_text())["init_from"] == str(copy)
  mngr = checkpoint.manager(tmp_path / "run" / "checkpoints", read_only=True)
  _, abstract = state.abstract_state(cfg, sharding.make_mesh((-1, 1, 1, 1)))
  saved, meta = checkpoint.restore_latest(mngr, abstract)
  mngr.close()
  assert meta["step"] == 2 and meta["init_from"] == {"path": str(copy), "step": 4}
  own = _model_params(saved)
  assert any(not np.array_equal(own[n], params[n]) for n in params)  # trained on from the source
  shutil.rmtree(copy)  # a resume never reads the source
  resumed = cfg.model_copy(update={"num_steps": 3})
  with checkpoint.manager(tmp_path / "run" / "checkpoints") as mngr:
    run, _, meta = state.restore_or_create(
      resumed,
      mngr,
      sharding.make_mesh((-1, 1, 1, 1)),
      saved_config=None,
      fingerprint=meta["data_fingerprint"],
    )
  assert meta["step"] == 2 and run.step == 2 and run.init_from == {"path": str(copy), "step": 4}
  got = _model_params(run.state)
  for name in own:
    np.testing.assert_array_equal(got[name], own[name], err_msg=name)


def test_the_errors_name_init_from(source, tmp_path):
  workdir, _, _ = source
  with pytest.raises(
    ValueError, match=r"init_from .* has shape \(18, 16\) there, this model's is \(20, 16\)"
  ):
    _fresh(_cfg(tmp_path / "a", f"init_from={workdir}", "model.vocab_size=20"))
  with pytest.raises(ValueError, match=r"parameter 'embed.embedding'"):
    _fresh(_cfg(tmp_path / "a", f"init_from={workdir}", "model.vocab_size=20"))
  with pytest.raises(ValueError, match=r"init_from .* other parameters .* missing \['blocks.2"):
    _fresh(_cfg(tmp_path / "b", f"init_from={workdir}", "model.num_layers=3"))
  with pytest.raises(FileNotFoundError, match=r"init_from '.*nowhere': no such directory"):
    load.init_source(_cfg(tmp_path / "c", f"init_from={tmp_path / 'nowhere'}"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"init_from '.*empty': no config.json"):
    load.init_source(_cfg(tmp_path / "c", f"init_from={tmp_path / 'empty'}"))
  (tmp_path / "no_ckpt").mkdir()
  shutil.copy(workdir / "config.json", tmp_path / "no_ckpt" / "config.json")
  with pytest.raises(FileNotFoundError, match=r"init_from '.*no_ckpt': no checkpoint in"):
    load.init_source(_cfg(tmp_path / "c", f"init_from={tmp_path / 'no_ckpt'}"))
  damaged = tmp_path / "damaged"
  shutil.copytree(workdir, damaged)
  for f in (damaged / "checkpoints").rglob("*"):
    if f.is_file() and "metadata" not in f.name:
      f.write_bytes(b"x")
  with pytest.raises(CheckpointError, match=r"init_from '.*damaged': no intact checkpoint"):
    _fresh(_cfg(tmp_path / "c", f"init_from={damaged}"))  # through the run's start
  with pytest.raises(ValueError, match=r"init_from '.*self/' is this run's own workdir"):
    _cfg(tmp_path / "self", f"init_from={tmp_path / 'self'}/")


def test_init_from_is_run_defining_and_absent_from_old_configs(tmp_path):
  plain = _cfg(tmp_path / "r")
  assert "init_from" not in plain.model_dump() and "init_from" not in json.loads(plain.model_dump_json())
  saved = plain.model_dump_json()  # a config.json of before the key (no init_from) reads as None
  run_checks.check_resume_config(saved, plain)
  with pytest.raises(ValueError, match=r"init_from: None -> '.*elsewhere'"):
    run_checks.check_resume_config(saved, _cfg(tmp_path / "r", f"init_from={tmp_path / 'elsewhere'}"))
  started = _cfg(tmp_path / "r", f"init_from={tmp_path / 'a'}")
  with pytest.raises(ValueError, match=r"init_from: '.*a' -> '.*b'"):
    run_checks.check_resume_config(
      started.model_dump_json(), _cfg(tmp_path / "r", f"init_from={tmp_path / 'b'}")
    )
  assert TrainConfig.model_validate_json(started.model_dump_json()) == started


def test_init_from_compares_as_a_directory_however_written(tmp_path, monkeypatch):
  # a resume (and the study's finished-model check) with init_from written another way: relative vs
  # absolute, ./, a trailing slash, through a symlink; the run's own workdir through a symlink is refused
  (tmp_path / "runs" / "src").mkdir(parents=True)
  (tmp_path / "link").symlink_to(tmp_path / "runs" / "src")
  monkeypatch.chdir(tmp_path)
  saved = _cfg("runs/r", "init_from=runs/src").model_dump_json()
  for spelling in ("./runs/src", "runs/src/", str(tmp_path / "runs" / "src"), "link", "runs/../runs/src"):
    run_checks.check_resume_config(saved, _cfg("runs/r", f"init_from={spelling}"))
  with pytest.raises(ValueError, match=r"init_from: 'runs/src' -> 'runs/other'"):
    run_checks.check_resume_config(saved, _cfg("runs/r", "init_from=runs/other"))
  with pytest.raises(ValueError, match=r"init_from: 'runs/src' -> None"):  # removed on resume
    run_checks.check_resume_config(saved, _cfg("runs/r"))
  with pytest.raises(ValueError, match=r"init_from 'link' is this run's own workdir"):
    _cfg("runs/src", "init_from=link")


def test_data_path_compares_as_a_path_on_resume(tmp_path, monkeypatch):
  # the other path key of the resume check (run_checks.PATH_KEYS): data.path written another way
  (tmp_path / "corpus").mkdir()
  monkeypatch.chdir(tmp_path)

  def cfg(path):
    return load_config(None, ["workdir=runs/r", f"data.path={path}"])

  saved = cfg("corpus").model_dump_json()
  for spelling in ("./corpus", "corpus/", str(tmp_path / "corpus")):
    run_checks.check_resume_config(saved, cfg(spelling))
  with pytest.raises(ValueError, match=r"data.path: 'corpus' -> 'other'"):
    run_checks.check_resume_config(saved, cfg("other"))
