"""Cached generation equals step-by-step argmax over full forwards; left padding does not change
a row's continuation; bad arguments and bad meshes fail clearly."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder
from jaxpe.model.generate import generate
from jaxpe.train import sharding


def _greedy_without_cache(model, row, n):
  row = list(row)
  for _ in range(n):
    row.append(int(jnp.argmax(model(jnp.asarray([row], jnp.int32))[0, -1])))
  return row[-n:]


@pytest.mark.parametrize("pe", ["learned", "rope", "alibi", "rope_alibi"])
def test_greedy_left_padded_batch_matches_full_forward(pe):
  # init_std 0.5 gives a random model whose argmax changes from step to step.
  cfg = ModelConfig(
    vocab_size=32, d_model=32, num_layers=2, num_heads=4, max_len=32, pos_encoding=pe, init_std=0.5
  )
  model = Decoder(cfg, rngs=nnx.Rngs(1))
  rows = [[3, 1, 4, 1, 5], [9, 2, 6]]
  prompt = jnp.asarray([rows[0], [0, 0] + rows[1]], jnp.int32)
  mask = jnp.asarray([[1] * 5, [0, 0, 1, 1, 1]], bool)
  out = generate(model, prompt, attention_mask=mask, max_new_tokens=6)
  expected = [_greedy_without_cache(model, r, 6) for r in rows]
  assert out.tolist() == expected
  assert len({t for r in expected for t in r}) > 1  # the check is not vacuous


def test_sampling_is_reproducible_and_respects_top_k():
  cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=4, init_std=0.5)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  prompt = jnp.asarray([[1, 2, 3]], jnp.int32)
  a = generate(model, prompt, max_new_tokens=8, temperature=1.0, top_k=1, rng=jax.random.key(0))
  np.testing.assert_array_equal(a, generate(model, prompt, max_new_tokens=8))  # top-1 = greedy
  b = generate(model, prompt, max_new_tokens=8, temperature=1.0, rng=jax.random.key(3))
  np.testing.assert_array_equal(
    b, generate(model, prompt, max_new_tokens=8, temperature=1.0, rng=jax.random.key(3))
  )


def test_generate_rejects_bad_arguments():
  model = Decoder(ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
  prompt = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, prompt, max_new_tokens=0)
  with pytest.raises(ValueError, match="rng is required"):
    generate(model, prompt, max_new_tokens=2, temperature=0.5)
  with pytest.raises(ValueError, match="top_k"):
    generate(model, prompt, max_new_tokens=2, temperature=0.5, top_k=99, rng=jax.random.key(0))


def test_mesh_shape_must_fit_devices():
  with pytest.raises(ValueError, match="does not fit 8 devices"):
    sharding.make_mesh((3, 1))
  # (data, model)
  assert dict(sharding.make_mesh((-1, 2)).shape) == {"data": 4, "fsdp": 1, "tensor": 2, "context": 1}
  assert dict(sharding.make_mesh((2, -1, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2, "context": 1}


def test_generate_rejects_empty_prompt_and_out_of_vocab_ids():
  model = Decoder(ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="at least one token"):
    generate(model, jnp.zeros((1, 0), jnp.int32), max_new_tokens=2)
  for bad in (16, -1):
    with pytest.raises(ValueError, match=r"prompt must be in \[0, vocab_size = 16\)"):
      generate(model, jnp.asarray([[1, bad, 2]], jnp.int32), max_new_tokens=2)
  with pytest.raises(TypeError, match="prompt"):
    generate(model, jnp.zeros((1, 2), jnp.float32), max_new_tokens=2)
  assert generate(model, jnp.asarray([[0, 15]], jnp.int32), max_new_tokens=2).shape == (1, 2)


def test_generate_learned_positions_must_fit_max_len():
  cfg = ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2, max_len=8, pos_encoding="learned")
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  prompt = jnp.ones((1, 3), jnp.int32)
  assert generate(model, prompt, max_new_tokens=5).shape == (1, 5)  # 3 + 5 = max_len
  with pytest.raises(ValueError, match="max_len"):
    generate(model, prompt, max_new_tokens=6)
  rope = Decoder(cfg.model_copy(update={"pos_encoding": "rope"}), rngs=nnx.Rngs(0))
  assert generate(rope, prompt, max_new_tokens=6).shape == (1, 6)  # relative positions: no table


def test_generate_rope_alibi_must_fit_its_context_and_says_so_in_the_callers_terms():
  cfg = ModelConfig(
    vocab_size=16,
    d_model=16,
    num_layers=1,
    num_heads=2,
    max_len=64,
    pos_encoding="rope_alibi",
    rope_alibi_context=8,
  )
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  prompt = jnp.ones((1, 3), jnp.int32)
  assert generate(model, prompt, max_new_tokens=5).shape == (1, 5)  # 3 + 5 = rope_alibi_context
  with pytest.raises(
    ValueError,
    match=r"T \+ max_new_tokens must be <= rope_alibi_context \(8\) for pos_encoding='rope_alibi', "
    r"got T=3 \+ max_new_tokens=6$",
  ):
    generate(model, prompt, max_new_tokens=6)


# ------------------------------------------------------------------------------------------------
# Every model configuration generates (issue 17: scan_layers / remat raised "different trace level")


@pytest.mark.parametrize(
  "pe, scan, remat, kv_heads",
  [
    ("none", True, "full", 2),
    ("learned", True, "dots_saveable", None),
    ("sinusoidal", False, "full", 1),
    ("rope", True, "full", 1),
    ("xpos", True, "none", None),
    ("alibi", False, "dots_saveable", 2),
    ("rope_alibi", True, "full", 1),
  ],
)
def test_scanned_and_rematerialised_models_generate_the_loop_models_tokens(pe, scan, remat, kv_heads):
  base = dict(vocab_size=32, d_model=32, num_layers=2, num_heads=4, max_len=32, pos_encoding=pe)
  cfg = ModelConfig(**base, num_kv_heads=kv_heads, init_std=0.5)
  loop = Decoder(cfg, rngs=nnx.Rngs(1))
  model = Decoder(cfg.model_copy(update={"scan_layers": scan, "remat": remat}), rngs=nnx.Rngs(1))
  prompt = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
  expected = _greedy_without_cache(loop, prompt[0].tolist(), 3)  # full forwards of the loop model
  assert generate(model, prompt, max_new_tokens=3).tolist() == [expected]
  if pe == "rope":  # sampling too (one configuration: each sampler is one more compile)
    sample = dict(max_new_tokens=3, temperature=1.0, top_k=8, rng=jax.random.key(2))
    loop_sampled = generate(loop, prompt, **sample)
    np.testing.assert_array_equal(generate(model, prompt, **sample), loop_sampled)
    assert len(set(expected) | set(np.asarray(loop_sampled)[0].tolist())) > 1  # not vacuous


@pytest.mark.usefixtures("standard_promotion")
def test_scan_and_remat_training_run_samples_and_writes_its_outputs(tmp_path, text_file):
  from jaxpe.train import trainer
  from jaxpe.train.config import load_config

  workdir = tmp_path / "s"
  overrides = [
    f"workdir={workdir}",
    f"data.path={text_file}",
    "seq_len=16",
    "batch_size=8",
    "num_steps=3",
    "warmup_steps=1",
    "eval_every=3",
    "eval_batches=1",
    "checkpoint_every=3",
    "sample_len=6",
    "model.d_model=16",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_len=32",
    "model.scan_layers=true",
    "model.remat=full",
  ]
  result = trainer.train(load_config(None, overrides), progress=False)
  for name in ("loss.png", "summary.json", "metrics.jsonl"):
    assert (workdir / name).is_file(), name
  prompt = load_config(None, overrides).sample_prompt
  assert result.sample.startswith(prompt) and len(result.sample) > len(prompt)
  assert json.loads((workdir / "summary.json").read_text())["sample"] == result.sample


# ------------------------------------------------------------------------------------------------
# The sampling rule at its edges (jaxpe.generate's module docstring), against numpy references


def _tiny_model(**kw):
  cfg = ModelConfig(vocab_size=20, d_model=16, num_layers=1, num_heads=2, max_len=32, init_std=0.5, **kw)
  return Decoder(cfg, rngs=nnx.Rngs(3))


def test_tiny_temperatures_agree_with_greedy():
  model = _tiny_model()
  prompt = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  greedy = generate(model, prompt, max_new_tokens=6)
  for t in (1e-40, 5e-324):  # float32 subnormal; below float32 (clamped)
    out = generate(model, prompt, max_new_tokens=6, temperature=t, rng=jax.random.key(0))
    np.testing.assert_array_equal(out, greedy, err_msg=f"temperature={t}")


def test_pick_follows_the_rule_for_infinite_temperature_and_top_k():
  from jaxpe.model.generate import pick

  logits = np.random.default_rng(0).normal(size=(1, 20)).astype(np.float32) * 3
  rows = np.repeat(logits, 4000, axis=0)
  top5 = set(np.argsort(-logits[0])[:5].tolist())
  out = np.asarray(pick(jnp.asarray(rows), jax.random.key(1), float("inf"), 5))
  assert set(out.tolist()) == top5  # only the top 5, all of them
  counts = np.bincount(out, minlength=20)[sorted(top5)]
  assert np.all(np.abs(counts - 800) < 120), counts  # uniform: 800 +- 4.2 sigma
  everything = np.asarray(pick(jnp.asarray(rows), jax.random.key(2), float("inf"), None))
  assert set(everything.tolist()) == set(range(20))
  # a finite temperature: frequencies follow softmax(logits / t) over the top 5 (numpy float64)
  t = 2.0
  p = np.exp((logits[0].astype(np.float64) - logits.max()) / t)
  p[[i for i in range(20) if i not in top5]] = 0
  p /= p.sum()
  freq = np.bincount(np.asarray(pick(jnp.asarray(rows), jax.random.key(3), t, 5)), minlength=20) / 4000
  assert np.abs(freq - p).max() < 0.035, (freq, p)


def test_generate_with_infinite_temperature_stays_in_the_top_k():
  model = _tiny_model()
  prompt = jnp.tile(jnp.asarray([[1, 2, 3]], jnp.int32), (20, 1))
  logits = np.asarray(model(prompt[:1]))[0, -1]
  top5 = set(np.argsort(-logits)[:5].tolist())
  first = generate(model, prompt, max_new_tokens=1, temperature=float("inf"), top_k=5, rng=jax.random.key(0))
  assert set(np.asarray(first)[:, 0].tolist()) <= top5


def test_padding_anywhere_gives_the_unpadded_rows_tokens():
  model = _tiny_model(pos_encoding="rope")
  rows = [[3, 1, 4, 1, 5], [9, 2, 6]]
  expected = [_greedy_without_cache(model, r, 5) for r in rows]
  layouts = {
    "left": ([rows[0], [0, 0, *rows[1]]], [[1] * 5, [0, 0, 1, 1, 1]]),
    "right": ([rows[0], [*rows[1], 7, 7]], [[1] * 5, [1, 1, 1, 0, 0]]),
    "inner": ([rows[0], [9, 7, 2, 7, 6]], [[1] * 5, [1, 0, 1, 0, 1]]),
  }
  for name, (prompt, mask) in layouts.items():
    out = generate(model, jnp.asarray(prompt, jnp.int32), attention_mask=jnp.asarray(mask), max_new_tokens=5)
    assert out.tolist() == expected, name


def test_a_kv_cache_overflow_under_jit_raises_when_it_runs():
  from jaxpe.model.cache import init_cache

  model = _tiny_model()

  @nnx.jit
  def call(model, tokens, cache):
    return model(tokens, cache=cache)

  cache = init_cache(model.cfg, 1, 4)
  _, cache = call(model, jnp.ones((1, 3), jnp.int32), cache)  # 3 of 4 slots
  msg = r"the KV cache has 4 slots; 2 new tokens after 3 filled ones do not fit"
  with pytest.raises(Exception, match=msg):
    jax.block_until_ready(call(model, jnp.ones((1, 2), jnp.int32), cache))
  with pytest.raises(ValueError, match=msg):  # eager: the same message, a plain ValueError
    model(jnp.ones((1, 2), jnp.int32), cache=cache)
  with pytest.raises(ValueError, match="the KV cache has 4 slots; 5 new tokens do not fit"):  # static
    call(model, jnp.ones((1, 5), jnp.int32), init_cache(model.cfg, 1, 4))
  logits, full = call(model, jnp.ones((1, 1), jnp.int32), cache)  # exactly full: fine
  assert int(full.end) == 4 and np.isfinite(np.asarray(logits)).all()


# ------------------------------------------------------------------------------------------------
# The fast decoding path (issue 36): the prefill of an empty cache as self-attention on the fast
# backend, then one pass over the cache per new token (jaxpe.attention.decode). Reference: full
# recomputation without a cache, one jitted forward per config over a fixed-length buffer (causal,
# so the tokens after the one read do not change its logits).

from jaxpe.model import encodings  # noqa: E402
from jaxpe.model.cache import init_cache  # noqa: E402
from jaxpe.model.generate import pick  # noqa: E402

ROWS = [[3, 1, 4, 1, 5], [9, 2, 6], [7, 8, 5, 3]]
# left, right and inner padding, one row each
PADDED = [
  ([3, 1, 4, 1, 5], [1, 1, 1, 1, 1]),
  ([0, 0, 9, 2, 6], [0, 0, 1, 1, 1]),
  ([7, 2, 8, 5, 3], [1, 0, 1, 1, 1]),
]
NEW = 5


def _recompute(model, rows, n, *, temperature=0.0, top_k=None, rng=None):
  """The generation rule by full forwards without a cache: ``[B, n]`` tokens, sampling with the
  key sequence of ``generate`` (one split per token)."""
  width = max(len(r) for r in rows) + n
  forward = jax.jit(lambda m, x, valid: m(x, attention_mask=valid))
  buf = np.zeros((len(rows), width), np.int32)
  valid = np.zeros((len(rows), width), bool)
  lens = [len(r) for r in rows]
  for i, r in enumerate(rows):
    buf[i, : len(r)], valid[i, : len(r)] = r, True
  rng = jax.random.key(0) if rng is None else rng
  out = []
  for _ in range(n):
    logits = np.asarray(forward(model, jnp.asarray(buf), jnp.asarray(valid)))
    rng, sub = jax.random.split(rng)
    nxt = np.asarray(
      pick(jnp.asarray(logits[np.arange(len(rows)), np.asarray(lens) - 1]), sub, temperature, top_k)
    )
    for i, t in enumerate(nxt):
      buf[i, lens[i]], valid[i, lens[i]] = t, True
      lens[i] += 1
    out.append(nxt)
  return np.stack(out, axis=1).tolist()


def _model(pe, **kw):
  cfg = ModelConfig(
    vocab_size=32, d_model=32, num_layers=2, num_heads=4, max_len=32, pos_encoding=pe, init_std=0.5, **kw
  )
  return Decoder(cfg, rngs=nnx.Rngs(5))


def _generate_padded(model, **kw):
  prompt = jnp.asarray([p for p, _ in PADDED], jnp.int32)
  mask = jnp.asarray([m for _, m in PADDED], bool)
  return generate(model, prompt, attention_mask=mask, max_new_tokens=NEW, **kw).tolist()


# every registered encoding; grouped-query heads and attention sinks on some of them
CASES = [(pe, dict(num_kv_heads=2 if i % 2 else 1)) for i, pe in enumerate(encodings.REGISTRY)]
CASES += [("rope", dict(attention_sinks=True, num_kv_heads=2)), ("alibi", dict(attention_sinks=True))]


@pytest.mark.parametrize("pe, kw", CASES, ids=[f"{pe}-{'-'.join(map(str, kw.values()))}" for pe, kw in CASES])
def test_fast_decoding_gives_the_tokens_of_full_recomputation(pe, kw):
  model = _model(pe, **kw)
  rows = [[t for t, m in zip(p, mask) if m] for p, mask in PADDED]  # left, right, inner padding
  expected = _recompute(model, rows, NEW)
  assert _generate_padded(model) == expected
  assert len({t for r in expected for t in r}) > 1  # not vacuous


@pytest.mark.parametrize("scan", [False, True])
def test_fast_sampled_decoding_gives_the_tokens_of_full_recomputation(scan):
  model = _model("alibi", num_kv_heads=2, scan_layers=scan)
  rows = [[t for t, m in zip(p, mask) if m] for p, mask in PADDED]
  sample = dict(temperature=1.5, top_k=8, rng=jax.random.key(4))
  expected = _recompute(model, rows, NEW, **sample)
  assert _generate_padded(model, **sample) == expected
  greedy = _recompute(model, rows, NEW)
  assert expected != greedy  # the samples are no greedy stand-in
  if scan:
    assert _generate_padded(model) == greedy


@pytest.mark.parametrize(
  "pe, kw", [("alibi", {}), ("cope", {}), ("t5", dict(attention_sinks=True)), ("rope", {})]
)
def test_the_cache_is_never_read_past_its_filled_slots(pe, kw):
  model = _model(pe, num_kv_heads=2, **kw)
  prompt = jnp.asarray([p for p, _ in PADDED], jnp.int32)
  mask = jnp.asarray([m for _, m in PADDED], bool)
  step = nnx.jit(lambda m, x, cache: m(x, cache=cache))

  def poisoned(cache):  # NaN in every slot from end on, keys and values
    end = int(cache.end)
    nan = lambda c: c.at[:, :, end:].set(jnp.nan)  # noqa: E731  (slots: axis 2 of [B, K, S, H])
    return cache._replace(k=tuple(map(nan, cache.k)), v=tuple(map(nan, cache.v)))

  fresh = init_cache(model.cfg, 3, 12)
  # the prefill of an empty cache (eager: end is concrete 0) attends to the prompt alone
  clean_logits, cache = model(prompt, attention_mask=mask, cache=fresh)
  nan_logits, nan_cache = model(prompt, attention_mask=mask, cache=poisoned(fresh))
  np.testing.assert_array_equal(nan_logits, clean_logits)
  token = jnp.asarray([[1], [2], [3]], jnp.int32)
  for _ in range(3):  # decode steps under jit (end traced): one pass over the slots
    nan_logits, _ = step(model, token, poisoned(cache))
    clean_logits, cache = step(model, token, cache)
    assert np.isfinite(np.asarray(clean_logits)).all()
    np.testing.assert_array_equal(nan_logits, clean_logits)
    token = jnp.argmax(clean_logits[:, -1:], axis=-1).astype(jnp.int32)


def _loop_body_instructions(hlo: str):
  """``(opcode, dims, fused root opcode or None)`` of every instruction of every while body of the
  compiled HLO text ``hlo``."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
    if head:
      cur = comps.setdefault(head.group(1), [])
    elif cur is not None and line.startswith("  "):
      cur.append(line.strip())
  roots = {name: re.match(r"ROOT %[\w.\-]+ = .*? ([\w\-]+)\(", ls[-1]) for name, ls in comps.items() if ls}
  roots = {name: m.group(1) for name, m in roots.items() if m}
  bodies = {m for ls in comps.values() for line in ls for m in re.findall(r"body=%([\w.\-]+)", line)}
  assert bodies, "no while loop in the compiled generation"
  for body in bodies:
    for line in comps[body]:
      m = re.match(r"(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]\S* ([\w\-]+)\(", line)
      if m:
        calls = re.search(r"calls=%([\w.\-]+)", line)
        dims = tuple(int(d) for d in m.group(1).split(",") if d)
        yield m.group(2), dims, roots.get(calls.group(1)) if calls else None


@pytest.mark.parametrize("stopping", [None, ((3, 7), 0)])  # without and with stop tokens
def test_the_compiled_decode_loop_neither_copies_nor_zeroes_the_cache(stopping):
  """Every decode step updates the cache in place and reads it as it lies: inside the compiled
  loop no instruction makes a cache-sized array (any order of its dims) but the in-place
  dynamic-update-slice of the new token's keys and values (a copy of the cache, a zeroed copy of
  its hidden slots, a transposed copy for a matmul: each a pass over the cache per layer and step)."""
  from jaxpe.model import generate as generate_lib

  # B 3, K 2, S 20 + 5, H 64: heads of 64 dims (at H 8 XLA fused the whole step on main, hiding the
  # copies that it made at H 64, as in BLOOM's [8, 256, 16, 64] caches)
  cfg = ModelConfig(
    vocab_size=32, d_model=128, num_layers=2, num_heads=2, num_kv_heads=2, pos_encoding="alibi", init_std=0.5
  )
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 32, (3, 20)), jnp.int32)
  graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(5)))
  args = (graphdef, state, prompt, jnp.ones((3, 20), bool), jax.random.key(0), 5, (0.0, None, None), stopping)
  hlo = generate_lib._generate.lower(*args).compile().as_text()
  cache_dims = sorted((3, 2, 20 + 5, 64))
  made = [
    (op, dims, root)
    for op, dims, root in _loop_body_instructions(hlo)
    if sorted(dims) == cache_dims and op not in ("get-tuple-element", "bitcast", "parameter", "tuple")
  ]
  in_place = [x for x in made if x[0] == "fusion" and x[2] == "dynamic-update-slice"]
  assert made and len(in_place) == len(made), made  # 2 layers x (k, v) updates, nothing else
  assert len(in_place) == 4, made
  # nor a copy of a weight (jnp.einsum's BTNH,NHD->BTD made XLA transpose the [N, H, D] output
  # projection at every step)
  moved = [
    (op, dims, root)
    for op, dims, root in _loop_body_instructions(hlo)
    if math.prod(dims) >= 128 * 128
    and (op in ("copy", "transpose") or root in ("copy", "transpose", "bitcast"))
  ]
  assert not moved, moved


@pytest.mark.parametrize("t", [2, 4])  # G x T = 4 rows: products and sums; 8: batched matmuls
def test_decode_attention_matches_the_dense_reference(t):
  from jaxpe.attention import IndexMask, dot_product_attention, kernels
  from jaxpe.attention.backends import AlibiSpec
  from jaxpe.ops import alibi

  rng = np.random.default_rng(0)
  b, s, n, kv, h = 2, 9, 4, 2, 8
  q = jnp.asarray(rng.normal(size=(b, t, n, h + 2)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, s, kv, h + 2)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, s, kv, h)), jnp.float32)
  q_index = jnp.asarray([[5], [4]], jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
  k_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  k_valid = jnp.asarray(rng.random((b, s)) > 0.3)
  mask = IndexMask(q_index, k_index, True, k_valid)
  slopes = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32)
  spec = AlibiSpec(slopes, q_index, k_index, max_position=64)
  got = kernels.attention(q, k, v, scale=0.3, mask=mask, alibi_spec=spec, precise_dims=2)
  bias = alibi.alibi_bias(jnp.asarray(slopes), q_index, k_index)
  want = dot_product_attention(q, k, v, scale=0.3, mask=mask.dense(), bias=bias, precise_dims=2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
