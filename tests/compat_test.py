"""Every public name of the flat modules jaxpe had before its subpackages (commit e0469af) still
imports from its old path (``jaxpe.<module>``), with a DeprecationWarning where the path moved."""

import importlib
import warnings

import pytest

# Old module -> its public names at e0469af (read from that commit's source with ast).
OLD_NAMES = {
  "_checks": [
    "ArgTypeError",
    "MAX_DIM",
    "MAX_POSITION",
    "as_array",
    "broadcastable",
    "check_bool",
    "check_dim",
    "check_float",
    "check_float_dtype",
    "check_index",
    "check_index_range",
    "check_positions",
    "check_positive_float",
    "check_positive_int",
    "check_rank",
    "check_slopes",
    "rope_positions",
  ],
  "alibi": [
    "alibi_bias",
    "alibi_bias_bloom",
    "alibi_bias_causal",
    "alibi_bias_symmetric",
    "alibi_slopes",
    "alibi_slopes_f64",
    "alibi_slopes_for_heads",
  ],
  "attention": [
    "AttentionMask",
    "check_causal",
    "check_scale",
    "check_segment_ids",
    "check_valid",
    "dense_segment_ids",
    "dot_product_attention",
    "make_attention_mask",
  ],
  "bf16_exact": [
    "DIGIT_BITS",
    "MANTISSA_BITS",
    "PARTS",
    "alibi_term_dims",
    "exact_alibi_dim_count",
    "exact_alibi_dims",
    "float32_accumulated_dot",
    "position_digits",
    "round_mantissa",
    "split_bf16",
    "split_product_dims",
  ],
  "bloom": [
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
    "hf_config_from",
    "model_params",
    "params_from_hf",
    "read_checkpoint",
    "save_hf",
    "to_emulated",
    "to_hf_state_dict",
    "to_transformers",
    "weight_rules",
  ],
  "checkpoint": [
    "CheckpointError",
    "abstract_with_shardings",
    "check_writable",
    "finish",
    "log",
    "manager",
    "restore_latest",
    "save",
  ],
  "config": [
    "AttentionImpl",
    "Axes",
    "DType",
    "DataConfig",
    "DistributedConfig",
    "LogicalRules",
    "MESH_AXES",
    "MeshAxis",
    "ModelConfig",
    "POS_ENCODINGS",
    "PosEncoding",
    "Remat",
    "RopeScalingConfig",
    "TrainConfig",
    "load_config",
    "load_yaml_file",
    "parse_overrides",
    "with_data_path",
  ],
  "data": [
    "BINARY_SNIFF_BYTES",
    "CONTROL_SHARE",
    "Corpus",
    "CorpusFiles",
    "binary_reason",
    "bits_per_byte",
    "corpus_files",
    "eval_batches",
    "fingerprint",
    "is_binary",
    "load_corpus",
    "scan_corpus",
    "split_files",
    "stdlib_files",
    "train_batch",
    "unigram_bits_per_byte",
  ],
  "emulation": [
    "BaseConstrainedPlan",
    "DTYPE_MAX",
    "EmulationPlan",
    "MAX_PAD_MULTIPLE",
    "MAX_POSITION",
    "ROUNDING_CONSTANT",
    "UNIT_ROUNDOFF",
    "apply_augmented_alibi",
    "apply_rope_alibi",
    "base_constrained_qk",
    "emulated_alibi_attention",
    "emulation_amplitudes",
    "emulation_error_bound",
    "emulation_theta",
    "emulation_weights",
    "leading_error_coefficient",
    "pad_head_dim",
    "rounding_sum",
    "solve_base_constrained",
    "solve_emulation",
    "truncation_error_bound",
  ],
  "emulation_report": ["FORMS", "base_constrained_table", "main", "measure", "report"],
  "generate": ["generate", "pick"],
  "hf_rope": ["HFRope", "INTERLEAVED_FAMILIES", "rope_from_hf_config"],
  "kernels": [
    "AlibiSpec",
    "BACKENDS",
    "Backend",
    "CUDNN_MAX_HEAD_DIM",
    "HEAD_DIM_MULTIPLE",
    "IMPLEMENTATIONS",
    "XLA_CAUSAL_BLOCK",
    "attention",
    "available_backends",
    "emulation_dim_count",
    "kernel_length",
    "padded_head_dim",
    "platform_backends",
    "resolve_backend",
  ],
  "layouts": ["Array", "convert_layout", "convert_qk_proj_weight", "layout_permutation"],
  "memory_check": ["STATE_BYTES_PER_PARAM", "check_fits_memory", "memory_floor_bytes"],
  "model": [
    "Attention",
    "Block",
    "Decoder",
    "KVCache",
    "LayerNorm",
    "MLP",
    "emulation_theta",
    "init_cache",
    "stack_blocks",
    "to_loop_layout",
    "to_scan_layout",
  ],
  "pacing": ["Progress", "StepCosts", "fit_num_steps"],
  "positions": ["document_mask", "positions_from_mask", "positions_from_segment_ids"],
  "rope": [
    "LAYOUTS",
    "Layout",
    "PHASE_PRECISIONS",
    "PhasePrecision",
    "RotatedSlice",
    "apply_rope",
    "rope_cos_sin",
    "rope_inv_freq",
    "rope_phases",
  ],
  "rope_scaling": ["ROPE_TYPES", "normalize_rope_parameters", "ntk_aware_base", "rope_frequencies"],
  "run_guard": [
    "NonFiniteError",
    "RunError",
    "StopRequest",
    "TrainingInterrupted",
    "WorkdirGoneError",
    "WorkdirInUseError",
    "check_workdir_intact",
    "drop_closed_event_loop_noise",
    "exit_process",
    "one_line",
    "run_cli",
    "stop_signals",
    "workdir_lock",
  ],
  "sharding": [
    "ACTIVATION",
    "DEFAULT_RULES",
    "activation_sharding",
    "batch_sharding",
    "check_divisible",
    "constrain",
    "create_sharded",
    "global_batch",
    "initialize_distributed",
    "logical_sizes",
    "logical_to_spec",
    "make_mesh",
    "mesh_dims",
    "param_bytes_per_device",
    "process_rows",
    "state_shardings",
  ],
  "sinusoidal": ["CONVENTIONS", "Convention", "sinusoidal_embedding", "sinusoidal_frequencies"],
  "steps": [
    "accumulated_value_and_grad",
    "decay_mask",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "next_token_loss",
  ],
  "study": [
    "ENCODINGS",
    "Encoding",
    "StudyConfig",
    "StudyInterrupted",
    "cell",
    "chunks",
    "emulation_check",
    "eval_model_config",
    "evaluate",
    "load_study_config",
    "load_trained",
    "markdown",
    "model_train_config",
    "paired",
    "plot_bits_per_byte",
    "plot_loss_vs_position",
    "run_study",
    "study_windows",
    "token_nll",
    "trained_params",
  ],
  "trainer": [
    "FIT_AFTER_STEPS",
    "PROCESS_LOCAL_KEYS",
    "RESUME_CHANGEABLE",
    "RUN_DEFINING_KEYS",
    "RUN_FILES",
    "SHARED_CHECK_FILE",
    "TrainResult",
    "abstract_state",
    "check_processes_agree",
    "check_resume_config",
    "check_resume_data",
    "check_shared_workdir",
    "check_workdir_is_ours",
    "create_state",
    "log",
    "make_optimizer",
    "plot_loss_curve",
    "sample_text",
    "train",
  ],
  "xpos": ["apply_xpos", "xpos_scale", "xpos_window", "xpos_zeta"],
}


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_old_module_path_keeps_every_public_name(module):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = importlib.import_module(f"jaxpe.{module}")
    missing = [name for name in OLD_NAMES[module] if not hasattr(mod, name)]
  assert not missing, f"jaxpe.{module} lost {missing}"


def test_moved_path_warns_and_names_the_new_one():
  mod = importlib.import_module("jaxpe.rope")
  with pytest.warns(DeprecationWarning, match=r"jaxpe\.rope\.apply_rope moved to jaxpe\.ops\.rope"):
    fn = mod.apply_rope
  from jaxpe.ops.rope import apply_rope

  assert fn is apply_rope


def test_unknown_name_on_an_old_path_is_an_attribute_error():
  mod = importlib.import_module("jaxpe.kernels")
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    mod.not_a_name  # noqa: B018


def test_old_modules_are_attributes_of_jaxpe_as_before():
  import jaxpe
  from jaxpe.ops.rope import apply_rope

  with pytest.warns(DeprecationWarning, match="moved to jaxpe.ops.rope.apply_rope"):
    assert jaxpe.rope.apply_rope is apply_rope
  with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
    jaxpe.not_a_module  # noqa: B018


def test_python_dash_m_on_an_old_path_runs_the_moved_module():
  import subprocess
  import sys

  out = subprocess.run(
    [sys.executable, "-m", "jaxpe.emulation_report", "--num-heads", "0"], capture_output=True, text=True
  )
  assert out.returncode == 2, out.stderr
  assert "python -m jaxpe.emulation_report moved to python -m jaxpe.emulation.report" in out.stderr
  assert out.stderr.strip().endswith(
    "python -m jaxpe.emulation.report: error: num_heads must be a positive integer, got 0"
  )
