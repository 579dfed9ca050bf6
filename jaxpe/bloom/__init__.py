"""BLOOM in jaxpe: import Hugging Face BLOOM weights, export them back, convert to RoPE-emulated ALiBi.

BLOOM (BigScience, arXiv 2211.05100) is a pre-LayerNorm decoder with ALiBi (arXiv 2108.12409);
``jaxpe.model.Decoder`` has all its options. The reference is HF transformers'
``models/bloom/modeling_bloom.py`` (``BloomForCausalLM``). One module per step:

- ``config``: BLOOM's ``config.json`` <-> ``ModelConfig`` (``config_from_hf``, ``hf_config_from``).
- ``names``: the declarative weight-name map, HF key -> jaxpe paths with a transform each way
  (``weight_rules``).
- ``hf_import``: read a checkpoint, map it, build the ``Decoder`` (``from_hf``).
- ``hf_export``: the HF state dict, an HF checkpoint directory (``save_hf``), a transformers model.
- ``emulated``: the conversion to RoPE-emulated ALiBi (``to_emulated``) and its error bound.

``build_model`` / ``model_params`` (``jaxpe.model.build``) and ``generate`` (``jaxpe.model.generate``)
are re-exported for convenience. torch, transformers and safetensors (the ``bloom`` extra) are
imported inside the functions that need them, so ``import jaxpe.bloom`` never does.
"""

from jaxpe.bloom.config import BLOOM_CONTEXT, check_bloom_compatible, config_from_hf, hf_config_from
from jaxpe.bloom.emulated import bias_error_bound, emulation_parameters, to_emulated
from jaxpe.bloom.hf_export import EXPORT_FILES, save_hf, to_hf_state_dict, to_transformers
from jaxpe.bloom.hf_import import WEIGHT_FILES, from_hf, params_from_hf, read_checkpoint
from jaxpe.bloom.names import GLOBAL_RULES, LAYER_RULES, LM_HEAD_RULE, Dims, Rule, weight_rules
from jaxpe.errors import CheckpointError
from jaxpe.model.build import build_model, model_params
from jaxpe.model.generate import generate

__all__ = [
  "BLOOM_CONTEXT",
  "CheckpointError",
  "Dims",
  "EXPORT_FILES",
  "GLOBAL_RULES",
  "LAYER_RULES",
  "LM_HEAD_RULE",
  "Rule",
  "WEIGHT_FILES",
  "bias_error_bound",
  "build_model",
  "check_bloom_compatible",
  "config_from_hf",
  "emulation_parameters",
  "from_hf",
  "generate",
  "hf_config_from",
  "model_params",
  "params_from_hf",
  "read_checkpoint",
  "save_hf",
  "to_emulated",
  "to_hf_state_dict",
  "to_transformers",
  "weight_rules",
]
