"""Numpy integers wherever ints are taken (issue 48, kind 6c: ``isinstance(x, int)`` refused
``np.int64``, the result of numpy arithmetic, as out of range).

Every member goes through ``jaxpe.ops.checks.is_int`` (a Python int or a numpy integer, not a bool);
each is called with numpy integers and compared with the same call on Python ints, and bools stay
refused.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe import rope_from_hf_config
from jaxpe.attention import dot_product_attention, flash
from jaxpe.attention.masks import AttentionMask
from jaxpe.bloom import config_from_hf
from jaxpe.emulation import apply_rope_alibi
from jaxpe.ops import checks
from jaxpe.train import data, tasks
from jaxpe.train.data_config import TaskConfig

INTS = [np.int64, np.int32, np.uint16]


@pytest.mark.parametrize("kind", INTS)
def test_task_lengths(kind):
  for task in (TaskConfig(name="mqar"), TaskConfig(name="copy"), TaskConfig(name="flipflop")):
    np.testing.assert_array_equal(tasks.sample(task, kind(16), [0, 1]), tasks.sample(task, 16, [0, 1]))
    tasks.check_task_length(task, kind(16), "seq_len")
  with pytest.raises(ValueError, match=r"length must be an int"):
    tasks.sample(TaskConfig(name="copy"), True, [0])


@pytest.mark.parametrize("kind", INTS)
def test_attention_sizes(kind):
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32) for _ in range(3))
  want = dot_product_attention(q, k, v, is_causal=True, causal_block=4, precise_dims=0)
  got = dot_product_attention(q, k, v, is_causal=True, causal_block=kind(4), precise_dims=kind(0))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="causal_block must be an int"):
    dot_product_attention(q, k, v, is_causal=True, causal_block=True)
  mask = AttentionMask(causal=True)
  fl = flash.attend(q, k, v, scale=0.5, mask=mask, interpret=True, block=kind(8))
  np.testing.assert_allclose(
    np.asarray(fl), np.asarray(flash.attend(q, k, v, scale=0.5, mask=mask, interpret=True, block=8))
  )


@pytest.mark.parametrize("kind", INTS)
def test_emulation_pad_multiple(kind):
  rng = np.random.default_rng(1)
  q, k = (jnp.asarray(rng.normal(size=(1, 4, 2, 6)), jnp.float32) for _ in range(2))
  pos = jnp.arange(4)[None]
  kw = dict(slopes=(0.5, 0.25), theta=0.01)
  for a, b in zip(
    apply_rope_alibi(q, k, pos, pos, pad_multiple=kind(8), **kw),
    apply_rope_alibi(q, k, pos, pos, pad_multiple=8, **kw),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", INTS)
def test_configs_read_from_numpy(kind):
  hf = {
    "model_type": "llama",
    "head_dim": kind(64),
    "hidden_size": kind(256),
    "num_attention_heads": kind(4),
    "rope_theta": 10000.0,
  }
  ref = {
    "model_type": "llama",
    "head_dim": 64,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "rope_theta": 10000.0,
  }
  np.testing.assert_array_equal(
    np.asarray(rope_from_hf_config(hf).frequencies()[0]),
    np.asarray(rope_from_hf_config(ref).frequencies()[0]),
  )
  bloom = {"model_type": "bloom", "vocab_size": 300, "hidden_size": 64, "n_layer": 2, "n_head": 4}
  assert config_from_hf({**bloom, "n_head": kind(4), "n_layer": kind(2)}) == config_from_hf(bloom)


def test_load_corpus_and_study_counts(tmp_path):
  from jaxpe import study
  from jaxpe.train.cli import resolve_config

  (tmp_path / "a.txt").write_text("hello world " * 200)
  got = data.load_corpus(str(tmp_path / "a.txt"), max_bytes=np.int64(1000), eval_fraction=0.5)
  want = data.load_corpus(str(tmp_path / "a.txt"), max_bytes=1000, eval_fraction=0.5)
  np.testing.assert_array_equal(got.train, want.train)
  cfg = study.load_study_config(resolve_config("study_quick"), [])
  assert study.model_train_config(cfg, "rope", np.int64(0)) == study.model_train_config(cfg, "rope", 0)
  assert checks.is_int(np.uint8(3)) and not checks.is_int(np.bool_(True)) and not checks.is_int(True)
