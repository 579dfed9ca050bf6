"""jaxpe.bloom against transformers' BloomForCausalLM (tiny configs, random weights, float32).

References are independent: transformers' PyTorch BLOOM for logits and generation, closed-form index
arithmetic for the weight placement, the small-angle bound for the emulated bias.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import stat

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest


class _Imported:
  """A module imported at its first attribute, by the test that uses it, not when the suite is
  collected (torch and transformers take seconds); the `bloom` extra, installed by jaxpe[test]."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    return getattr(importlib.import_module(self._name), attr)


torch = _Imported("torch")
transformers = _Imported("transformers")

from flax import nnx  # noqa: E402

from jaxpe import bloom  # noqa: E402
from jaxpe.model.cache import init_cache  # noqa: E402
from jaxpe.model.config import ModelConfig  # noqa: E402
from jaxpe.model.decoder import Decoder  # noqa: E402
from jaxpe.model.generate import generate  # noqa: E402
from jaxpe.ops import alibi as alibi_lib  # noqa: E402

TOL = 1e-4  # max |delta logit| the issue asks for in float32
V, D, L, N = 97, 48, 2, 6  # N = 6: not a power of two, exercises the second slope series


def make_hf(seed=0, *, tie=True, n_head=N, hidden=D):
  """A tiny BloomForCausalLM with spread-out random weights (all biases and LayerNorms random too)."""
  torch.manual_seed(seed)
  cfg = transformers.BloomConfig(
    vocab_size=V, hidden_size=hidden, n_layer=L, n_head=n_head, initializer_range=0.3, tie_word_embeddings=tie
  )
  hf = transformers.BloomForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if p.ndim == 1:
        p.add_(0.2 * torch.randn_like(p))
      elif name.endswith("dense_4h_to_h.weight") or name.endswith("dense.weight"):
        p.mul_(0.3)  # keep the residual stream tame with init 0.3
  return hf


def hf_logits(hf, tokens, mask=None):
  with torch.no_grad():
    out = hf(
      torch.as_tensor(np.asarray(tokens)),
      attention_mask=None if mask is None else torch.as_tensor(np.asarray(mask)),
    )
  return out.logits.numpy()


def left_padded(rng, lengths, t_len):
  tokens = rng.integers(0, V, (len(lengths), t_len))
  mask = np.zeros((len(lengths), t_len), np.int64)
  for b, n in enumerate(lengths):
    mask[b, t_len - n :] = 1
  return tokens, mask


@pytest.fixture(scope="module")
def hf_model():
  return make_hf()


@pytest.fixture(scope="module")
def jx_model(hf_model):
  return bloom.from_hf(hf_model)


@nnx.jit
def call(model, tokens, mask, cache=None):
  """``model(tokens, attention_mask=mask[, cache=cache])`` under jit (fast on CPU)."""
  return model(tokens, attention_mask=mask, cache=cache)


def max_delta(a, b, mask=None):
  d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
  if mask is not None:
    d = d * np.asarray(mask)[..., None]
  return float(d.max())


# ------------------------------------------------------------------------------------------------
# Logit equivalence


class LogitsTest(chex.TestCase):
  @classmethod
  def setUpClass(cls):
    cls.hf = make_hf(1)
    cls.model = bloom.from_hf(cls.hf)
    cls.graphdef, cls.state = nnx.split(cls.model)

  def forward(self):
    graphdef = self.graphdef

    def f(state, tokens, mask):
      return nnx.merge(graphdef, state)(tokens, attention_mask=mask)

    return self.variant(f)

  @chex.variants(with_jit=True, without_jit=True)
  def test_single_sequence(self):
    tokens = np.random.default_rng(0).integers(0, V, (1, 33))
    mask = np.ones_like(tokens)
    out = self.forward()(self.state, jnp.asarray(tokens), jnp.asarray(mask))
    ref = hf_logits(self.hf, tokens)
    assert np.abs(ref).max() > 1.0  # logits are not trivially small
    assert max_delta(out, ref) <= TOL

  @chex.variants(with_jit=True, without_jit=True)
  def test_left_padded_batch(self):
    tokens, mask = left_padded(np.random.default_rng(1), [24, 17, 5, 1], 24)
    out = self.forward()(self.state, jnp.asarray(tokens), jnp.asarray(mask))
    ref = hf_logits(self.hf, tokens, mask)
    assert max_delta(out, ref, mask) <= TOL
    # Each padded row also equals the same sequence run alone without padding.
    for b in range(tokens.shape[0]):
      n = int(mask[b].sum())
      alone = hf_logits(self.hf, tokens[b : b + 1, -n:])
      assert max_delta(np.asarray(out)[b : b + 1, -n:], alone) <= TOL


def test_cached_decoding_matches_transformers(hf_model, jx_model):
  tokens, mask = left_padded(np.random.default_rng(2), [12, 7, 3], 12)
  steps = 6
  full = np.random.default_rng(3).integers(0, V, (3, 12 + steps))
  full[:, :12] = tokens
  full_mask = np.concatenate([mask, np.ones((3, steps), np.int64)], axis=1)
  ref = hf_logits(hf_model, full, full_mask)
  cache = init_cache(jx_model.cfg, 3, 12 + steps)
  logits, cache = call(jx_model, jnp.asarray(tokens), jnp.asarray(mask), cache)
  assert max_delta(logits, ref[:, :12], mask) <= TOL
  for t in range(12, 12 + steps):
    logits, cache = call(jx_model, jnp.asarray(full[:, t : t + 1]), jnp.ones((3, 1), jnp.int32), cache)
    assert max_delta(logits[:, 0], ref[:, t]) <= TOL


def test_untied_output_head_round_trip():
  hf = make_hf(4, tie=False)
  model = bloom.from_hf(hf)
  assert not model.cfg.tie_embeddings
  tokens = np.random.default_rng(4).integers(0, V, (2, 9))
  assert max_delta(call(model, jnp.asarray(tokens), None), hf_logits(hf, tokens)) <= TOL
  back = bloom.to_transformers(model)
  np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


def test_power_of_two_heads():
  hf = make_hf(5, n_head=4, hidden=32)
  tokens = np.random.default_rng(5).integers(0, V, (1, 20))
  assert max_delta(call(bloom.from_hf(hf), jnp.asarray(tokens), None), hf_logits(hf, tokens)) <= TOL


# ------------------------------------------------------------------------------------------------
# Checkpoint formats and the round trip


def _save(hf, path, fmt):
  if fmt == "safetensors":
    hf.save_pretrained(path)
  elif fmt == "sharded":
    hf.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
  elif fmt == "bin":
    path.mkdir(parents=True, exist_ok=True)
    hf.config.save_pretrained(path)
    torch.save(hf.state_dict(), path / "pytorch_model.bin")
  elif fmt == "no_prefix":  # BloomModel-style keys (as in bigscience's own checkpoints), fp16 weights
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf.config.save_pretrained(path)
    state = {
      k.removeprefix("transformer."): v.to(torch.float16).contiguous()
      for k, v in hf.state_dict().items()
      if k != "lm_head.weight"
    }
    save_file(state, str(path / "model.safetensors"))
  return path


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin", "no_prefix"])
def test_load_checkpoint_formats(hf_model, tmp_path, fmt):
  path = _save(hf_model, tmp_path / fmt, fmt)
  model = bloom.from_hf(path)
  tokens = np.random.default_rng(6).integers(0, V, (2, 11))
  if fmt == "no_prefix":  # the reference is the fp16-rounded model
    ref_model = make_hf()
    with torch.no_grad():
      for p in ref_model.parameters():
        p.copy_(p.to(torch.float16).to(torch.float32))
    ref = hf_logits(ref_model, tokens)
  else:
    ref = hf_logits(hf_model, tokens)
  assert max_delta(call(model, jnp.asarray(tokens), None), ref) <= TOL  # one compile for the four formats


def test_bfloat16_parameters_import_and_export(hf_model):
  """param_dtype=bfloat16: the weights rounded to nearest; logits as transformers' BLOOM with the same
  rounded weights (a bfloat16 copy cast back to float32), and the export gives those weights back."""
  model = bloom.from_hf(hf_model, param_dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
  rounded = transformers.BloomForCausalLM(hf_model.config).eval()
  rounded.load_state_dict(
    {k: v.to(torch.bfloat16).to(torch.float32) for k, v in hf_model.state_dict().items()}
  )
  tokens, mask = left_padded(np.random.default_rng(8), [11, 6], 11)
  assert (
    max_delta(call(model, jnp.asarray(tokens), jnp.asarray(mask)), hf_logits(rounded, tokens, mask), mask)
    <= TOL
  )
  want = rounded.state_dict()
  for key, value in bloom.to_hf_state_dict(model).items():
    np.testing.assert_array_equal(value, want[key].numpy(), err_msg=key)


def test_round_trip_identical_logits(hf_model, jx_model, tmp_path):
  bloom.save_hf(jx_model, tmp_path / "out")
  cfg = json.loads((tmp_path / "out" / "config.json").read_text())
  assert cfg["model_type"] == "bloom"
  loaded = transformers.BloomForCausalLM.from_pretrained(tmp_path / "out").eval()
  tokens, mask = left_padded(np.random.default_rng(7), [15, 9], 15)
  np.testing.assert_array_equal(hf_logits(loaded, tokens, mask), hf_logits(hf_model, tokens, mask))
  original = hf_model.state_dict()
  for key, value in loaded.state_dict().items():
    np.testing.assert_array_equal(value.numpy(), original[key].numpy(), err_msg=key)
  # an existing export is never replaced silently, and a replacement leaves no temporary files
  with pytest.raises(FileExistsError, match="overwrite=True"):
    bloom.save_hf(jx_model, tmp_path / "out")
  bloom.save_hf(jx_model, tmp_path / "out", overwrite=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_save_hf_writes_only_its_own_files_with_normal_permissions(jx_model, tmp_path, monkeypatch):
  umask = os.umask(0)
  os.umask(umask)
  out = tmp_path / "hf"
  bloom.save_hf(jx_model, out)
  assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
  assert all(stat.S_IMODE((out / n).stat().st_mode) == 0o666 & ~umask for n in bloom.EXPORT_FILES)
  # An HF directory keeps the files it had besides the export's two.
  (out / "tokenizer.json").write_text('{"tok": 1}')
  (out / "README.md").write_text("model card")
  bloom.save_hf(jx_model, out, overwrite=True)
  assert sorted(p.name for p in out.iterdir()) == [
    "README.md",
    "config.json",
    "model.safetensors",
    "tokenizer.json",
  ]
  assert (out / "tokenizer.json").read_text() == '{"tok": 1}' and (
    out / "README.md"
  ).read_text() == "model card"
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  # Never the current directory or one of its parents, whatever the flags.
  monkeypatch.chdir(out)
  for target in (".", "..", str(tmp_path), "/", str(out) + "/./"):
    with pytest.raises(ValueError, match="current directory or one of its parents"):
      bloom.save_hf(jx_model, target, overwrite=True, force=True)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  # A non-empty directory that is not a BLOOM export is refused unless forced, and then kept.
  notes = tmp_path / "notes"
  notes.mkdir()
  (notes / "todo.txt").write_text("keep me")
  for kwargs in ({}, {"overwrite": True}):
    with pytest.raises(FileExistsError, match="not a BLOOM export; pass force=True"):
      bloom.save_hf(jx_model, notes, **kwargs)
  assert [p.name for p in notes.iterdir()] == ["todo.txt"]
  bloom.save_hf(jx_model, notes, force=True)
  assert sorted(p.name for p in notes.iterdir()) == ["config.json", "model.safetensors", "todo.txt"]
  assert transformers.BloomConfig.from_pretrained(notes).n_layer == jx_model.cfg.num_layers
  # Other weight files would mix with the export: refused even when forced.
  (notes / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(ValueError, match=r"other weight files \(pytorch_model.bin\)"):
    bloom.save_hf(jx_model, notes, overwrite=True, force=True)
  (tmp_path / "file").write_text("x")
  with pytest.raises(FileExistsError, match="not a directory"):
    bloom.save_hf(jx_model, tmp_path / "file", force=True)
  # Another model's HF directory (or a config.json that is not a BLOOM one): force=True kept its
  # other files but replaced its config.json and model.safetensors. Refused whatever the flags.
  for name, files in (
    ("llama", {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"llama weights"}),
    ("broken", {"config.json": b"{not json", "notes.txt": b"x"}),
    ("weights", {"model.safetensors": b"someone's weights"}),
  ):
    other = tmp_path / name
    other.mkdir()
    for file, content in files.items():
      (other / file).write_bytes(content)
    with pytest.raises(FileExistsError, match=r"not from a BLOOM export.* would replace them"):
      bloom.save_hf(jx_model, other, overwrite=True, force=True)
    assert {f.name: f.read_bytes() for f in other.iterdir()} == files


# ------------------------------------------------------------------------------------------------
# Weight placement: a synthetic state dict whose values encode their own indices


def _index_state_dict(cfg: ModelConfig):
  """Every tensor holds ``tag * 1e5 + flat index`` (exact in float32 below 2**24)."""
  rules = bloom.weight_rules(cfg)
  dims = bloom.Dims.of(cfg)
  sd = {}
  for tag, rule in enumerate(rules):
    shape = rule.hf_shape(dims)
    sd["transformer." + rule.hf] = (
      torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + tag * 1e5
    )
  return sd


def test_query_key_value_rows_land_in_place():
  cfg = ModelConfig(
    vocab_size=11, d_model=12, num_layers=2, num_heads=3, pos_encoding="alibi", use_bias=True, embed_layernorm=True,
    gelu_approximate=True,
  )  # fmt: skip
  sd = _index_state_dict(cfg)
  params = bloom.params_from_hf(sd, cfg)
  d, n, h = 12, 3, 4
  for i in range(2):
    w = sd[f"transformer.h.{i}.self_attention.query_key_value.weight"].numpy()
    b = sd[f"transformer.h.{i}.self_attention.query_key_value.bias"].numpy()
    w0, b0 = w[0, 0], b[0]  # the tag offset
    for j, name in enumerate("qkv"):
      kernel = params[f"blocks.{i}.attn.{name}.kernel"]
      bias = params[f"blocks.{i}.attn.{name}.bias"]
      for head in range(n):
        for dim in range(h):
          row = head * 3 * h + j * h + dim  # HF view(N, 3, H) of the fused output
          assert bias[head, dim] == b0 + row
          for col in range(d):
            assert kernel[col, head, dim] == w0 + row * d + col
    o = params[f"blocks.{i}.attn.o.kernel"]
    w_o = sd[f"transformer.h.{i}.self_attention.dense.weight"].numpy()
    for head in range(n):
      for dim in range(h):
        for out in range(d):
          assert o[head, dim, out] == w_o[0, 0] + out * d + head * h + dim
    up = params[f"blocks.{i}.mlp.up.kernel"]
    w_up = sd[f"transformer.h.{i}.mlp.dense_h_to_4h.weight"].numpy()
    assert up[5, 17] == w_up[0, 0] + 17 * d + 5
  # Every HF value appears exactly once among the jaxpe parameters (nothing dropped or duplicated).
  hf_values = np.sort(np.concatenate([v.numpy().ravel() for v in sd.values()]))
  jx_values = np.sort(np.concatenate([v.ravel() for v in params.values()]))
  np.testing.assert_array_equal(hf_values, jx_values)
  # And the exporter puts every value back where it came from.
  back = bloom.to_hf_state_dict(bloom.build_model(cfg, params))
  assert back.keys() == sd.keys()
  for key, value in sd.items():
    np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)


# ------------------------------------------------------------------------------------------------
# Conversion to RoPE-emulated ALiBi


def _layer0_scores(model, tokens):
  """Scores (q.k / sqrt(H) plus any ALiBi bias) of layer 0, ``[B, N, T, T]`` float64, computed here."""
  cfg = model.cfg
  block = model.blocks[0]
  x = model.embed_norm(model.embed(jnp.asarray(tokens)))
  x = block.attn_norm(x.astype(jnp.float32))
  q, k = np.asarray(block.attn.q(x), np.float64), np.asarray(block.attn.k(x), np.float64)
  t = tokens.shape[1]
  pos = np.arange(t)
  h = cfg.head_size
  if cfg.pos_encoding == "rope_alibi":  # rotate the last pair by position * theta, in float64
    from jaxpe.model.encodings import emulation_theta

    ang = pos * emulation_theta(cfg)
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    for arr in (q, k):
      a, b = arr[..., h].copy(), arr[..., h + 1].copy()
      arr[..., h], arr[..., h + 1] = a * c - b * s, a * s + b * c
  scores = np.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(h)
  if cfg.pos_encoding == "alibi":
    slopes = alibi_lib.alibi_slopes_f64(cfg.num_heads)
    scores = scores - slopes[None, :, None, None] * (pos[:, None] - pos[None, :])[None, None]
  return scores


@pytest.mark.parametrize("max_phase", [0.1, 1.0])
def test_emulated_scores_within_bound(jx_model, max_phase):
  t = 40
  emu = bloom.to_emulated(jx_model, context=t, max_phase=max_phase)
  assert emu.cfg.rope_alibi_in_projection and emu.cfg.pos_encoding == "rope_alibi"
  tokens = np.random.default_rng(8).integers(0, V, (2, t))
  native, emulated = _layer0_scores(jx_model, tokens), _layer0_scores(emu, tokens)
  row = np.arange(t)[:, None] + np.zeros((1, t), np.int64)
  dist = row - np.arange(t)[None, :]
  bound = bloom.bias_error_bound(emu.cfg, np.maximum(dist, 0), row)[None]  # [1, N, T, S], solver's bound
  causal = (dist >= 0)[None, None]
  err = np.abs(emulated - native)
  assert np.all((err <= bound * (1 + 1e-6) + 1e-5) | ~causal)
  # The bound is tight: at the largest distance the error reaches most of it (x^3/6 leads).
  far = err[:, :, t - 1, 0].max()
  assert far >= 0.8 * bound[0, :, t - 1, 0].max()


def test_emulated_target_error_from_solver(jx_model):
  t, target = 40, 2e-3
  emu = bloom.to_emulated(jx_model, context=t, target_error=target)
  tokens = np.random.default_rng(13).integers(0, V, (2, t))
  err = np.abs(_layer0_scores(emu, tokens) - _layer0_scores(jx_model, tokens))
  causal = (np.arange(t)[:, None] >= np.arange(t)[None, :])[None, None]
  assert np.all((err <= target) | ~causal)
  assert err[causal.repeat(2, 0).repeat(N, 1)].max() >= 0.5 * target  # the solver used the budget


def test_emulated_model_close_to_native(jx_model):
  tokens, mask = left_padded(np.random.default_rng(9), [40, 25], 40)
  emu = bloom.to_emulated(jx_model, context=64, max_phase=0.01)
  native = call(jx_model, jnp.asarray(tokens), jnp.asarray(mask))
  out = call(emu, jnp.asarray(tokens), jnp.asarray(mask))
  assert max_delta(out, native, mask) <= 1e-3
  # and with the KV cache, decoding the last token
  cache = init_cache(emu.cfg, 2, 40)
  _, cache = call(emu, jnp.asarray(tokens[:, :-1]), jnp.asarray(mask[:, :-1]), cache)
  last, _ = call(emu, jnp.asarray(tokens[:, -1:]), jnp.ones((2, 1), jnp.int32), cache)
  assert max_delta(last[:, 0], native[:, -1]) <= 1e-3


def test_in_projection_option_matches_appended_dims():
  """ModelConfig.rope_alibi_in_projection (fresh init) equals the ops-level appended-dims form."""
  base = ModelConfig(
    vocab_size=V, d_model=32, num_layers=2, num_heads=4, max_len=64, pos_encoding="rope_alibi", use_bias=True
  )
  # The "rbg" PRNG: the same init code, 13 -> 5 s of CPU (threefry's draws compile per weight shape).
  appended = Decoder(base, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
  inproj = Decoder(
    base.model_copy(update={"rope_alibi_in_projection": True}), rngs=nnx.Rngs(jax.random.key(1, impl="rbg"))
  )
  params = bloom.model_params(inproj)
  theta, h = 0.1 / 64, 8
  amp = np.array([2.0 ** (-2 * (i + 1)) for i in range(4)]) * math.sqrt(h) / theta  # m_h sqrt(H) / theta
  for i in range(2):
    for name in "qk":
      np.testing.assert_array_equal(params[f"blocks.{i}.attn.{name}.kernel"][..., h:], 0)
    np.testing.assert_allclose(
      params[f"blocks.{i}.attn.q.bias"][:, h:], np.stack([-amp, 0 * amp], -1), rtol=1e-6
    )
    np.testing.assert_array_equal(params[f"blocks.{i}.attn.k.bias"][:, h:], [[0.0, 1.0]] * 4)
  for path, value in bloom.model_params(appended).items():
    if ".attn.q." in path or ".attn.k." in path:
      params[path] = np.concatenate([value, params[path][..., h:]], axis=-1)
    else:
      params[path] = value
  model = bloom.build_model(inproj.cfg, params)
  tokens = np.random.default_rng(10).integers(0, V, (2, 30))
  ones = jnp.ones(tokens.shape, jnp.int32)
  assert max_delta(call(model, jnp.asarray(tokens), ones), call(appended, jnp.asarray(tokens), ones)) <= 1e-5


# ------------------------------------------------------------------------------------------------
# Generation


def test_greedy_generation_matches_transformers(hf_model, jx_model):
  prompt, mask = left_padded(np.random.default_rng(11), [8, 5, 2], 8)
  new = 12
  ours = generate(jx_model, jnp.asarray(prompt), attention_mask=jnp.asarray(mask), max_new_tokens=new)
  with torch.no_grad():
    ref = hf_model.generate(
      torch.as_tensor(prompt),
      attention_mask=torch.as_tensor(mask),
      max_new_tokens=new,
      min_new_tokens=new,
      do_sample=False,
      pad_token_id=0,
      eos_token_id=None,
    )
  np.testing.assert_array_equal(np.asarray(ours), ref[:, 8:].numpy())


def test_sampled_generation(jx_model):
  # the shapes of test_greedy_generation_matches_transformers: its compiled greedy program is reused
  prompt, mask = left_padded(np.random.default_rng(12), [8, 6, 3], 8)
  args = dict(attention_mask=jnp.asarray(mask), max_new_tokens=12)
  greedy = generate(jx_model, jnp.asarray(prompt), **args)
  top1 = generate(jx_model, jnp.asarray(prompt), temperature=0.7, top_k=1, rng=jax.random.key(0), **args)
  np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))
  a = generate(jx_model, jnp.asarray(prompt), temperature=1.5, rng=jax.random.key(1), **args)
  b = generate(jx_model, jnp.asarray(prompt), temperature=1.5, rng=jax.random.key(1), **args)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(a).min() >= 0 and np.asarray(a).max() < V


# ------------------------------------------------------------------------------------------------
# Bad input


def _config(**changes):
  cfg = {"model_type": "bloom", "vocab_size": V, "hidden_size": D, "n_layer": L, "n_head": N}
  cfg.update(changes)
  return cfg


@pytest.mark.parametrize(
  "changes, match",
  [
    ({"model_type": "gpt2"}, "model_type must be 'bloom'"),
    ({"model_type": None}, "model_type must be 'bloom'"),
    ({"hidden_size": 50}, "hidden_size .* divisible by n_head"),
    ({"n_layer": 0}, "n_layer must be a positive integer"),
    ({"vocab_size": 9.5}, "vocab_size must be a positive integer"),
    ({"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
  ],
)
def test_bad_config(changes, match):
  with pytest.raises(ValueError, match=match):
    bloom.config_from_hf(_config(**changes))


def test_bad_config_type():
  with pytest.raises(TypeError, match="hf_config must be a mapping"):
    bloom.config_from_hf(["bloom"])


def test_state_dict_errors(hf_model):
  sd = dict(hf_model.state_dict())
  cfg = _config()
  missing = {k: v for k, v in sd.items() if k != "transformer.h.1.mlp.dense_4h_to_h.bias"}
  with pytest.raises(bloom.CheckpointError, match=r"missing keys \['h.1.mlp.dense_4h_to_h.bias'\]"):
    bloom.from_hf(missing, hf_config=cfg)
  with pytest.raises(bloom.CheckpointError, match=r"unexpected keys \['h.2.ln.weight'\]"):
    bloom.from_hf({**sd, "transformer.h.2.ln.weight": torch.zeros(D)}, hf_config=cfg)
  bad_shape = {**sd, "transformer.h.0.self_attention.query_key_value.weight": torch.zeros(3 * D, D + 1)}
  with pytest.raises(
    bloom.CheckpointError, match=r"'h.0.self_attention.query_key_value.weight' has shape \(144, 49\)"
  ):
    bloom.from_hf(bad_shape, hf_config=cfg)
  with pytest.raises(bloom.CheckpointError, match="'ln_f.bias' must be a float"):
    bloom.from_hf({**sd, "transformer.ln_f.bias": torch.zeros(D, dtype=torch.int64)}, hf_config=cfg)
  with pytest.raises(bloom.CheckpointError, match="twice"):
    bloom.from_hf({**sd, "ln_f.bias": sd["transformer.ln_f.bias"]}, hf_config=cfg)
  with pytest.raises(bloom.CheckpointError, match="'lm_head.weight' has shape"):
    bloom.from_hf({**sd, "lm_head.weight": torch.zeros(V, D + 1)}, hf_config=cfg)
  with pytest.raises(bloom.CheckpointError, match="missing keys"):  # a config of another size
    bloom.from_hf(sd, hf_config=_config(n_layer=3))
  with pytest.raises(ValueError, match="hf_config is required"):
    bloom.from_hf(sd)
  with pytest.raises(TypeError, match="source must be"):
    bloom.from_hf(42)


def test_file_errors(hf_model, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    bloom.from_hf(tmp_path / "nope")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    bloom.from_hf(tmp_path / "empty")
  (tmp_path / "empty" / "config.json").write_text(json.dumps(_config()))
  with pytest.raises(FileNotFoundError, match="none of the weight files"):
    bloom.from_hf(tmp_path / "empty")
  (tmp_path / "empty" / "config.json").write_text("{not json")
  with pytest.raises(bloom.CheckpointError, match="cannot parse"):
    bloom.from_hf(tmp_path / "empty")

  st = _save(hf_model, tmp_path / "st", "safetensors") / "model.safetensors"
  data = st.read_bytes()
  st.write_bytes(data[: len(data) // 2])  # truncated
  with pytest.raises(bloom.CheckpointError, match=r"cannot read safetensors file .*model.safetensors"):
    bloom.from_hf(st.parent)
  st.write_bytes(b"\x00garbage" * 10)  # corrupt header
  with pytest.raises(bloom.CheckpointError, match="cannot read safetensors file"):
    bloom.from_hf(st.parent)

  pt = _save(hf_model, tmp_path / "bin", "bin") / "pytorch_model.bin"
  data = pt.read_bytes()
  pt.write_bytes(data[: len(data) // 2])
  with pytest.raises(bloom.CheckpointError, match=r"cannot read PyTorch checkpoint .*pytorch_model.bin"):
    bloom.from_hf(pt.parent)

  sharded = _save(hf_model, tmp_path / "sh", "sharded")
  index = json.loads((sharded / "model.safetensors.index.json").read_text())
  shard = sorted(set(index["weight_map"].values()))[-1]
  (sharded / shard).unlink()
  with pytest.raises(bloom.CheckpointError, match=f"shard .*{shard}.* does not exist"):
    bloom.from_hf(sharded)


def test_export_and_convert_errors(jx_model, tmp_path):
  rope_cfg = ModelConfig(
    vocab_size=V, d_model=D, num_layers=1, num_heads=N, pos_encoding="rope", use_bias=True
  )
  # refused by its config before any weight is read: shapes only, no random init (seconds of compiles)
  rope_model = nnx.eval_shape(lambda: Decoder(rope_cfg, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="pos_encoding must be 'alibi' to be a BLOOM model"):
    bloom.save_hf(rope_model, tmp_path / "x")
  assert not (tmp_path / "x").exists()
  no_ln = jx_model.cfg.model_copy(update={"embed_layernorm": False})
  with pytest.raises(ValueError, match="embed_layernorm must be True"):
    bloom.hf_config_from(no_ln)
  with pytest.raises(ValueError, match="pos_encoding must be 'alibi' to convert"):
    bloom.to_emulated(rope_model)
  with pytest.raises(ValueError, match="max_phase must be in"):
    bloom.to_emulated(jx_model, max_phase=2.0)
  for context in (0, -5, 2.5):  # named as the caller named it, not as the solver's max_len
    with pytest.raises(
      ValueError, match=rf"^context must be a positive integer, got {context}( \(float\))?$"
    ):
      bloom.to_emulated(jx_model, context=context)
  with pytest.raises(ValueError, match="rope_alibi_in_projection=True needs"):
    ModelConfig(pos_encoding="rope_alibi", rope_alibi_in_projection=True, use_bias=False)
  with pytest.raises(bloom.CheckpointError, match="missing"):
    bloom.build_model(jx_model.cfg, {})


# ------------------------------------------------------------------------------------------------
# Every public BLOOM size maps (shapes only: transformers builds the model on the meta device)

BLOOM_SIZES = {  # hidden_size, n_head, n_layer of bigscience/bloom-{560m, 1b1, 1b7, 3b, 7b1}
  "560m": (1024, 16, 24),
  "1b1": (1536, 16, 24),
  "1b7": (2048, 16, 24),
  "3b": (2560, 32, 30),
  "7b1": (4096, 32, 30),
}


@pytest.mark.parametrize("size", ["560m", "7b1"])  # 16 and 32 heads, 24 and 30 layers; the others are alike
def test_every_bloom_size_maps(size):
  hidden, heads, layers = BLOOM_SIZES[size]
  hf_cfg = transformers.BloomConfig(vocab_size=250880, hidden_size=hidden, n_head=heads, n_layer=layers)
  with torch.device("meta"):
    hf = transformers.BloomForCausalLM(hf_cfg)
  hf_shapes = {k.removeprefix("transformer."): tuple(v.shape) for k, v in hf.state_dict().items()}
  cfg = bloom.config_from_hf(hf_cfg)
  dims = bloom.Dims.of(cfg)
  rules = bloom.weight_rules(cfg)
  assert {r.hf for r in rules} == hf_shapes.keys() - {"lm_head.weight"}
  for r in rules:
    assert r.hf_shape(dims) == hf_shapes[r.hf], r.hf
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  jx_count = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
  hf_count = sum(math.prod(s) for k, s in hf_shapes.items() if k != "lm_head.weight")  # tied
  assert jx_count == hf_count


def test_large_embedding_offset_stays_within_the_promise():
  # issue 17: an offset of 30 on every word embedding put a BLOOM 4.9e-3 off transformers (fast
  # variance in the embedding LayerNorm); the exact variance keeps it at float32 rounding. Untied, so
  # the offset reaches the logits only through that LayerNorm (tied, it scales them to ~90).
  hf = make_hf(3, tie=False)
  with torch.no_grad():
    hf.transformer.word_embeddings.weight.add_(30.0)
  model = bloom.from_hf(hf)
  tokens, mask = left_padded(np.random.default_rng(5), [16, 9], 16)
  ref = hf_logits(hf, tokens, mask)
  out = call(model, jnp.asarray(tokens), jnp.asarray(mask))
  assert np.abs(ref).max() > 1.0
  assert max_delta(out, ref, mask) <= TOL
