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

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.ops.hf_rope import rope_from_hf_config
from jaxpe.ops.rope_scaling import rope_frequencies

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
transformers.logging.set_verbosity_error()
from hf_cases import (  # noqa: E402  (tests/ops/hf_cases.py: the shared config table)
  CASES,
  LLAMA31,
  PHI35,
  PHI_LONG,
  PHI_SHORT,
  POSITIONS,
  Case,
  hf_module,
)


def _hf_cos_sin(case, positions):
  """transformers' per-pair cos, sin [T, R/2] float64 from a fresh module."""
  module_cls, config = hf_module(case)
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
    module_cls, config = hf_module(case)
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
    module_cls, config = hf_module(case)
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
        attention_factor=r.attention_factor,
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
    want = jaxpe.apply_rope(x, pos, inv_freq=inv, layout="half", attention_factor=att)
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
  # text tokens: [B, T] or [T] token positions give every axis the same position
  text = jnp.asarray([[0, 4, 8]], jnp.int32)
  want = jaxpe.apply_rope(x, text, inv_freq=r.inv_freq, layout="half")
  np.testing.assert_array_equal(r.apply(x, text), want)
  np.testing.assert_array_equal(r.apply(x, jnp.broadcast_to(text, (3, 1, 3))), want)
  # [A, T] (this method's old multi-axis form) with B == A would be misread either way: refused
  x3 = jnp.ones((3, 3, 2, 128), jnp.float32)
  for x_ in (x, x3):
    with pytest.raises(ValueError, match=r"ambiguous .* \[A, B, T\] = \[3, B, T\]"):
      r.apply(x_, pos3[:, 0])


def test_deepseek_softmax_scale_factor():
  case = next(c for c in CASES if c.config["model_type"] == "deepseek_v3")
  r = rope_from_hf_config(case.config)
  module_cls, config = hf_module(case)
  modeling = __import__(module_cls.__module__, fromlist=["x"])
  qk_head_dim = 128 + 64
  expected = modeling.yarn_apply_mscale(config.rope_parameters, qk_head_dim**-0.5) / qk_head_dim**-0.5
  assert r.softmax_scale_factor == pytest.approx(expected, rel=1e-12)
  assert r.softmax_scale_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2, rel=1e-12)
  assert r.attention_factor == pytest.approx(1.0, rel=1e-12)  # mscale == mscale_all_dim
