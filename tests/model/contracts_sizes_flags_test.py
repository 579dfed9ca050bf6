"""Argument contracts above the attention layer (issue 39, kinds 1 and 6; docs/contracts.md, "Flags,
sizes, empty inputs, array coercion, on/off settings"): the KV cache's size is checked before it is
allocated (``init_cache``, ``generate``), ``sample_len`` is bounded by the model's context at
config time, and the flags of the model, train, study and BLOOM entry points refuse non-bools.
The attention layer's members: tests/attention/contracts_arguments_test.py."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxpe.ops as ops
from jaxpe.bloom import config_from_hf
from jaxpe.model import Decoder, init_cache
from jaxpe.model.config import ModelConfig
from jaxpe.model.generate import generate
from jaxpe.ops import checks
from jaxpe.study import cell, finetuned_params, run_retrieval, run_study
from jaxpe.train import checkpoint, trainer
from jaxpe.train.config import load_config

FALCON = {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 64}
DEEPSEEK_V3 = {  # an MLA config: its trailing rope dims rotate interleaved pairs unless rope_interleave=false
  "model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 2, "qk_rope_head_dim": 8,
  "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 64, "rope_theta": 10000.0,
}  # fmt: skip
CFG = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, max_len=32, pos_encoding="rope")


def cache_bytes(batch, slots):
  """Closed form for CFG: per slot L = 2 layers x K = 2 kv heads x (8 + 8) float32 key and value
  dims, plus an int32 position and a bool."""
  return batch * slots * (2 * 2 * 16 * 4 + 4 + 1)


@pytest.fixture(scope="module")
def model():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def test_cache_bytes_is_what_init_cache_allocates():
  from jaxpe.model import cache

  allocated = sum(x.nbytes for x in jax.tree.leaves(init_cache(CFG, 3, 7)) if x.ndim)
  assert cache.cache_bytes(CFG, 3, 7) == allocated == cache_bytes(3, 7)


def test_init_cache_refuses_a_cache_larger_than_the_device(monkeypatch):
  with pytest.raises(ValueError, match=r"max_len must be <= 2147483647, got 2147483648"):
    init_cache(CFG, 1, 2**31)
  # 2^30 slots x 2^10 rows: 2^40 x 261 bytes, more than any device has; refused before allocation
  with pytest.raises(
    ValueError, match=r"^max_len: a KV cache of B = 1024 x S = 1073741824 slots needs .* GiB, more than"
  ):
    init_cache(CFG, 2**10, 2**30)
  monkeypatch.setattr(checks, "device_memory_bytes", lambda: cache_bytes(2, 8))
  init_cache(CFG, 2, 8)  # exactly the memory: accepted
  with pytest.raises(ValueError, match=r"give a smaller max_len or batch_size"):
    init_cache(CFG, 2, 9)


def test_generate_refuses_max_new_tokens_whose_cache_cannot_be_allocated(model, monkeypatch):
  prompt = jnp.asarray([[1, 2, 3]], jnp.int32)
  # T + max_new_tokens = 2^31 - 1: int32 positions hold it, the cache (512 GiB) does not fit
  with pytest.raises(
    ValueError, match=r"^max_new_tokens: a KV cache of B = 1 x S = 2147483647 slots needs 5"
  ):
    generate(model, prompt, max_new_tokens=2**31 - 4)
  monkeypatch.setattr(checks, "device_memory_bytes", lambda: cache_bytes(1, 100))
  with pytest.raises(ValueError, match=r"T \+ max_new_tokens = 3 \+ 98 slots per row: generate fewer tokens"):
    generate(model, prompt, max_new_tokens=98)
  out = generate(model, prompt, max_new_tokens=4)  # fits: runs
  assert out.shape == (1, 4)


@pytest.mark.parametrize("sample_len, ok", [(0, True), (4096, True), (4097, False), (1_000_000, False)])
def test_sample_len_is_bounded_at_config_time(sample_len, ok):
  # max(model.max_len, 4096): the default model.max_len is 256; 10^6 bytes hung after training
  if ok:
    assert load_config(None, [f"sample_len={sample_len}"]).sample_len == sample_len
  else:
    with pytest.raises(
      ValueError, match=rf"sample_len \({sample_len}\) must be <= max\(model.max_len, 4096\) = 4096"
    ):
      load_config(None, [f"sample_len={sample_len}"])
  assert load_config(None, ["sample_len=10000", "model.max_len=10000"]).sample_len == 10000


FLAGS = [
  (lambda x: trainer.train(None, progress=x), "progress"),
  (lambda x: run_study(None, progress=x), "progress"),
  (lambda x: run_retrieval(None, None, progress=x), "progress"),
  (lambda x: finetuned_params(None, "rope_pi_ft", 0, progress=x), "progress"),
  (lambda x: cell({"bits_per_byte": 1.0, "ci95": 0.1}, signed=x), "signed"),
  (lambda x: checkpoint.manager("/nonexistent/ckpt", async_save=x), "async_save"),
  (lambda x: checkpoint.manager("/nonexistent/ckpt", read_only=x), "read_only"),
  (lambda x: ops.rope_from_hf_config({**FALCON, "alibi": x}), "config alibi"),
  (lambda x: ops.rope_from_hf_config({**DEEPSEEK_V3, "rope_interleave": x}), "config rope_interleave"),
  (lambda x: config_from_hf({"model_type": "bloom", "tie_word_embeddings": x}), "config tie_word_embeddings"),
  (
    lambda x: config_from_hf({"model_type": "bloom", "apply_residual_connection_post_layernorm": x}),
    "config apply_residual",
  ),
]


@pytest.mark.parametrize("value", ["False", "no", 0])
@pytest.mark.parametrize("call, name", FLAGS, ids=[f"{i}-{n}" for i, (_, n) in enumerate(FLAGS)])
def test_a_flag_is_a_bool_not_a_truth_value(call, name, value):
  if name.startswith("config rope"):
    assert ops.rope_from_hf_config({**DEEPSEEK_V3, "rope_interleave": False}).layout == "half"
    assert ops.rope_from_hf_config(DEEPSEEK_V3).layout == "interleaved"
  with pytest.raises(TypeError, match=rf"^{name}\w* must be a bool, got"):
    call(value)


@pytest.mark.parametrize("key", ["layer_norm_epsilon", "initializer_range"])
@pytest.mark.parametrize("value", [True, "1e-5", "abc", [1e-5]])
def test_bloom_config_numbers_are_json_numbers(key, value):
  # float(True) was 1.0 (a LayerNorm eps of 1 without a word); float("abc") a raw ValueError
  with pytest.raises(TypeError, match=rf"^config {key} must be a number, got"):
    config_from_hf({"model_type": "bloom", key: value})
  assert (
    config_from_hf({"model_type": "bloom", key: 0.25}).model_dump()[
      "layernorm_eps" if key == "layer_norm_epsilon" else "init_std"
    ]
    == 0.25
  )
