"""Issue 47: ``ModelConfig``'s attention-pattern keys (``jaxpe.model.pattern_options``): the
per-layer types, HF's window convention, the refusals naming the key, reading them from the six
families' transformers configs (``jaxpe.model.hf_decoder``), Llama 4's attention temperature and
the final logit soft-cap, each against a closed form or transformers' own config classes."""

import importlib

import numpy as np
import pydantic
import pytest
from flax import nnx

from jaxpe.model import Decoder
from jaxpe.model.config import ModelConfig
from jaxpe.model.hf_decoder import config_dict_from_hf, pattern_from_hf_config
from jaxpe.model.llama_layers import temperature_scale


def test_gemma3_pattern_and_hf_window_convention():
  cfg = ModelConfig(num_layers=12, sliding_window_pattern=6, sliding_window=512)
  types = [cfg.layer_pattern(i).layer_type for i in range(12)]
  assert types == (["sliding_attention"] * 5 + ["full_attention"]) * 2
  # transformers' sliding_window = w counts the query: (w - 1, 0) and a ring of w - 1 slots
  assert cfg.layer_pattern(0).local_window_size == (511, 0) and cfg.layer_pattern(0).ring_slots == 511
  assert cfg.layer_pattern(5).local_window_size is None and cfg.layer_pattern(5).ring_slots is None
  mistral = ModelConfig(sliding_window=4)  # only a window: every layer sliding
  assert {mistral.layer_pattern(i).layer_type for i in range(4)} == {"sliding_attention"}
  assert ModelConfig().layer_pattern(0) == ("full_attention", None, None, None, None)  # today's default


@pytest.mark.parametrize(
  "keys, match",
  [
    (dict(layer_types=["full_attention"] * 3), "4\\) entries"),
    (dict(layer_types=["sliding_attention"] * 4), "sliding_attention layers need sliding_window"),
    (dict(layer_types=["full_attention"] * 4, attention_chunk_size=8), "no layer is chunked_attention"),
    (dict(sliding_window=4, attention_chunk_size=8), "need layer_types"),
    (dict(sliding_window_pattern=2, layer_types=["full_attention"] * 4), "not both"),
    (dict(rope_local_base_freq=1e4), "rope_local_base_freq"),
    (dict(attn_temperature_tuning=True), "NoPE"),
    (dict(hidden_act="gelu"), "mlp_type='gated'"),
    (dict(sliding_window_pattern=2, sliding_window=4, scan_layers=True), "scan_layers"),
    (dict(sliding_window=0), "greater than 0"),
    (dict(attn_logit_softcapping=0.0), "greater than 0"),
    (dict(layer_types=["local"] * 4), "full_attention"),
  ],
)
def test_bad_patterns_are_refused_naming_the_key(keys, match):
  with pytest.raises(pydantic.ValidationError, match=match):
    ModelConfig(**keys)


def _tf():
  return importlib.import_module("transformers")


def test_pattern_keys_from_the_six_families():
  tf = _tf()
  gemma2 = pattern_from_hf_config(tf.Gemma2Config(num_hidden_layers=4))
  assert gemma2["layer_types"] == ("sliding_attention", "full_attention") * 2
  assert (gemma2["sliding_window"], gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (
    4096,
    50.0,
    30.0,
  )
  gemma3 = pattern_from_hf_config(
    tf.Gemma3TextConfig(num_hidden_layers=6, rope_scaling={"rope_type": "linear", "factor": 8.0})
  )
  assert gemma3["layer_types"][4:] == ("sliding_attention", "full_attention")
  assert (gemma3["rope_local_base_freq"], gemma3["rope_theta"]) == (10000.0, 1e6)
  assert gemma3["rope_scaling"]["factor"] == 8.0
  oss = pattern_from_hf_config(tf.GptOssConfig(num_hidden_layers=2))
  assert oss["sliding_window"] == 128 and oss["rope_scaling"]["rope_type"] == "yarn"
  llama4 = pattern_from_hf_config(tf.Llama4TextConfig(num_hidden_layers=4))
  assert llama4["layer_types"] == ("chunked_attention",) * 3 + ("full_attention",)
  assert llama4["no_rope_layers"] == (1, 1, 1, 0) and llama4["attention_chunk_size"] == 8192
  assert (llama4["attn_temperature_tuning"], llama4["floor_scale"], llama4["attn_scale"]) == (
    True,
    8192.0,
    0.1,
  )
  assert (
    pattern_from_hf_config(tf.MistralConfig(num_hidden_layers=2, sliding_window=None)).get("layer_types")
    is None
  )
  assert "layer_types" not in pattern_from_hf_config(
    tf.Qwen3Config(num_hidden_layers=2)
  )  # use_sliding_window False
  for c in (gemma2, gemma3, oss, llama4):  # each validates as ModelConfig keys
    ModelConfig(**{**c, "num_layers": len(c["layer_types"])})
  built = config_dict_from_hf(tf.Llama4TextConfig(num_hidden_layers=4))  # built whole (hf_llama4_parity_test)
  assert (built["mlp_type"], built["moe_routing"], built["moe_shared_expert"]) == (
    "moe",
    "sigmoid_input",
    True,
  )
  with pytest.raises(ValueError, match="dense layers among its moe layers"):  # one MLP type per model
    config_dict_from_hf(tf.Llama4TextConfig(num_hidden_layers=4, interleave_moe_layer_step=2))
  with pytest.raises(ValueError, match="model_type"):
    pattern_from_hf_config({"model_type": "llama", "num_hidden_layers": 2})


def test_llama4_temperature_on_nope_layers_only():
  """log1p(floor((slot + 1) / floor_scale)) * attn_scale + 1 (transformers' Llama4TextAttention),
  applied to NoPE layers: with floor_scale 4 the first 3 slots are unchanged, later ones are not."""
  slots = np.arange(12)[None]
  want = np.log1p(np.floor((slots + 1) / 4.0)) * 0.5 + 1
  np.testing.assert_allclose(np.asarray(temperature_scale(slots, 4.0, 0.5))[..., 0, 0], want, rtol=1e-6)
  keys = dict(
    vocab_size=32,
    d_model=32,
    num_layers=2,
    no_rope_layers=(1, 0),
    floor_scale=4.0,
    attn_scale=0.5,
    init_std=0.3,
  )
  tokens = np.random.default_rng(0).integers(0, 32, (1, 12))
  a = np.asarray(Decoder(ModelConfig(**keys), rngs=nnx.Rngs(0))(tokens))
  b = np.asarray(Decoder(ModelConfig(**keys, attn_temperature_tuning=True), rngs=nnx.Rngs(0))(tokens))
  assert np.abs(a - b)[:, :3].max() < 1e-6 and np.abs(a - b)[:, 3:].max() > 1e-4


def test_final_logit_softcapping_is_cap_tanh():
  keys = dict(vocab_size=32, d_model=32, num_layers=1, init_std=0.5)
  tokens = np.arange(8)[None]
  raw = np.asarray(Decoder(ModelConfig(**keys), rngs=nnx.Rngs(0))(tokens), np.float64)
  capped = np.asarray(Decoder(ModelConfig(**keys, final_logit_softcapping=0.5), rngs=nnx.Rngs(0))(tokens))
  np.testing.assert_allclose(capped, 0.5 * np.tanh(raw / 0.5), atol=1e-6)
  assert np.abs(raw).max() > 0.5  # the cap acts


def test_exporters_and_flops_know_the_new_keys():
  """A kind, not one bug: code reading ModelConfig's architecture must not ignore issue 47's keys.
  BLOOM export refuses each by name; the FLOP count counts a gated MLP's third matrix and only the
  keys a windowed or chunked query sees (closed forms)."""
  from jaxpe.bloom.config import ISSUE47_KEYS, check_bloom_compatible
  from jaxpe.train.flops import train_flops_per_token

  bloom = dict(pos_encoding="alibi", use_bias=True, embed_layernorm=True, gelu_approximate=True)
  check_bloom_compatible(ModelConfig(**bloom))
  for key, value in [
    ("norm_type", "rmsnorm"),
    ("sliding_window", 4),
    ("final_logit_softcapping", 3.0),
    ("qk_norm", True),
  ]:
    with pytest.raises(ValueError, match=key):
      check_bloom_compatible(ModelConfig(**bloom, **{key: value}))
  assert {"layer_types", "mlp_type", "scale_embeddings"} <= set(ISSUE47_KEYS)
  base = dict(d_model=32, num_layers=1, num_heads=4, mlp_dim=64, vocab_size=256)
  plain = train_flops_per_token(ModelConfig(**base), 16)
  assert train_flops_per_token(ModelConfig(**base, mlp_type="gated"), 16) - plain == pytest.approx(
    6 * 32 * 64
  )
  # window 4 over T = 16: mean_i min(i + 1, 4) = (1 + 2 + 3 + 13 * 4) / 16 keys instead of 17 / 2
  window = train_flops_per_token(ModelConfig(**base, sliding_window=4), 16)
  assert plain - window == pytest.approx(6 * 4 * 16 * (17 / 2 - 58 / 16))
  chunk = train_flops_per_token(ModelConfig(**base, attention_chunk_size=4), 16)  # 4 chunks: 2.5 keys
  assert plain - chunk == pytest.approx(6 * 4 * 16 * (17 / 2 - 2.5))


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm", "gemma_rmsnorm"])
def test_qk_norm_normalises_each_head_for_every_norm_type(norm_type):
  """A kind: a norm built for another width than D (``qk_norm``'s over H) under every ``norm_type``.
  ``layernorm`` built a ``[D]`` norm and failed at the first forward ("cannot reshape (32,) into (8,)").
  Each norm, fresh (scale 1, bias 0), against its closed form over the head dim in float64."""
  cfg = ModelConfig(
    d_model=32, num_layers=1, num_heads=4, mlp_dim=64, vocab_size=256, qk_norm=True, norm_type=norm_type
  )
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  logits = np.asarray(model(np.arange(6)[None]))
  assert logits.shape == (1, 6, 256) and np.all(np.isfinite(logits))
  x = np.random.default_rng(0).normal(size=(2, 3, 4, 8))
  got = np.asarray(model.blocks[0].attn.q_norm(x.astype(np.float32)), np.float64)
  eps = cfg.layernorm_eps
  if norm_type == "layernorm":
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
  else:
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama4_text", "gpt_oss"])
def test_rope_layout_is_the_one_transformers_rotates(family):
  """Llama 4 rotates adjacent pairs (``view_as_complex``), gpt-oss halves (``torch.chunk``): the
  ``rope_layout`` read from the config, given to ``apply_rope``, gives transformers' own rotation
  of a random q (its rotary embedding and apply function; RoPE without scaling)."""
  import jax.numpy as jnp

  from jaxpe.ops import apply_rope

  torch = importlib.import_module("torch")
  tf = importlib.import_module("transformers")
  small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  small |= dict(intermediate_size=16, vocab_size=64)
  rope = {"rope_type": "default", "rope_theta": 100.0}
  x = np.random.default_rng(0).normal(size=(1, 5, 4, 8)).astype(np.float32)  # [B, T, N, H]
  pos = np.arange(5)[None]
  if family == "llama4_text":
    mod = importlib.import_module("transformers.models.llama4.modeling_llama4")
    cfg = tf.Llama4TextConfig(**small, intermediate_size_mlp=16, rope_parameters=rope)
    freqs = mod.Llama4TextRotaryEmbedding(cfg)(torch.tensor(x), torch.tensor(pos))
    ref = mod.apply_rotary_emb(torch.tensor(x), torch.tensor(x), freqs)[0]
  else:
    mod = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    cfg = tf.GptOssConfig(**small, rope_parameters=rope)
    cos, sin = mod.GptOssRotaryEmbedding(cfg)(torch.tensor(x), torch.tensor(pos))
    ref = mod._apply_rotary_emb(torch.tensor(x), cos[:, :, None], sin[:, :, None])
  keys = pattern_from_hf_config(cfg)
  got = apply_rope(jnp.asarray(x), jnp.asarray(pos), base=keys["rope_theta"], layout=keys["rope_layout"])
  np.testing.assert_allclose(np.asarray(got), ref.numpy(), atol=1e-5)


HUB_STYLE = {  # config.json dicts as older Hub configs write them: no layer_types (nor Llama 4's flags)
  "mistral": ("MistralConfig", dict(sliding_window=5)),
  "mistral_no_window_key": ("MistralConfig", {}),  # transformers' default window, 4096
  "gemma2_no_window_key": ("Gemma2Config", {}),
  "gpt_oss_no_window_key": ("GptOssConfig", {}),
  "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=3)),
  "qwen3_unused_window": (
    "Qwen3Config",
    dict(use_sliding_window=False, sliding_window=5, max_window_layers=0),
  ),
  "gemma2": ("Gemma2Config", dict(sliding_window=5)),
  "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=5, sliding_window_pattern=3)),
  "gemma3_text_default": ("Gemma3TextConfig", dict(sliding_window=5)),
  "gpt_oss": ("GptOssConfig", dict(sliding_window=5)),
  "llama4_text": (
    "Llama4TextConfig",
    dict(attention_chunk_size=4, no_rope_layer_interval=3, intermediate_size_mlp=16),
  ),
}


@pytest.mark.parametrize("name", sorted(HUB_STYLE))
def test_a_config_json_without_layer_types_reads_the_pattern_transformers_derives(name):
  """A ``config.json`` dict without ``layer_types`` (Gemma 3's ``sliding_window_pattern``, Qwen3's
  ``use_sliding_window`` / ``max_window_layers``, Llama 4's ``no_rope_layer_interval``) gives the
  layer types, NoPE layers and temperature keys transformers' config class derives from it."""
  tf = importlib.import_module("transformers")
  cls, kw = HUB_STYLE[name]
  small = dict(num_hidden_layers=7, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  small |= dict(intermediate_size=16, vocab_size=64, max_position_embeddings=64)
  ref = getattr(tf, cls)(**small, **kw)
  raw = {"model_type": ref.model_type, **small, **kw}
  got = pattern_from_hf_config(raw)
  types = tuple(
    getattr(ref, "layer_types", None)
    or ("sliding_attention" if ref.sliding_window else "full_attention",) * 7
  )
  if name == "qwen3_unused_window":  # Qwen3Attention: a sliding layer without a window is full
    types = ("full_attention",) * 7
  assert got.get("layer_types", ("full_attention",) * 7) == types
  if "sliding_attention" in types:
    assert got["sliding_window"] == ref.sliding_window
  if name == "llama4_text":
    assert got["no_rope_layers"] == tuple(ref.no_rope_layers)
    assert (got["attn_temperature_tuning"], got["floor_scale"], got["attn_scale"]) == (
      ref.attn_temperature_tuning,
      ref.floor_scale,
      ref.attn_scale,
    )


@pytest.mark.parametrize(
  "cls", ["MistralConfig", "Qwen3Config", "Gemma2Config", "Gemma3TextConfig", "GptOssConfig"]
)
def test_a_config_json_without_the_defaulted_keys_reads_transformers_defaults(cls):
  """A ``config.json`` dict with only the sizes gives the ``ModelConfig`` of transformers' config
  object built from it (its defaults: head_dim, kv heads, activation, eps, query_pre_attn_scalar)."""
  tf = importlib.import_module("transformers")
  sizes = dict(
    vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
  )
  ref = getattr(tf, cls)(**sizes)
  got = config_dict_from_hf({"model_type": ref.model_type, **sizes})
  assert got == config_dict_from_hf(ref)


@pytest.mark.parametrize(
  "config, key",
  [
    (dict(model_type="gemma2", sliding_window=None), "sliding_window"),
    (dict(model_type="gemma3_text", sliding_window=None), "sliding_window"),
    (dict(model_type="gpt_oss", sliding_window=None), "sliding_window"),
    (
      dict(model_type="gpt_oss", layer_types=["sliding_attention"] * 2, sliding_window=None),
      "sliding_window",
    ),
    (
      dict(model_type="llama4_text", layer_types=["chunked_attention"] * 2, attention_chunk_size=None),
      "attention_chunk_size",
    ),
  ],
)
def test_sliding_or_chunked_layers_without_their_size_are_refused_naming_the_key(config, key):
  """transformers builds these configs (``sliding_window: null``, as Mistral's Hub configs write it)
  and refuses them at the first forward (``create_sliding_window_causal_mask``: "sliding_window ...
  not set"); the import names the key (before: ``int(None)``'s TypeError)."""
  sizes = dict(
    vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2
  )
  with pytest.raises(ValueError, match=f"layers but {key} is None"):
    pattern_from_hf_config({**sizes, **config})
