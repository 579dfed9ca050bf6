"""jaxpe.ops.hf_families' per-family rules against transformers 5.24: every model type it ships
with a rotary embedding (matched or refused by name), composite models' text configs, a
PretrainedConfig object against its dict, the errors naming the key, and Ministral-3's query scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.ops import UnverifiedFamilyError, hf_rope
from jaxpe.ops.hf_rope import rope_from_hf_config
from jaxpe.ops.hf_verified import VERIFIED_FAMILIES

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
transformers.logging.set_verbosity_error()
from hf_cases import (  # noqa: E402  (tests/ops/hf_cases.py: the shared config table)
  CASES,
  DEEPSEEK_V3,
  LLAMA31,
  hf_module,
)


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
    _, config = hf_module(case)
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
    (
      {"model_type": "somefamily", "hidden_size": 64, "num_attention_heads": 2},
      {},
      "'somefamily' is not a family",
    ),
    (
      {"model_type": "somefamily", "hidden_size": 64, "num_attention_heads": 2},
      {"layout": "half", "rotated_slice": "leading", "rotary_dim": 32},
      "no rope_theta",
    ),
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
  from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

  for model_type in sorted(CONFIG_MAPPING.keys()):
    config_cls = CONFIG_MAPPING[model_type]
    family = config_cls.__module__.split(".")[-2]
    name = f"transformers.models.{family}.modeling_{family}"
    spec = importlib.util.find_spec(name)
    if spec is None and model_type in MODEL_MAPPING_NAMES:
      # A config-only family (ExaONE, InternLM3: LlamaModel): the modeling file of the model class
      # transformers maps it to.
      model_cls = getattr(transformers, MODEL_MAPPING_NAMES[model_type], None)
      name = getattr(model_cls, "__module__", name)
      spec = importlib.util.find_spec(name) if model_cls is not None else None
    if spec is None or "RotaryEmbedding(" not in open(spec.origin, encoding="utf-8").read():
      continue  # no rotary embedding: skip the (slow) import
    try:
      modeling = importlib.import_module(name)
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


# Model types that rope_from_hf_config refuses, with the reason's words. The sweep fails when a new
# refusal appears or one of these starts to work.
EXPECTED_REFUSALS = {
  # Its axial table is h, h, w, w: the two halves of the head rotate as separate blocks.
  "gemma4_vision": "two halves of the head rotate as separate",
  "efficientloftr": "image-patch (row, column) positions",  # 2-D feature-map RoPE
  "eomt_dinov3": "image-patch (row, column) positions",  # DINOv3 ViT patch RoPE
  # Their default text config has head_dim 2048 // 28 = 73: transformers' 74-wide table does not
  # fit the head (real Qwen3-Omni configs set head_dim 128).
  **{
    t: "wider than the 73-dim head"
    for t in ("qwen3_omni_moe", "qwen3_omni_moe_text", "qwen3_omni_moe_thinker")
  },
}
# Buffers transformers stores permuted (ERNIE-4.5-VL pre-permutes its h/w frequencies and undoes it
# in recomposition_frequencies): inv_freq compared as a set, cos/sin as usual.
PERMUTED_INV_FREQ = frozenset({"ernie4_5_vl_moe", "ernie4_5_vl_moe_text"})
POSITIONS = np.array([[0, 1, 3, 50, 300, 1000]], np.int64)  # [B, T]
# Multi-axis [3, B, T] positions (t, h, w) with different rows, for the mRoPE families.
POSITIONS3 = np.array([[[0, 1, 3, 50, 300, 1000]], [[0, 5, 2, 60, 9, 700]], [[0, 4, 8, 40, 7, 20]]], np.int64)


def _module_cos_sin(module, positions, layer_type, tokens=None):
  """transformers' (cos, sin) ``[B, T, R]`` float64 for ``positions``, or None where the module's
  forward fails (GLM-4V's default config: its default mrope_section does not fit the head)."""
  kwargs = {"layer_type": layer_type} if layer_type else {}
  try:
    with torch.no_grad():
      out = module(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions), **kwargs)
      # DeepSeek-V2 / Llama-4: one complex table cos + i sin, per pair.
      cos, sin = (out.real, out.imag) if isinstance(out, torch.Tensor) and out.is_complex() else out
  except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
    return None
  t = positions.shape[-1] if tokens is None else tokens
  return cos.double().numpy().reshape(1, t, -1), sin.double().numpy().reshape(1, t, -1)


def _per_pair(table, half, label):
  """The module's cos or sin table ``[B, T, W]`` as one value per frequency ``[B, T, R/2]``, in
  frequency order: tables are ``cat(c, c)`` (rotate-half and ERNIE-4.5 style), ``c`` repeated
  twice (interleaved), or ``c`` itself (DeepSeek-V4); which one is read off the table (the rotation
  layout itself is checked by ``_apply_matches``)."""
  assert table.shape[-1] in (half, 2 * half), (label, table.shape, half)
  if table.shape[-1] == half:
    return table
  if np.array_equal(table[..., :half], table[..., half:]):
    return table[..., :half]
  np.testing.assert_array_equal(table[..., 0::2], table[..., 1::2], err_msg=label)
  return table[..., 0::2]


def _jaxpe_cos_sin(r, positions3=None):
  """jaxpe's cos/sin ``[B, T, R/2]`` times the attention factor, at token positions or at multi-axis
  ones through ``r.mrope_axes``."""
  if positions3 is None:
    cos, sin = jaxpe.rope_cos_sin(jnp.asarray(POSITIONS, jnp.int32), r.inv_freq, phase_precision="float32")
  else:
    rows = jnp.asarray(positions3[np.asarray(r.mrope_axes)], jnp.int32)  # one row per frequency
    section = (1,) * len(r.mrope_axes)
    cos, sin = jaxpe.rope_cos_sin(rows, r.inv_freq, mrope_section=section, phase_precision="float32")
  return tuple(np.asarray(c, np.float64) * r.attention_factor for c in (cos, sin))


def _hf_rotate(module, r, fn, q, positions, layer_type):
  """The family's own rotation of ``q [B, N, T, H]``: ``fn(q, k, cos, sin)``, ``fn(x, cos, sin)``
  (Gemma-3n / Gemma-4 / DeepSeek-V4) or ``fn(xq, xk, freqs_cis)`` (complex: DeepSeek-V2 on
  ``[B, N, T, H]``, Llama-4 on ``[B, T, N, H]``); with the partial rotary applied outside the
  function (Phi, Persimmon, StableLM: q's first R dims go in, the rest pass through)."""
  import inspect

  kwargs = {"layer_type": layer_type} if layer_type else {}
  params = list(inspect.signature(fn).parameters)
  with torch.no_grad():
    table = module(torch.zeros(1), torch.from_numpy(positions), **kwargs)
    if params[:3] == ["xq", "xk", "freqs_cis"]:
      heads_second = table.ndim == 3 and fn.__module__.endswith("deepseek_v2")
      x = torch.from_numpy(q if heads_second else np.transpose(q, (0, 2, 1, 3)))
      out = fn(x, x, table)[0].numpy()
      return out if heads_second else np.transpose(out, (0, 2, 1, 3))
    cos, sin = table
    x = torch.from_numpy(q)
    if params[:3] == ["x", "cos", "sin"]:
      return fn(x, cos, sin).numpy()
    if cos.shape[-1] == r.rotary_dim < r.head_dim and r.rotated_slice == "leading":
      try:
        return fn(x, x, cos, sin)[0].numpy()
      except RuntimeError:  # the partial rotary is applied outside the function
        rot = fn(x[..., : r.rotary_dim], x[..., : r.rotary_dim], cos, sin)[0].numpy()
        return np.concatenate([rot, q[..., r.rotary_dim :]], -1)
    return fn(x, x, cos, sin)[0].numpy()


def _apply_matches(module, r, positions, layer_type):
  """``r.apply`` (layout, rotated slice, rotation sign, mRoPE axes) rotates q as the family's own
  ``apply_rotary_pos_emb`` / ``apply_rotary_emb`` (or the ``_interleave`` variant for MLA families
  that use it) with the module's table (``_hf_rotate``). None when there is no such function or
  it fails on this config."""
  import sys

  modeling = sys.modules[type(module).__module__]
  # Which function the family's attention calls is read off the family, never off jaxpe's answer:
  # MLA families with a rope_interleave flag call the _interleave variant when it is set (default
  # True, DeepseekV3Config), those with only the _interleave variant (HunYuan-V4) always do.
  interleave_fn = getattr(modeling, "apply_rotary_pos_emb_interleave", None)
  plain_fn = getattr(modeling, "apply_rotary_pos_emb", None) or getattr(modeling, "apply_rotary_emb", None)
  flag = getattr(getattr(module, "config", None), "rope_interleave", None)
  if interleave_fn is not None and plain_fn is not None:
    mla_interleaved = bool(flag) if flag is not None else r.rotated_slice == "trailing"
  else:
    mla_interleaved = interleave_fn is not None
  fn = interleave_fn if mla_interleaved else plain_fn
  if fn is None:
    return None
  t = positions.shape[-1]
  q = np.random.default_rng(0).normal(size=(1, 2, t, r.head_dim)).astype(np.float32)  # [B, N, T, H]
  try:
    hf = _hf_rotate(module, r, fn, q, positions, layer_type)
  except (RuntimeError, TypeError, ValueError, IndexError, AttributeError):  # another signature
    return None
  x = jnp.asarray(np.transpose(q, (0, 2, 1, 3)))  # [B, T, N, H]
  seq_len = int(positions.max()) + 1 if r.length_dependent else None  # what the module's forward sees
  got = r.apply(x, jnp.asarray(positions, jnp.int32), seq_len=seq_len)
  got = np.transpose(np.asarray(got), (0, 2, 1, 3))
  if mla_interleaved:  # transformers returns the interleaved pairs de-interleaved (evens | odds)
    got = np.concatenate([got[..., 0::2], got[..., 1::2]], -1)
  return bool(np.abs(got - hf).max() <= 1e-3 * max(1.0, r.attention_factor))


def _stated_facts_that_match(module, config, layer_type):
  """For an unverified family: the (layout, rotated_slice) under which rope_from_hf_config's reading
  with those facts stated agrees with the family's own module (cos/sin) and apply function, or the
  reason none does (what a maintainer reads to verify the family)."""
  found = []
  h = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
  rotary_dim = int(h * (getattr(config, "partial_rotary_factor", None) or 1.0)) // 2 * 2
  for layout in ("half", "interleaved"):
    for rotated_slice in ("leading", "trailing"):
      try:
        r = rope_from_hf_config(
          config, layer_type=layer_type, layout=layout, rotated_slice=rotated_slice, rotary_dim=rotary_dim
        )
      except ValueError as e:
        return f"refused with the facts stated: {str(e)[:120]}"
      if _apply_matches(module, r, POSITIONS, layer_type):
        found.append((layout, rotated_slice))
  return found or "no stated layout matches its apply function (or it has none jaxpe can call)"


def test_every_family_default_config_matches_or_is_refused():
  """For every model type the installed transformers ships with a rotary embedding (default config,
  the text config of composite models; 5.25.0 in the constraints): rope_from_hf_config gives transformers' inv_freq (1e-6 relative,
  2.2e-6 for llama3), attention factor and cos/sin (the module's forward at token positions, in the
  returned layout), from the PretrainedConfig and from its to_dict() alike; where the family's
  apply_rotary_pos_emb takes (q, k, cos, sin), HFRope.apply rotates q as it does; mRoPE families do
  the same at multi-axis [3, B, T] positions. Or it refuses with the reason in EXPECTED_REFUSALS,
  and only those; or, for a family outside jaxpe.ops.hf_verified.VERIFIED_FAMILIES (one a newer
  transformers adds), it refuses by name (UnverifiedFamilyError), which passes: a new family makes
  jaxpe refuse, never read it with another family's defaults and never fail this test."""
  matched, refused, cos_sin, applied, multi_axis, unverified = [], {}, [], [], [], {}
  for model_type, config, module in _default_rotary_modules():
    layer_types = sorted(module.rope_type) if isinstance(getattr(module, "rope_type", None), dict) else [None]
    for layer_type in layer_types:
      name = f"{layer_type}_inv_freq" if layer_type else "inv_freq"
      if getattr(module, name, None) is None:
        continue  # GPT-J / CodeGen build a sin/cos table (tested in hf_rope_test)
      inv_hf = getattr(module, name).double().numpy()
      att_hf = float(
        getattr(module, f"{layer_type}_attention_scaling" if layer_type else "attention_scaling")
      )
      label = f"{model_type}/{layer_type}"
      try:
        r = rope_from_hf_config(config, layer_type=layer_type)
      except UnverifiedFamilyError as e:
        # A family the installed transformers ships and jaxpe has not verified (a newer release than
        # hf_verified.TRANSFORMERS_VERSION): refused by name is right; a verified one never is.
        assert model_type not in VERIFIED_FAMILIES and repr(config.model_type) in str(e), (label, str(e))
        unverified[label] = _stated_facts_that_match(module, config, layer_type)
        continue
      except ValueError as e:
        refused[model_type] = str(e)
        continue
      ours = np.asarray(r.inv_freq, np.float64)
      if r.rope_type == "axial":  # per axis in the module, per frequency of the head in jaxpe
        ours, inv_hf = np.unique(ours), np.unique(inv_hf)
      assert ours.shape == inv_hf.shape, label
      if model_type in PERMUTED_INV_FREQ:
        ours, inv_hf = np.sort(ours), np.sort(inv_hf)
      rel = np.abs(ours - inv_hf) / np.maximum(inv_hf, 1e-30)
      assert rel.max() <= (2.2e-6 if r.rope_type == "llama3" else 1e-6), (label, rel.max())
      assert r.attention_factor == pytest.approx(att_hf, rel=1e-12), label
      from_dict = rope_from_hf_config(config.to_dict(), layer_type=layer_type)
      np.testing.assert_array_equal(from_dict.inv_freq, r.inv_freq, err_msg=label)
      assert from_dict.attention_factor == r.attention_factor, label
      matched.append(label)
      if r.rope_type == "axial":  # vision: the module takes [T, A] patch coordinates (h, w)
        rows = POSITIONS3[: max(r.mrope_axes) + 1]
        hf = _module_cos_sin(module, np.ascontiguousarray(rows[:, 0, :].T), None, tokens=rows.shape[-1])
        for got, want in zip(_jaxpe_cos_sin(r, rows), hf):
          np.testing.assert_allclose(got, _per_pair(want, r.rotary_dim // 2, label), atol=2e-3, err_msg=label)
          # Their apply functions rotate pairs as the table is laid out: cat(c, c) rotate-half,
          # c repeated twice interleaved.
          is_half = np.array_equal(want[..., : r.rotary_dim // 2], want[..., r.rotary_dim // 2 :])
          assert r.layout == ("half" if is_half else "interleaved"), label
        cos_sin.append(label)
        multi_axis.append(label)
        continue
      hf = _module_cos_sin(module, POSITIONS, layer_type)
      if hf is not None:
        for got, want in zip(_jaxpe_cos_sin(r), hf):
          want = _per_pair(want, r.rotary_dim // 2, label)
          np.testing.assert_allclose(got, want, atol=2e-3 * max(1.0, r.attention_factor), err_msg=label)
        cos_sin.append(label)
      same = _apply_matches(module, r, POSITIONS, layer_type)
      assert same in (None, True), (label, r.layout)
      applied += [label] if same else []
      if r.mrope_axes is not None:
        hf3 = _module_cos_sin(module, POSITIONS3[:, :, :], layer_type)
        if hf3 is not None:
          for got, want in zip(_jaxpe_cos_sin(r, POSITIONS3[: max(r.mrope_axes) + 1]), hf3):
            want = _per_pair(want, r.rotary_dim // 2, label)
            np.testing.assert_allclose(got, want, atol=2e-3, err_msg=f"{label} multi-axis")
          same3 = _apply_matches(module, r, POSITIONS3[: max(r.mrope_axes) + 1], layer_type)
          assert same3 in (None, True), (label, "multi-axis")
          multi_axis.append(label)
  print(
    f"\n{len(matched)} model types / layer types match ({len(cos_sin)} with cos/sin, {len(applied)} with "
    f"apply_rotary_pos_emb, {len(multi_axis)} with multi-axis positions), {len(refused)} refused: "
    f"{sorted(refused)}\nnot checked against cos/sin: {sorted(set(matched) - set(cos_sin))}\n"
    f"not checked against apply_rotary_pos_emb: {sorted(set(matched) - set(applied))}\n"
    f"unverified (refused by name; the stated facts under which the family's own module and apply "
    f"function agree, for docs/maintenance.md): {unverified}"
  )
  assert sorted(refused) == sorted(EXPECTED_REFUSALS), (
    f"new refusals: {sorted(set(refused) - set(EXPECTED_REFUSALS))}; now working: "
    f"{sorted(set(EXPECTED_REFUSALS) - set(refused))}"
  )
  for model_type, words in EXPECTED_REFUSALS.items():
    assert words in refused[model_type], (model_type, refused[model_type])
  assert len(matched) >= 300 and len(cos_sin) >= 290 and len(applied) >= 255  # 310, 300, 266 in 5.25
  for family in ("llama", "gemma4_text/full_attention", "deepseek_v4/compress", "mistral4", "qwen3_next"):
    assert any(m == family or m.startswith(family + "/") for m in matched), family


def _rotary(family, config):
  import importlib
  import inspect

  modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
  for name, cls in vars(modeling).items():
    if name.endswith("RotaryEmbedding") and inspect.isclass(cls) and "Vision" not in name:
      return cls(config)
  raise AssertionError(family)


def test_family_keys_match_transformers():
  """The rope-dict keys some families read beyond transformers' common ones, as their checkpoints
  ship them, against the families' rotary modules: PhiMoE's short/long_mscale (longrope; the
  short-factor table at every length, the cos/sin scale switching past the original length),
  HunYuan's dynamic with NTK alpha (a static base), Qwen3-VL's mrope_interleaved and Qwen3-Omni's
  interleaved flags (interleaved mRoPE, multi-axis positions too). Another family's dict refuses
  such a key, naming what it is."""
  rng = np.random.default_rng(5)
  short, long = (list(np.round(rng.uniform(1, hi, 64), 4)) for hi in (3, 60))
  phimoe = transformers.AutoConfig.for_model(
    "phimoe",
    max_position_embeddings=131072,
    rope_parameters={
      "rope_type": "longrope",
      "short_factor": short,
      "long_factor": long,
      "short_mscale": 1.2431,
      "long_mscale": 1.3,
      "original_max_position_embeddings": 4096,
      "rope_theta": 1e4,
    },
  )
  hunyuan = {
    "type": "dynamic",
    "alpha": 1000.0,
    "factor": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 1e4,
  }
  cases = [("phimoe", phimoe, POSITIONS), ("phimoe", phimoe, POSITIONS * 8)]  # max 1000, 8000
  for family in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
    config = transformers.AutoConfig.for_model(family, head_dim=128, rope_parameters=dict(hunyuan))
    cases.append((family, config, POSITIONS))
  mrope = {
    "rope_type": "default",
    "mrope_section": [24, 20, 20],
    "mrope_interleaved": True,
    "rope_theta": 5e6,
  }
  cases.append(
    ("qwen3_vl", transformers.AutoConfig.for_model("qwen3_vl_text", rope_parameters=mrope), POSITIONS3)
  )
  omni = transformers.AutoConfig.for_model(
    "qwen3_omni_moe_text", head_dim=128, rope_parameters={**mrope, "interleaved": True}
  )
  cases.append(("qwen3_omni_moe", omni, POSITIONS3))
  for family, config, positions in cases:
    if family == "phimoe" and positions.max() >= 4096:
      continue  # past the original length: transformers 5.x keeps the short table (checked below)
    r = rope_from_hf_config(config)
    module = _rotary(family, config)
    np.testing.assert_allclose(r.inv_freq, module.inv_freq.double().numpy(), rtol=1e-6, err_msg=family)
    hf = _module_cos_sin(module, positions, None)
    inv_freq, att = r.frequencies(int(positions.max()) + 1)
    pos = positions if positions.ndim == 2 else positions[np.asarray(r.mrope_axes)]
    section = None if positions.ndim == 2 else (1,) * len(r.mrope_axes)
    got = jaxpe.rope_cos_sin(
      jnp.asarray(pos, jnp.int32), inv_freq, mrope_section=section, phase_precision="float32"
    )
    for g, want in zip(got, hf):
      want = _per_pair(want, r.rotary_dim // 2, family)
      np.testing.assert_allclose(np.asarray(g, np.float64) * float(att), want, atol=2e-3, err_msg=family)
    assert _apply_matches(module, r, positions, None) in (None, True), family
  # Issue 48: PhiMoE switches to the long factors past original_max_position_embeddings, as
  # Microsoft's modeling_phimoe.py, transformers 4.x and vLLM (transformers 5.x does not): the
  # reference is that rule in numpy float64, inv_freq = 1 / (long_factor * base^(2i/d)), cos/sin
  # scaled by long_mscale; up to the original length the short table with short_mscale.
  r = rope_from_hf_config(phimoe)
  exponents = np.arange(0, 128, 2) / 128
  for seq_len, factors, mscale in ((4096, short, 1.2431), (4097, long, 1.3), (8001, long, 1.3)):
    inv_freq, att = r.frequencies(seq_len)
    want = 1.0 / (np.asarray(factors, np.float64) * 1e4**exponents)
    np.testing.assert_allclose(np.asarray(inv_freq, np.float64), want, rtol=1e-6)
    assert att == mscale
    pos = np.arange(seq_len - 5, seq_len)[None]
    cos, sin = jaxpe.rope_cos_sin(jnp.asarray(pos, jnp.int32), inv_freq)
    np.testing.assert_allclose(
      np.asarray(cos, np.float64) * att,
      np.cos(pos[..., None] * want) * mscale,
      atol=1e-3,  # float32 inv_freq x p ~ 8000
    )
    np.testing.assert_allclose(
      np.asarray(sin, np.float64) * att, np.sin(pos[..., None] * want) * mscale, atol=1e-3
    )
  jitted = jax.jit(lambda n: r.frequencies(n))(jnp.int32(8001))
  np.testing.assert_allclose(np.asarray(jitted[0]), np.asarray(r.frequencies(8001)[0]), rtol=0)
  assert rope_from_hf_config(cases[2][1]).rope_type == "default"  # a static base
  for key, value, words in (
    ("short_mscale", 1.2, "PhiMoE"),
    ("alpha", 10.0, "HunYuan"),
    ("mrope_interleaved", True, "Qwen3-VL"),
  ):
    with pytest.raises(ValueError, match=words):
      rope_from_hf_config({**LLAMA31, "rope_scaling": {**LLAMA31["rope_scaling"], key: value}})


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


# ------------------------------------------------------------------ unverified families, stated facts


def _llama_dict(**changes):
  """A Llama config.json as transformers writes it (class defaults included), with ``changes``."""
  config = transformers.AutoConfig.for_model(
    "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
  )
  return {**config.to_dict(), **changes}


def _rotated_by(family, config, layer_type=None):
  """``q [B, T, N, H]`` rotated by ``family``'s own rotary module and apply_rotary_pos_emb
  (its float32 phases: 1e-4 off float64 at position 1000), the independent reference."""
  import importlib

  modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
  module = _rotary(family, config)
  h = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
  q = np.random.default_rng(1).normal(size=(1, 2, POSITIONS.shape[-1], h)).astype(np.float32)
  kwargs = {"layer_type": layer_type} if layer_type else {}
  with torch.no_grad():
    cos, sin = module(torch.zeros(1), torch.from_numpy(POSITIONS), **kwargs)
    out = modeling.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)[0].numpy()
  return np.transpose(q, (0, 2, 1, 3)), np.transpose(out, (0, 2, 1, 3))


def _ours(r, q):
  """``r.apply`` with transformers' float32 phases (positions to 1000: exact phases differ from
  them by 1e-4 there)."""
  positions = jnp.asarray(POSITIONS, jnp.int32)
  return np.asarray(r.apply(jnp.asarray(q), positions, phase_precision="float32"), np.float64)


def test_an_unverified_family_is_refused_by_name_and_read_with_the_stated_facts():
  """A model_type jaxpe has not verified (a family a newer transformers adds) is refused with its
  name, what to pass and where to check; with the facts stated it is read as transformers'
  generic RoPE. The reference is Llama's own rotary module and apply function (the config is
  Llama's under a new name)."""
  config = _llama_dict(model_type="zz_future_family")
  with pytest.raises(UnverifiedFamilyError) as info:
    rope_from_hf_config(config)
  message = str(info.value)
  for words in ("model_type 'zz_future_family'", "layout=", "rotated_slice=", "rotary_dim=", "5.25.0"):
    assert words in message, words
  assert "apply_rotary_pos_emb" in message and "docs/rope.md" in message
  # The config states no partial_rotary_factor: rotary_dim is needed too, from a dict and from a
  # config object alike (a remote-code class may spell its share otherwise).
  with pytest.raises(UnverifiedFamilyError, match="pass rotary_dim= as") as info:
    rope_from_hf_config(config, layout="half", rotated_slice="leading")
  assert "layout=" not in str(info.value).split(" as ")[0]

  class RemoteCode(transformers.PretrainedConfig):  # StableLM-3B-4E1T's remote config class
    model_type = "stablelm_epoch"

    def __init__(self, **kw):
      self.hidden_size, self.num_attention_heads, self.rope_theta = 64, 4, 10000.0
      super().__init__(**kw)

  with pytest.raises(UnverifiedFamilyError, match="pass rotary_dim="):
    rope_from_hf_config(RemoteCode(), layout="half", rotated_slice="leading")
  remote = RemoteCode()
  remote.rope_pct = 0.25  # its own key for the partial share: named, not ignored
  with pytest.raises(UnverifiedFamilyError, match="'rope_pct'"):
    rope_from_hf_config(remote, layout="half", rotated_slice="leading", rotary_dim=4)
  q, want = _rotated_by("llama", transformers.LlamaConfig(**_llama_dict()))
  r = rope_from_hf_config(config, layout="half", rotated_slice="leading", rotary_dim=16)
  assert (r.layout, r.rotated_slice, r.rotary_dim, r.model_type) == (
    "half",
    "leading",
    16,
    "zz_future_family",
  )
  np.testing.assert_allclose(_ours(r, q), want, atol=1e-3)
  wrong = rope_from_hf_config(config, layout="interleaved", rotated_slice="leading", rotary_dim=16)
  assert np.abs(_ours(wrong, q) - want).max() > 0.1  # the layout matters: nothing guessed
  # No model_type at all is named as such.
  with pytest.raises(UnverifiedFamilyError, match="a config without model_type"):
    rope_from_hf_config({k: v for k, v in config.items() if k != "model_type"})


def test_a_family_missing_from_the_tables_is_refused_not_read_as_rotate_half(monkeypatch):
  """Ergo, as jaxpe saw it before it was verified (transformers 5.25 added it; it rotates
  interleaved pairs): with the family out of the verified list and the tables, it is refused by
  name; stated, it matches Ergo's own apply_rotary_pos_emb. Verified, the table reads it right."""
  from jaxpe.ops import hf_families, hf_verified

  config = transformers.AutoConfig.for_model("ergo")
  layer_type = "sliding_attention"
  q, want = _rotated_by("ergo", config, layer_type)
  verified = rope_from_hf_config(config, layer_type=layer_type)
  assert verified.layout == "interleaved"
  np.testing.assert_allclose(_ours(verified, q), want, atol=1e-3)
  monkeypatch.setattr(hf_verified, "VERIFIED_FAMILIES", VERIFIED_FAMILIES - {"ergo"})
  monkeypatch.setattr(hf_families, "INTERLEAVED_FAMILIES", hf_families.INTERLEAVED_FAMILIES - {"ergo"})
  with pytest.raises(UnverifiedFamilyError, match="model_type 'ergo'"):
    rope_from_hf_config(config, layer_type=layer_type)
  stated = rope_from_hf_config(
    config,
    layer_type=layer_type,
    layout="interleaved",
    rotated_slice="leading",
    rotary_dim=verified.rotary_dim,
  )
  np.testing.assert_allclose(_ours(stated, q), want, atol=1e-3)


def test_hunyuan_v4_mla_heads_rotate_interleaved_pairs():
  """HunYuan-V4 calls only apply_rotary_pos_emb_interleave on its [nope | rope] heads (no
  rope_interleave flag): jaxpe read rotate-half there before transformers 5.25 was swept with the
  family's own function. The reference is that function (it returns the pairs de-interleaved)."""
  import importlib

  modeling = importlib.import_module("transformers.models.hy_v4.modeling_hy_v4")
  config = transformers.AutoConfig.for_model("hy_v4")
  r = rope_from_hf_config(config)
  assert (r.layout, r.rotated_slice) == ("interleaved", "trailing")
  module = _rotary("hy_v4", config)
  q = np.random.default_rng(2).normal(size=(1, 2, POSITIONS.shape[-1], r.head_dim)).astype(np.float32)
  with torch.no_grad():
    cos, sin = module(torch.zeros(1), torch.from_numpy(POSITIONS))
    want = modeling.apply_rotary_pos_emb_interleave(torch.from_numpy(q), torch.from_numpy(q), cos, sin)[0]
  got = _ours(r, np.transpose(q, (0, 2, 1, 3)))
  got = np.concatenate([got[..., 0::2], got[..., 1::2]], -1)  # transformers' de-interleaved order
  np.testing.assert_allclose(got, np.transpose(want.numpy(), (0, 2, 1, 3)), atol=1e-3)


def test_a_stated_value_wins_over_the_tables():
  """layout, rotated_slice and rotary_dim given for a verified family replace the table's answer
  (a checkpoint converted to the other layout), against jaxpe.apply_rope with those values (whose
  own tests compare with numpy float64)."""
  llama = _llama_dict()
  q, _ = _rotated_by("llama", transformers.LlamaConfig(**llama))
  base = rope_from_hf_config(llama)
  for kwargs in (
    {"layout": "interleaved"},
    {"rotated_slice": "trailing", "rotary_dim": 8},
    {"rotary_dim": 8},
    {"layout": "interleaved", "rotated_slice": "leading", "rotary_dim": 12},
  ):
    r = rope_from_hf_config(llama, **kwargs)
    layout, rotated_slice = kwargs.get("layout", "half"), kwargs.get("rotated_slice", "leading")
    assert (r.layout, r.rotated_slice, r.rotary_dim) == (layout, rotated_slice, kwargs.get("rotary_dim", 16))
    inv_freq = jaxpe.rope_inv_freq(r.rotary_dim, base=base.rope_theta, dtype=np.float64)
    want = jaxpe.apply_rope(
      jnp.asarray(q),
      jnp.asarray(POSITIONS, jnp.int32),
      inv_freq=tuple(inv_freq.tolist()),
      layout=layout,
      rotated_slice=rotated_slice,
      phase_precision="float32",
    )
    np.testing.assert_allclose(_ours(r, q), np.asarray(want), atol=1e-6, err_msg=str(kwargs))
  # DeepSeek-V3's MLA heads rotate their trailing qk_rope_head_dim: stated otherwise, stated wins,
  # and only the slice changes (its rope_interleave still gives the layout).
  r = rope_from_hf_config(transformers.AutoConfig.for_model("deepseek_v3"), rotated_slice="leading")
  assert (r.rotated_slice, r.layout) == ("leading", "interleaved")
  # A stated rotary_dim replaces a family's default partial factor (Phi: 0.5), not only the config's.
  phi = {"model_type": "phi", "hidden_size": 64, "num_attention_heads": 4}
  assert rope_from_hf_config(phi).rotary_dim == 8 and rope_from_hf_config(phi, rotary_dim=16).rotary_dim == 16
  # GPT-J's own rotary_dim key, replaced by the stated one.
  gptj = {"model_type": "gptj", "n_embd": 64, "n_head": 4, "rotary_dim": 8}
  assert rope_from_hf_config(gptj).rotary_dim == 8 and rope_from_hf_config(gptj, rotary_dim=4).rotary_dim == 4


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"layout": "complex"}, ValueError, "layout must be one of"),
    ({"rotated_slice": "middle"}, ValueError, "rotated_slice must be 'leading' or 'trailing'"),
    ({"rotary_dim": 5}, ValueError, "rotary_dim must be even"),
    ({"rotary_dim": 0}, ValueError, "rotary_dim must be a positive integer"),
    ({"rotary_dim": "8"}, TypeError, "rotary_dim must be a positive integer"),
    ({"rotary_dim": True}, TypeError, "rotary_dim must be a positive integer"),
    ({"rotary_dim": 18}, ValueError, "rotary_dim must be <= head_dim = 16"),
    ({"rotary_dim": 8, "partial_rotary_factor": 0.25}, ValueError, "partial_rotary_factor"),
  ],
)
def test_stated_facts_out_of_range_are_named(kwargs, error, match):
  config = _llama_dict()
  if "partial_rotary_factor" in kwargs:  # the config states 4 rotated dims, the caller 8
    config["partial_rotary_factor"] = kwargs.pop("partial_rotary_factor")
  with pytest.raises(error, match=match):
    rope_from_hf_config(config, **kwargs)


@pytest.mark.parametrize(
  "key, value",
  [
    ("qk_rope_head_dim", 16),
    ("mscale_all_dim", 1.0),
    ("rope_local_base_freq", 1e4),
    ("rotary_emb_base", 1e4),
  ],
)
def test_an_unverified_family_with_a_family_specific_key_is_refused_naming_it(key, value):
  config = _llama_dict(model_type="zz_future_family", **{key: value})
  with pytest.raises(UnverifiedFamilyError, match=f"'{key}'"):
    rope_from_hf_config(config, layout="half", rotated_slice="leading", rotary_dim=16)
  params = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
  with pytest.raises(UnverifiedFamilyError, match="'mrope_section'"):
    rope_from_hf_config(
      _llama_dict(model_type="zz_future_family", rope_parameters=params),
      layout="half",
      rotated_slice="leading",
      rotary_dim=16,
    )


@pytest.mark.parametrize(
  "model_type",
  [
    "gpt2",
    "opt",
    "mamba",
    "rwkv",
    "xglm",
    "gpt_neo",
    "biogpt",
    "bloom",
    "bart",
    "falcon_mamba",
    "mt5",
    "reformer",
  ],
)
def test_text_decoders_without_rope_are_told_so(model_type):
  """Their modeling code has no rotary embedding (checked in transformers 5.25): the error says so
  instead of asking for a rope_theta; from the config object and its config.json dict alike."""
  config = transformers.AutoConfig.for_model(model_type)
  for given in (config, config.to_dict()):
    with pytest.raises(ValueError, match=f"model_type '{model_type}' has no rotary embedding") as info:
      rope_from_hf_config(given)
    assert "rope_theta" not in str(info.value)


def test_an_unverified_config_without_rotary_keys_says_it_may_have_none():
  with pytest.raises(UnverifiedFamilyError, match="none of the rotary keys.*may have no rotary embedding"):
    rope_from_hf_config({"model_type": "zz_new_lm", "hidden_size": 64, "num_attention_heads": 4})


def test_every_verified_family_the_installed_transformers_ships_is_a_model_type_or_a_table_entry():
  """The verified list names model types, not typos: each is one the installed transformers knows,
  or one the tables carry for an older release."""
  from transformers.models.auto.configuration_auto import CONFIG_MAPPING

  from jaxpe.ops import hf_axial, hf_families

  tables = set(hf_families.INTERLEAVED_FAMILIES) | set(hf_families.MLA_FAMILIES)
  tables |= set(hf_families.MROPE_LAYOUTS) | set(hf_families.FAMILY_DEFAULTS) | set(hf_axial.AXIAL_LAYOUTS)
  unknown = sorted(VERIFIED_FAMILIES - set(CONFIG_MAPPING.keys()) - tables)
  assert not unknown, unknown
  assert not (VERIFIED_FAMILIES & hf_families.NO_ROPE_FAMILIES)


def test_a_family_specific_key_is_named_before_the_facts_are_asked_for():
  config = _llama_dict(model_type="zz_future_family", qk_rope_head_dim=8)
  with pytest.raises(UnverifiedFamilyError, match="'qk_rope_head_dim'"):
    rope_from_hf_config(config)
  assert (
    rope_from_hf_config(
      _llama_dict(model_type="zz_future_family", alibi=False),
      layout="half",
      rotated_slice="leading",
      rotary_dim=16,
    ).rotary_dim
    == 16
  )  # alibi: false states no ALiBi


def test_composites_and_unlisted_rope_models_are_not_called_ropeless():
  """PI0 (PaliGemma + Gemma sub-configs) and Baichuan (RoPE at 7B, not shipped by transformers) are
  not in NO_ROPE_FAMILIES: Baichuan reads with the facts stated."""
  from jaxpe.ops.hf_verified import NO_ROPE_FAMILIES

  assert not {"pi0", "baichuan"} & NO_ROPE_FAMILIES
  baichuan = {"model_type": "baichuan", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e4}
  r = rope_from_hf_config(baichuan, layout="half", rotated_slice="leading", rotary_dim=16)
  assert r.rotary_dim == 16 and r.layout == "half"


def test_bad_model_type_and_array_arguments_are_named():
  with pytest.raises(TypeError, match="model_type"):
    rope_from_hf_config(_llama_dict(model_type=["llama"]))
  with pytest.raises(ValueError, match="rotated_slice must be"):
    rope_from_hf_config(_llama_dict(), rotated_slice=np.array(["trailing"]))


def test_a_verified_familys_config_json_without_its_default_partial_factor_reads_as_the_object():
  """Kind: a class default that a config.json leaves out (transformers writes only what differs
  from the class defaults). For every verified model type with a flat rope dict, its default
  config's dict without partial_rotary_factor (top level and in the dict) reads as the config
  object does (the same rotary_dim and inv_freq), or is refused; never a silent full rotation."""
  import warnings

  from transformers.models.auto.configuration_auto import CONFIG_MAPPING

  checked = []
  for model_type in sorted(VERIFIED_FAMILIES & set(CONFIG_MAPPING.keys())):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      try:
        config = CONFIG_MAPPING[model_type]()
        config = config.get_text_config()
      except Exception:  # noqa: BLE001 - configs that need arguments, several text configs
        continue
    try:
      want = rope_from_hf_config(config)
    except ValueError:  # per-layer-type configs, refused ones: the sweep covers them
      continue
    d = config.to_dict()
    params = d.get("rope_parameters")
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
      continue
    d.pop("partial_rotary_factor", None)
    d["rope_parameters"] = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    try:
      got = rope_from_hf_config(d)
    except ValueError:
      continue
    assert got.rotary_dim == want.rotary_dim, (model_type, got.rotary_dim, want.rotary_dim)
    np.testing.assert_array_equal(got.inv_freq, want.inv_freq, err_msg=model_type)
    checked.append(model_type)
  assert len(checked) > 150 and {"qwen3_next", "nemotron", "glm4_moe", "phi", "gpt_neox"} <= set(checked)
