"""Hugging Face model configs as the families ship them, for the tests of jaxpe.ops.hf_rope and
jaxpe.ops.hf_families against transformers (imported by hf_rope_test.py and hf_families_test.py).

Each case is a config.json with real dims and the transformers *RotaryEmbedding class that is the
reference for it; ``hf_module`` builds that class and its config object (needs transformers).
"""

import dataclasses

import numpy as np

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


def hf_module(case):
  """(the transformers rotary class, its config object built from the case's dict)."""
  import importlib

  import transformers

  module_path, cls_name = case.module.rsplit(".", 1)
  family = module_path.split(".")[0]
  modeling = importlib.import_module(f"transformers.models.{module_path}")
  raw = dict(case.hf_config or case.config)
  config_cls = transformers.AutoConfig.for_model(raw.pop("model_type")).__class__
  assert family in config_cls.__module__
  return getattr(modeling, cls_name), config_cls(**raw)


DEEPSEEK_V3 = next(c.config for c in CASES if c.config["model_type"] == "deepseek_v3")
