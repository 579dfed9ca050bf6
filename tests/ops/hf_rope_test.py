"""jaxpe.rope_from_hf_config against transformers' own *RotaryEmbedding modules (the reference).

Each case is a config.json as a model family ships it (real dims; only the rotary module is built,
no weights). transformers builds its config class from the same dict and its rotary module gives
cos/sin at a set of positions for several sequence lengths (a fresh module per length, which is
what transformers' stateful dynamic / longrope update equals). jaxpe's cos/sin are
``cos(rope_phases(p, inv_freq)) * attention_factor`` from the returned ``HFRope``.

Bounds: inv_freq within 1e-6 relative (transformers computes it in float32, jaxpe in float64
rounded once; llama3's smoothing band amplifies transformers' rounding to 2.2e-6, see
docs/rope.md); the attention factor within 1e-12. cos/sin: both sides compute the phase
``float32(p) * inv_freq`` in float32, so they differ by the phase's float32 rounding (up to one
ulp of ``p * inv_freq``, 4e-3 rad at p = 131071) plus ``p * |inv_jaxpe - inv_hf|``; the test
bounds each element by that plus 5e-7 (cos/sin rounding) times the attention factor.
Run with ``-s`` to print the measured deviations per family.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.ops import hf_rope
from jaxpe.ops.hf_rope import rope_from_hf_config
from jaxpe.ops.rope_scaling import rope_frequencies

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
transformers.logging.set_verbosity_error()

_RNG = np.random.default_rng(11)
PHI_SHORT = [float(v) for v in np.round(_RNG.uniform(1.0, 3.0, 48), 4)]
PHI_LONG = [float(v) for v in np.round(_RNG.uniform(1.0, 60.0, 48), 4)]
POSITIONS = (0, 1, 2, 7, 100, 1000, 2047, 4095, 4096, 4097, 8191, 32767, 131071, 163839)


@dataclasses.dataclass
class Case:
  name: str
  config: dict
  module: str  # transformers.models.<family>.modeling_<family>.<Name>RotaryEmbedding
  seq_lens: tuple = (None,)  # None: one module call over all positions < max_position_embeddings
  layer_type: str | None = None
  hf_config: dict | None = None  # when transformers must be given a different spelling (see case)


LLAMA31 = {
  "model_type": "llama",
  "hidden_size": 4096,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "max_position_embeddings": 131072,
  "rope_theta": 500000.0,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
  },
}
PHI35 = {  # Phi-3.5-mini-instruct as shipped: original length only at the top level
  "model_type": "phi3",
  "hidden_size": 3072,
  "num_attention_heads": 32,
  "max_position_embeddings": 131072,
  "original_max_position_embeddings": 4096,
  "rope_theta": 10000.0,
  "rope_scaling": {"long_factor": PHI_LONG, "short_factor": PHI_SHORT, "type": "longrope"},
}
PHI_LENS = (100, 4096, 4097, 8192, 131072)

CASES = [
  Case("llama-llama3 (v4 rope_scaling)", LLAMA31, "llama.modeling_llama.LlamaRotaryEmbedding"),
  Case(
    "llama-llama3 (v5 rope_parameters)",
    {
      **{k: v for k, v in LLAMA31.items() if k not in ("rope_scaling", "rope_theta")},
      "rope_parameters": {**LLAMA31["rope_scaling"], "rope_theta": 500000.0},
    },
    "llama.modeling_llama.LlamaRotaryEmbedding",
  ),
  Case(
    "llama-linear factor 0.5",
    {**LLAMA31, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 0.5}},
    "llama.modeling_llama.LlamaRotaryEmbedding",
  ),
  Case(
    "llama-yarn factor 0.5",
    {
      **LLAMA31,
      "max_position_embeddings": 4096,
      "rope_scaling": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8192},
    },
    "llama.modeling_llama.LlamaRotaryEmbedding",
  ),
  Case(
    "mistral",
    {
      "model_type": "mistral",
      "hidden_size": 4096,
      "num_attention_heads": 32,
      "head_dim": 128,
      "max_position_embeddings": 32768,
      "rope_theta": 1000000.0,
    },
    "mistral.modeling_mistral.MistralRotaryEmbedding",
  ),
  Case(
    "qwen2-yarn",
    {
      "model_type": "qwen2",
      "hidden_size": 3584,
      "num_attention_heads": 28,
      "max_position_embeddings": 131072,
      "rope_theta": 1000000.0,
      "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    },
    "qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
  ),
  Case(
    "qwen2-dynamic",
    {
      "model_type": "qwen2",
      "hidden_size": 3584,
      "num_attention_heads": 28,
      "max_position_embeddings": 8192,
      "rope_theta": 1000000.0,
      "rope_scaling": {"factor": 4.0, "type": "dynamic"},
    },
    "qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
    seq_lens=(100, 8192, 8193, 32768),
  ),
  Case(
    "gemma (head_dim 256 != 3072/16)",
    {
      "model_type": "gemma",
      "hidden_size": 3072,
      "num_attention_heads": 16,
      "head_dim": 256,
      "max_position_embeddings": 8192,
      "rope_theta": 10000.0,
    },
    "gemma.modeling_gemma.GemmaRotaryEmbedding",
  ),
  Case(
    "phi3-longrope (nested original)",
    {
      **{k: v for k, v in PHI35.items() if k != "original_max_position_embeddings"},
      "rope_scaling": {**PHI35["rope_scaling"], "original_max_position_embeddings": 4096},
    },
    "phi3.modeling_phi3.Phi3RotaryEmbedding",
    seq_lens=PHI_LENS,
  ),
  Case(
    "phi3-longrope (Phi-3.5: top-level original)", PHI35, "phi3.modeling_phi3.Phi3RotaryEmbedding", PHI_LENS
  ),
  # transformers 5.24 refuses "su" without a nested original length (it renames su after moving
  # the top-level one in); its reading of su is longrope, so the reference is the longrope config.
  Case(
    "phi3-su (early Phi-3-128k)",
    {**PHI35, "rope_scaling": {**PHI35["rope_scaling"], "type": "su"}},
    "phi3.modeling_phi3.Phi3RotaryEmbedding",
    PHI_LENS,
    hf_config=PHI35,
  ),
  Case(
    "gpt_neox (rotary_pct 0.25, rotate-half)",
    {
      "model_type": "gpt_neox",
      "hidden_size": 2048,
      "num_attention_heads": 8,
      "max_position_embeddings": 2048,
      "rotary_pct": 0.25,
      "rotary_emb_base": 10000,
    },
    "gpt_neox.modeling_gpt_neox.GPTNeoXRotaryEmbedding",
  ),
  Case(
    "gptj (rotary_dim 64 of 256, interleaved)",
    {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64, "n_positions": 2048},
    "gptj.modeling_gptj.GPTJRotaryEmbedding",
  ),
  Case(
    "falcon",
    {
      "model_type": "falcon",
      "hidden_size": 4544,
      "num_attention_heads": 71,
      "alibi": False,
      "max_position_embeddings": 2048,
    },
    "falcon.modeling_falcon.FalconRotaryEmbedding",
  ),
  Case(
    "stablelm (partial 0.25)",
    {
      "model_type": "stablelm",
      "hidden_size": 2560,
      "num_attention_heads": 32,
      "max_position_embeddings": 4096,
      "partial_rotary_factor": 0.25,
      "rope_theta": 10000,
    },
    "stablelm.modeling_stablelm.StableLmRotaryEmbedding",
  ),
  Case(
    "deepseek_v3 (yarn, mscale)",
    {
      "model_type": "deepseek_v3",
      "hidden_size": 7168,
      "num_attention_heads": 128,
      "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64,
      "v_head_dim": 128,
      "max_position_embeddings": 163840,
      "rope_theta": 10000,
      "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
      },
    },
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding",
  ),
  *[
    Case(
      f"gemma3 ({layer})",
      {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "head_dim": 256,
        "num_hidden_layers": 12,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
      },
      "gemma3.modeling_gemma3.Gemma3RotaryEmbedding",
      layer_type=layer,
    )
    for layer in ("full_attention", "sliding_attention")
  ],
]


def _hf_module(case):
  import importlib

  module_path, cls_name = case.module.rsplit(".", 1)
  family = module_path.split(".")[0]
  modeling = importlib.import_module(f"transformers.models.{module_path}")
  raw = dict(case.hf_config or case.config)
  config_cls = transformers.AutoConfig.for_model(raw.pop("model_type")).__class__
  assert family in config_cls.__module__
  return getattr(modeling, cls_name), config_cls(**raw)


def _hf_cos_sin(case, positions):
  """transformers' per-pair cos, sin [T, R/2] float64 from a fresh module."""
  module_cls, config = _hf_module(case)
  module = module_cls(config)
  pos = torch.tensor(np.asarray(positions, np.int64)[None])
  x = torch.zeros(1, dtype=torch.float32)
  kwargs = {"layer_type": case.layer_type} if case.layer_type else {}
  with torch.no_grad():
    out = module(x, pos, **kwargs)
  if case.config["model_type"] == "gptj":
    sin, cos = out  # [sin | cos] halves of create_sinusoidal_positions, R/2 each
  else:
    cos, sin = out  # cat(freqs, freqs): the first R/2 entries are the per-pair values
    half = cos.shape[-1] // 2
    assert np.array_equal(cos[..., :half].numpy(), cos[..., half:].numpy())
    cos, sin = cos[..., :half], sin[..., :half]
  return cos[0].double().numpy(), sin[0].double().numpy(), module


def _hf_inv_freq(module, layer_type):
  if hasattr(module, "embed_positions"):  # GPT-J: recover inv_freq from the table at position 1
    sin1 = module.embed_positions[1, : module.embed_positions.shape[1] // 2]
    return np.arcsin(sin1.double().numpy())  # all phases at position 1 are < pi / 2
  name = f"{layer_type}_inv_freq" if layer_type else "inv_freq"
  return getattr(module, name).double().numpy()


def _hf_attention_scaling(module, layer_type):
  if hasattr(module, "embed_positions"):
    return 1.0
  name = f"{layer_type}_attention_scaling" if layer_type else "attention_scaling"
  return float(getattr(module, name))


MEASURED = {}
DEEPSEEK_V3 = next(c.config for c in CASES if c.config["model_type"] == "deepseek_v3")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cos_sin_match_transformers_rotary_embedding(case):
  r = rope_from_hf_config(case.config, layer_type=case.layer_type)
  worst = {"inv_rel": 0.0, "abs": 0.0, "rel": 0.0, "bound_ratio": 0.0, "abs_small": 0.0}
  for seq_len in case.seq_lens:
    limit = r.max_position_embeddings if seq_len is None else seq_len
    positions = sorted({p for p in POSITIONS if p < limit} | {limit - 1})
    cos_hf, sin_hf, module = _hf_cos_sin(case, positions)
    inv_hf = _hf_inv_freq(module, case.layer_type)
    att_hf = _hf_attention_scaling(module, case.layer_type)
    inv, att = r.frequencies(seq_len)
    assert r.rotary_dim == 2 * inv_hf.shape[0]
    assert att == pytest.approx(att_hf, rel=1e-12)
    # GPT-J's table at position 1 gives inv_freq only to float32 sin rounding (1 ulp of sin(inv)).
    inv_rtol = (
      2.2e-6 if r.rope_type == "llama3" else (3e-7 * 4 if case.config["model_type"] == "gptj" else 1e-6)
    )
    inv_rel = np.abs(np.asarray(inv, np.float64) - inv_hf) / inv_hf
    assert inv_rel.max() <= inv_rtol, (seq_len, inv_rel.max())
    pos = jnp.asarray(np.asarray(positions, np.int32)[None])
    phases = np.asarray(jaxpe.rope_phases(pos, inv)[0], np.float64)
    cos_j = np.cos(phases.astype(np.float32)).astype(np.float64) * att
    sin_j = np.sin(phases.astype(np.float32)).astype(np.float64) * att
    p = np.asarray(positions, np.float64)[:, None]
    phase_hf = (np.float32(1.0) * p.astype(np.float32) * inv_hf.astype(np.float32)).astype(np.float32)
    bound = att * (p * np.abs(np.asarray(inv, np.float64) - inv_hf) + np.spacing(phase_hf) + 5e-7)
    for got, ref in ((cos_j, cos_hf), (sin_j, sin_hf)):
      dev = np.abs(got - ref)
      assert np.all(dev <= bound), (seq_len, float((dev / bound).max()))
      big = np.abs(ref) >= 0.1 * att
      worst["abs"] = max(worst["abs"], float(dev.max()))
      worst["rel"] = max(worst["rel"], float((dev[big] / np.abs(ref[big])).max()))
      worst["bound_ratio"] = max(worst["bound_ratio"], float((dev / bound).max()))
      worst["abs_small"] = max(worst["abs_small"], float(dev[p[:, 0] <= 100].max()))
    worst["inv_rel"] = max(worst["inv_rel"], float(inv_rel.max()))
  MEASURED[case.name] = worst
  print(
    f"\n{case.name}: inv_freq rel {worst['inv_rel']:.2e}; cos/sin max abs {worst['abs']:.2e}, "
    f"max rel (|ref| >= 0.1) {worst['rel']:.2e}, max dev/bound {worst['bound_ratio']:.2f}; "
    f"positions <= 100: max abs {worst['abs_small']:.2e}"
  )


# ------------------------------------------------------------------ the cases by value


def test_phi35_attention_factor_and_long_table_from_4097():
  r = rope_from_hf_config(PHI35)
  expected = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
  assert r.original_max_position_embeddings == 4096 and r.length_dependent
  for seq_len in (4096, 4097, 8192):
    inv, att = r.frequencies(seq_len)
    assert att == pytest.approx(expected, rel=1e-15) and round(att, 10) == 1.1902380714
    factors = np.asarray(PHI_LONG if seq_len > 4096 else PHI_SHORT)
    ref = 1.0 / (factors * 10000.0 ** (np.arange(0, 96, 2) / 96))
    np.testing.assert_allclose(inv, ref, rtol=3e-7)
  # The top-level original length wins over a nested one (transformers' standardize_rope_params).
  both = {**PHI35, "rope_scaling": {**PHI35["rope_scaling"], "original_max_position_embeddings": 2048}}
  assert rope_from_hf_config(both).original_max_position_embeddings == 4096


def test_phi3_original_length_is_the_class_default_over_a_nested_one():
  """Phi3Config declares original_max_position_embeddings = 4096, so transformers' standardisation
  always has a top-level value: a nested-only 8192 is overridden by 4096 (the long table from 4097,
  attention factor from 131072 / 4096). An explicit None nested length means absent."""
  nested = {**PHI35, "rope_scaling": {**PHI35["rope_scaling"], "original_max_position_embeddings": 8192}}
  del nested["original_max_position_embeddings"]
  case = Case("phi3 nested 8192", nested, "phi3.modeling_phi3.Phi3RotaryEmbedding")
  r = rope_from_hf_config(nested)
  for seq_len in (4097, 8193):
    module_cls, config = _hf_module(case)
    module = module_cls(config)
    with torch.no_grad():
      module(torch.zeros(1), torch.tensor([[seq_len - 1]]))
    inv, att = r.frequencies(seq_len)
    np.testing.assert_allclose(inv, module.inv_freq.double().numpy(), rtol=1e-6)
    assert att == pytest.approx(module.attention_scaling, rel=1e-12)
  assert r.original_max_position_embeddings == config.rope_parameters["original_max_position_embeddings"]
  llama = {**LLAMA31, "rope_scaling": {**LLAMA31["rope_scaling"], "original_max_position_embeddings": None}}
  r = rope_from_hf_config(llama)
  assert r.original_max_position_embeddings == r.parameters["original_max_position_embeddings"] == 131072


def test_local_and_global_bases_of_v4_configs_per_layer_type():
  """Gemma-3n (rope_local_base_freq) and ModernBERT (global_rope_theta / local_rope_theta) config.json
  files carry one base per layer type outside any rope dict; transformers splits them by layer type
  (ModernBERT's rope_scaling applies to both, Gemma's to full attention only)."""
  types_ = (["sliding_attention"] * 4 + ["full_attention"]) * 2
  gemma3n = {
    "model_type": "gemma3n",
    "text_config": {
      "model_type": "gemma3n_text",
      "hidden_size": 2048,
      "num_attention_heads": 8,
      "head_dim": 256,
      "num_hidden_layers": 10,
      "layer_types": types_,
      "max_position_embeddings": 32768,
      "rope_theta": 1000000.0,
      "rope_local_base_freq": 10000.0,
      "rope_scaling": None,
    },
  }
  modernbert = {
    "model_type": "modernbert",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "max_position_embeddings": 8192,
    "global_rope_theta": 160000.0,
    "local_rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
  }
  for config in (gemma3n, modernbert):
    hf = transformers.AutoConfig.for_model(**config).get_text_config()
    for layer_type in ("full_attention", "sliding_attention"):
      ref = dict(hf.rope_parameters[layer_type])
      head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
      inv_ref, _ = rope_frequencies(ref, head_dim=head_dim)
      r = rope_from_hf_config(config, layer_type=layer_type)
      assert r.rope_theta == ref["rope_theta"] and r.rope_type == ref["rope_type"], (
        config["model_type"],
        layer_type,
      )
      np.testing.assert_array_equal(r.inv_freq, inv_ref)


def test_layout_and_rotated_slice_match_transformers_apply():
  """q rotated by jaxpe.apply_rope with the returned layout / slice equals transformers' own apply
  function (GPT-J interleaved partial, GPT-NeoX rotate-half partial, DeepSeek-V3 interleaved
  trailing)."""
  rng = np.random.default_rng(0)
  positions = np.array([[0, 5, 300, 2047]], np.int64)
  for name, family in (("gptj", "gptj"), ("gpt_neox", "gpt_neox"), ("deepseek_v3", "deepseek_v3")):
    case = next(c for c in CASES if c.config["model_type"] == family)
    r = rope_from_hf_config(case.config)
    q = rng.normal(size=(1, 4, 2, r.head_dim)).astype(np.float32)  # [B, T, N, H]; MLA: the rope part
    module_cls, config = _hf_module(case)
    module = module_cls(config)
    modeling = __import__(module_cls.__module__, fromlist=["x"])
    with torch.no_grad():
      out = module(torch.zeros(1), torch.from_numpy(positions))
      qt = torch.from_numpy(q)
      if family == "gptj":
        sin, cos = out
        rot = modeling.apply_rotary_pos_emb(qt[..., : r.rotary_dim], sin, cos)
        hf = torch.cat([rot, qt[..., r.rotary_dim :]], -1).numpy()
      elif family == "gpt_neox":
        hf, _ = modeling.apply_rotary_pos_emb(qt, qt, *out, unsqueeze_dim=2)
        hf = hf.numpy()
      else:  # MLA: this q is the rope part of the head; HF returns it de-interleaved (evens | odds)
        hf, _ = modeling.apply_rotary_pos_emb_interleave(qt, qt, *out, unsqueeze_dim=2)
        hf = hf.numpy()
    assert r.layout == {"gptj": "interleaved", "gpt_neox": "half", "deepseek_v3": "interleaved"}[name]
    assert r.rotated_slice == ("trailing" if name == "deepseek_v3" else "leading")
    got = np.asarray(
      jaxpe.apply_rope(
        jnp.asarray(q),
        jnp.asarray(positions, jnp.int32),
        inv_freq=r.inv_freq,
        layout=r.layout,
        scale=r.attention_factor,
        phase_precision="float32",  # transformers' float32 phases (exact ones differ by its rounding)
      )
    )
    # HFRope.apply takes the layout, slice and table from the config: the same rotation.
    applied = r.apply(jnp.asarray(q), jnp.asarray(positions, jnp.int32), phase_precision="float32")
    np.testing.assert_array_equal(np.asarray(applied), got)
    if name == "deepseek_v3":
      got = np.concatenate([got[..., 0::2], got[..., 1::2]], -1)
    np.testing.assert_allclose(got, hf, atol=2e-5 * max(1.0, r.attention_factor) * 4, rtol=0)
    if name != "deepseek_v3":  # and the other layout would not match
      other = "half" if r.layout == "interleaved" else "interleaved"
      wrong = jaxpe.apply_rope(
        jnp.asarray(q), jnp.asarray(positions, jnp.int32), inv_freq=r.inv_freq, layout=other
      )
      assert np.abs(np.asarray(wrong) - hf).max() > 0.1


def test_apply_uses_the_config_layout_slice_sections_and_length():
  """HFRope.apply = apply_rope with the config's layout, rotated slice, mrope sections and
  (for longrope / dynamic) the table of ``frequencies(seq_len)``: nothing for the caller to guess."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 5, 2, 96)), jnp.float32)
  pos = jnp.arange(4090, 4095, dtype=jnp.int32)[None]
  r = rope_from_hf_config(PHI35)  # rotate-half, longrope (attention factor, long table past 4096)
  assert r.layout == "half" and r.length_dependent
  for seq_len in (None, 4096, 8192):
    inv, att = (r.inv_freq, r.attention_factor) if seq_len is None else r.frequencies(seq_len)
    want = jaxpe.apply_rope(x, pos, inv_freq=inv, layout="half", scale=att)
    np.testing.assert_array_equal(r.apply(x, pos, seq_len=seq_len), want)
  assert not np.array_equal(r.apply(x, pos, seq_len=8192), r.apply(x, pos))  # the long factors
  qwen = {
    "model_type": "qwen2_vl",
    "hidden_size": 1536,
    "num_attention_heads": 12,
    "rope_theta": 1e6,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
  }
  r = rope_from_hf_config(qwen)
  x = jnp.ones((1, 3, 2, 128), jnp.float32)
  pos3 = jnp.asarray([[[0, 1, 2]], [[0, 4, 8]], [[0, 5, 9]]], jnp.int32)  # [A, B, T]
  want = jaxpe.apply_rope(x, pos3, inv_freq=r.inv_freq, layout="half", mrope_section=[16, 24, 24])
  np.testing.assert_array_equal(r.apply(x, pos3), want)


def test_deepseek_softmax_scale_factor():
  case = next(c for c in CASES if c.config["model_type"] == "deepseek_v3")
  r = rope_from_hf_config(case.config)
  module_cls, config = _hf_module(case)
  modeling = __import__(module_cls.__module__, fromlist=["x"])
  qk_head_dim = 128 + 64
  expected = modeling.yarn_apply_mscale(config.rope_parameters, qk_head_dim**-0.5) / qk_head_dim**-0.5
  assert r.softmax_scale_factor == pytest.approx(expected, rel=1e-12)
  assert r.softmax_scale_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2, rel=1e-12)
  assert r.attention_factor == pytest.approx(1.0, rel=1e-12)  # mscale == mscale_all_dim


def test_text_config_model_types_use_their_family_rules():
  """A composite model's text config has its own model_type (``qwen2_5_vl_text``,
  ``mistral_large4_text``, ...): the family's rules still apply. Qwen2.5-VL config.json as saved
  with a text_config (legacy "mrope" type), and Mistral-Large-3's yarn softmax scale, against
  transformers."""
  import importlib

  qwen = {
    "model_type": "qwen2_5_vl",
    "text_config": {
      "model_type": "qwen2_5_vl_text",
      "hidden_size": 2048,
      "num_attention_heads": 16,
      "max_position_embeddings": 128000,
      "rope_theta": 1000000.0,
      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    },
  }
  hf = transformers.AutoConfig.for_model(**qwen).get_text_config()
  r = rope_from_hf_config(qwen)
  assert r.rope_type == "default" and r.mrope_section == tuple(hf.rope_parameters["mrope_section"])
  module_cls = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
  inv_hf = module_cls.Qwen2_5_VLRotaryEmbedding(hf).inv_freq.double().numpy()
  np.testing.assert_allclose(r.inv_freq, inv_hf, rtol=1e-6)
  for family in ("mistral_large4", "hy_v4_vl"):
    text = transformers.AutoConfig.for_model(family).get_text_config()
    yarn = {
      "rope_type": "yarn",
      "factor": 40.0,
      "mscale": 0.707,
      "mscale_all_dim": 0.707,
      "original_max_position_embeddings": 4096,
      "rope_theta": 10000.0,
    }
    text = type(text)(**{**text.to_dict(), "rope_parameters": yarn, "max_position_embeddings": 163840})
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    expected = modeling.yarn_apply_mscale(text.rope_parameters, 1.0)
    assert expected > 1.5
    for config in (text, text.to_dict()):
      r = rope_from_hf_config(config)
      assert r.softmax_scale_factor == pytest.approx(expected, rel=1e-12), family
      # Both rotate the last qk_rope_head_dim dims of [nope | rope] heads (their modeling code's
      # torch.split(q, [qk_nope_head_dim, qk_rope_head_dim])), in interleaved pairs.
      assert (r.rotated_slice, r.layout) == ("trailing", "interleaved"), family


def test_pretrained_config_object_equals_its_dict():
  for case in CASES:
    if case.hf_config is not None:
      continue
    _, config = _hf_module(case)
    a = rope_from_hf_config(config, layer_type=case.layer_type)
    b = rope_from_hf_config(case.config, layer_type=case.layer_type)
    for field in (
      "rope_type",
      "head_dim",
      "rotary_dim",
      "layout",
      "rotated_slice",
      "original_max_position_embeddings",
    ):
      assert getattr(a, field) == getattr(b, field), (case.name, field)
    np.testing.assert_array_equal(a.inv_freq, b.inv_freq)
    assert a.attention_factor == b.attention_factor


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
  "config, kwargs, match",
  [
    ({**LLAMA31, "rope_scaling": {**LLAMA31["rope_scaling"], "low_freq_facotr": 1}}, {}, "low_freq_facotr"),
    ({**LLAMA31, "rope_scaling": {"rope_type": "cubic"}}, {}, "cubic"),
    ({"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 2, "alibi": True}, {}, "alibi"),
    ({"model_type": "bloom", "hidden_size": 64, "n_head": 2}, {}, "no rotary"),
    ({"model_type": "somefamily", "hidden_size": 64, "num_attention_heads": 2}, {}, "rope_theta"),
    ({"model_type": "llama", "rope_theta": 1e4}, {}, "hidden_size"),
    ({**LLAMA31}, {"layer_type": "full_attention"}, "layer_type"),
    (CASES[-1].config, {}, "layer_type"),
    (CASES[-1].config, {"layer_type": "local"}, "layer_type"),
    (
      {**LLAMA31, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
      {},
      "rope_scaling.*rope_parameters",
    ),
    ({**LLAMA31, "rope_scaling": {"rope_type": "dynamic", "factor": 0.5}}, {}, "factor.*>= 1.*dynamic"),
    ({**LLAMA31, "rope_scaling": {**LLAMA31["rope_scaling"], "factor": 0.5}}, {}, "factor.*llama3"),
    # Odd rotary dims name where the head dim comes from and the partial factor.
    ({**LLAMA31, "hidden_size": 4000}, {}, "rotary dim 125.*hidden_size // num_attention_heads = 4000 // 32"),
    ({**LLAMA31, "head_dim": 100, "partial_rotary_factor": 0.25}, {}, "rotary dim 25.*'head_dim'.*0.25"),
    ({**LLAMA31, "partial_rotary_factor": 0.001}, {}, "rotary dim 0.*partial_rotary_factor"),
    (  # the softmax scale (yarn_apply_mscale) reads factor; transformers raises KeyError
      {
        **DEEPSEEK_V3,
        "rope_scaling": {k: v for k, v in DEEPSEEK_V3["rope_scaling"].items() if k != "factor"},
      },
      {},
      r"missing required keys \[.factor.\]",
    ),
  ],
)
def test_errors_name_the_key(config, kwargs, match):
  with pytest.raises(ValueError, match=match):
    rope_from_hf_config(config, **kwargs)


def test_type_errors_and_exports():
  with pytest.raises(TypeError, match="config"):
    rope_from_hf_config(["llama"])
  assert "rope_from_hf_config" in jaxpe.__all__ and "HFRope" in jaxpe.__all__
  assert "gptj" in hf_rope.INTERLEAVED_FAMILIES


# ------------------------------------------------------------------ every family transformers ships


def _default_rotary_modules():
  """(model_type, text config, rotary module) for every model type whose default config builds a
  *RotaryEmbedding from its own modeling file."""
  import importlib
  import importlib.util
  import inspect
  import warnings

  from transformers.models.auto.configuration_auto import CONFIG_MAPPING

  for model_type in sorted(CONFIG_MAPPING.keys()):
    config_cls = CONFIG_MAPPING[model_type]
    family = config_cls.__module__.split(".")[-2]
    spec = importlib.util.find_spec(f"transformers.models.{family}.modeling_{family}")
    if spec is None or "RotaryEmbedding(" not in open(spec.origin, encoding="utf-8").read():
      continue  # no rotary embedding: skip the (slow) import
    try:
      modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except Exception:  # noqa: BLE001 - optional backends (vision, audio) missing
      continue
    rotary = [
      c
      for n, c in vars(modeling).items()
      if n.endswith("RotaryEmbedding") and inspect.isclass(c) and c.__module__ == modeling.__name__
    ]
    if not rotary:
      continue
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      config = config_cls()
      try:
        config = config.get_text_config()
      except ValueError:
        pass
      for cls in rotary:
        try:
          module = cls(config)
        except Exception:  # noqa: BLE001 - a rotary class for another sub-config
          continue
        yield model_type, config, module
        break


def _layout_matches(module, r, layer_type):
  """jaxpe.apply_rope with r.layout on r's rotated slice equals the family's own
  apply_rotary_pos_emb(q, k, cos, sin) (or its _interleave variant for MLA families that use it).
  None when the family's apply function has another signature."""
  import inspect
  import sys

  modeling = sys.modules[type(module).__module__]
  interleave_fn = getattr(modeling, "apply_rotary_pos_emb_interleave", None)
  mla_interleaved = r.rotated_slice == "trailing" and r.layout == "interleaved" and interleave_fn is not None
  fn = interleave_fn if mla_interleaved else getattr(modeling, "apply_rotary_pos_emb", None)
  if fn is None or list(inspect.signature(fn).parameters)[:4] != ["q", "k", "cos", "sin"]:
    return None
  positions = np.array([[0, 3, 50, 1000]], np.int64)
  q = np.random.default_rng(0).normal(size=(1, 2, 4, r.head_dim)).astype(np.float32)  # [B, N, T, H]
  kwargs = {"layer_type": layer_type} if layer_type else {}
  try:
    with torch.no_grad():
      cos, sin = module(torch.zeros(1), torch.from_numpy(positions), **kwargs)
      hf = fn(torch.from_numpy(q), torch.from_numpy(q), cos, sin)[0].numpy()
  except (RuntimeError, TypeError, ValueError):  # partial rotary applied outside, mrope sections
    return None
  x = jnp.asarray(np.transpose(q, (0, 2, 1, 3)))  # [B, T, N, H]
  got = jaxpe.apply_rope(
    x, jnp.asarray(positions, jnp.int32), inv_freq=r.inv_freq, layout=r.layout, scale=r.attention_factor
  )
  got = np.transpose(np.asarray(got), (0, 2, 1, 3))
  if mla_interleaved:  # transformers returns the interleaved pairs de-interleaved (evens | odds)
    got = np.concatenate([got[..., 0::2], got[..., 1::2]], -1)
  return bool(np.abs(got - hf).max() <= 1e-3 * max(1.0, r.attention_factor))


def test_every_family_default_config_matches_or_is_refused():
  """For every model type transformers 5.24 ships with a rotary embedding (default config, the text
  config of composite models): rope_from_hf_config either raises ValueError or gives transformers'
  inv_freq (1e-6 relative, 2.2e-6 for llama3) and attention factor, from the PretrainedConfig and
  from its to_dict() alike, and where the family's apply_rotary_pos_emb takes (q, k, cos, sin),
  jaxpe.apply_rope with the returned layout rotates q as it does. Never a silent mismatch."""
  matched, refused, layouts = [], [], []
  for model_type, config, module in _default_rotary_modules():
    layer_types = sorted(module.rope_type) if isinstance(getattr(module, "rope_type", None), dict) else [None]
    for layer_type in layer_types:
      name = f"{layer_type}_inv_freq" if layer_type else "inv_freq"
      if getattr(module, name, None) is None:
        continue  # GPT-J / CodeGen build a sin/cos table (tested above)
      inv_hf = getattr(module, name).double().numpy()
      att_hf = float(
        getattr(module, f"{layer_type}_attention_scaling" if layer_type else "attention_scaling")
      )
      try:
        r = rope_from_hf_config(config, layer_type=layer_type)
      except ValueError as e:
        refused.append((model_type, str(e)[:60]))
        continue
      label = f"{model_type}/{layer_type}"
      assert r.inv_freq.shape == inv_hf.shape, label
      rel = np.abs(np.asarray(r.inv_freq, np.float64) - inv_hf) / np.maximum(inv_hf, 1e-30)
      assert rel.max() <= (2.2e-6 if r.rope_type == "llama3" else 1e-6), (label, rel.max())
      assert r.attention_factor == pytest.approx(att_hf, rel=1e-12), label
      from_dict = rope_from_hf_config(config.to_dict(), layer_type=layer_type)
      np.testing.assert_array_equal(from_dict.inv_freq, r.inv_freq, err_msg=label)
      assert from_dict.attention_factor == r.attention_factor, label
      matched.append(label)
      same_layout = _layout_matches(module, r, layer_type)
      assert same_layout in (None, True), (label, r.layout)
      layouts += [label] if same_layout else []
  print(
    f"\n{len(matched)} model types / layer types match ({len(layouts)} with the layout checked), "
    f"{len(refused)} refused: {sorted(set(refused))}"
  )
  assert len(matched) >= 230 and len(layouts) >= 200  # 265 and 227 in transformers 5.24
  for family in ("llama", "gemma4_text/full_attention", "deepseek_v4/compress", "mistral4", "qwen3_next"):
    assert any(m == family or m.startswith(family + "/") for m in matched), family


def test_llama4_query_scale_matches_ministral3():
  """Ministral-3's llama_4_scaling_beta: jaxpe's query_scale equals transformers'
  get_llama_4_attn_scale."""
  from transformers.models.ministral3 import modeling_ministral3

  config = transformers.AutoConfig.for_model("ministral3")
  r = rope_from_hf_config(config)
  assert r.query_scale_beta == config.rope_parameters["llama_4_scaling_beta"]
  positions = np.array([[0, 1, 16383, 16384, 16385, 70000, 1_000_000]], np.int64)
  ref = modeling_ministral3.get_llama_4_attn_scale(
    torch.from_numpy(positions),
    r.query_scale_beta,
    config.rope_parameters["original_max_position_embeddings"],
  )[:, 0, :, 0]
  np.testing.assert_allclose(r.query_scale(jnp.asarray(positions, jnp.int32)), ref.numpy(), rtol=1e-6)
  assert rope_from_hf_config(LLAMA31).query_scale_beta is None
