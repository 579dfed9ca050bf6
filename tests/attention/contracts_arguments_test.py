"""Argument contracts of the attention surface (issue 39, kinds 1, 6, 8, 13, 14; docs/contracts.md,
"Flags, sizes, empty inputs, array coercion, on/off settings").

1. Every boolean flag refuses a non-bool (``causal="False"`` is not False) naming the flag.
2. ``JAXPE_CPU_FLASH`` takes 1/0/true/false/on/off/yes/no and refuses anything else.
3. The CPU kernel's O(S) scratch is checked before allocation: ``cpu_flash_attention`` refuses
   naming S, ``blockwise_attention`` runs its XLA loops instead (the dense reference's values).
4. Zero sizes (B, T or S = 0, and a vmap over a size-0 axis) give the dense reference's empty or
   zero result on every backend and through ``context_attention``.
5. Arguments that are not arrays of numbers are refused naming the argument; lists of numbers are
   arrays.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe.ops as ops
from jaxpe.attention import (
  AlibiSpec,
  AttentionMask,
  IndexMask,
  attention,
  available_backends,
  backends,
  blockwise_attention,
  combine_partials,
  context,
  cpu_flash,
  dense_attention_mask,
  document_mask,
  dot_product_attention,
  emulated_alibi_attention,
  resolve_backend,
)
from jaxpe.emulation import solve_emulation
from jaxpe.ops import checks

N, K, H = 2, 1, 8
SCALE = 0.3


def _qkv(b=1, t=6, s=6, seed=0):
  rng = np.random.default_rng(seed)
  shapes = ((b, t, N, H), (b, s, K, H), (b, s, K, H))
  return tuple(jnp.asarray(rng.normal(size=sh), jnp.float32) for sh in shapes)


Q, KK, V = _qkv()
POS = np.broadcast_to(np.arange(6, dtype=np.int32), (1, 6))
SLOPES = np.array([0.5, 0.25])
kernel = pytest.mark.skipif(not cpu_flash.available(), reason="the CPU kernel does not build here")

# 1. flags: (entry point taking the flag's value, flag name); each call is otherwise valid
FLAGS = [
  (lambda x: cpu_flash.cpu_flash_attention(Q, KK, V, scale=SCALE, causal=x), "causal"),
  (lambda x: cpu_flash.cpu_flash_attention(Q, KK, V, scale=SCALE, return_lse=x), "return_lse"),
  (lambda x: blockwise_attention(Q, KK, V, scale=SCALE, return_lse=x), "return_lse"),
  (lambda x: dot_product_attention(Q, KK, V, scale=SCALE, is_causal=x), "is_causal"),
  (lambda x: attention(Q, KK, V, scale=SCALE, interpret=x), "interpret"),
  (lambda x: attention(Q, KK, V, scale=SCALE, mask=AttentionMask(causal=x)), "causal"),
  (lambda x: attention(Q, KK, V, scale=SCALE, mask=IndexMask(POS, POS, x)), "causal"),
  (lambda x: blockwise_attention(Q, KK, V, scale=SCALE, mask=AttentionMask(causal=x)), "causal"),
  (lambda x: emulated_alibi_attention(Q, KK, V, POS, POS, slopes=SLOPES, is_causal=x), "is_causal"),
  (lambda x: emulated_alibi_attention(Q, KK, V, POS, POS, slopes=SLOPES, interpret=x), "interpret"),
  (lambda x: available_backends(interpret=x), "interpret"),
  (lambda x: resolve_backend("xla", interpret=x), "interpret"),
  (lambda x: document_mask(POS, POS, causal=x), "causal"),
  (lambda x: ops.t5_relative_position_bucket(jnp.arange(4), bidirectional=x), "bidirectional"),
  (
    lambda x: solve_emulation(num_heads=2, head_dim=8, max_len=64, max_phase=1.0, shared_theta=x),
    "shared_theta",
  ),
]


@pytest.mark.parametrize("value", ["False", "no", 0, 1, None], ids=repr)
@pytest.mark.parametrize("call, name", FLAGS, ids=[f"{i}-{n}" for i, (_, n) in enumerate(FLAGS)])
def test_a_flag_is_a_bool_not_a_truth_value(call, name, value):
  if "cpu_flash" in call.__code__.co_names and not cpu_flash.available():
    pytest.skip("the CPU kernel does not build here")
  with pytest.raises(TypeError, match=rf"\b{name}\b.*must be a (Python )?bool"):
    call(value)


@kernel
def test_numpy_bools_are_flags():
  got, lse = cpu_flash.cpu_flash_attention(Q, KK, V, scale=SCALE, causal=np.True_, return_lse=np.True_)
  want = dot_product_attention(Q, KK, V, scale=SCALE, is_causal=True)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert lse.shape == Q.shape[:3]


# 2. the on/off environment setting


@pytest.mark.parametrize(
  "raw, want",
  [("1", True), ("TRUE", True), (" on ", True), ("yes", True), ("0", False), ("false", False),
   ("Off", False), ("no", False), ("", None)],
)  # fmt: skip
def test_env_flag_accepts_the_documented_words(monkeypatch, raw, want):
  monkeypatch.setenv("JAXPE_SOME_FLAG", raw)
  assert checks.env_flag("JAXPE_SOME_FLAG", "default") == ("default" if want is None else want)


@pytest.mark.parametrize("raw", ["disabled", "2", "enable", "nope", "t"])
def test_env_flag_refuses_other_words_naming_the_variable(monkeypatch, raw):
  monkeypatch.setenv("JAXPE_SOME_FLAG", raw)
  with pytest.raises(ValueError, match=rf"JAXPE_SOME_FLAG='{raw}' is not an on/off setting: use one of 1"):
    checks.env_flag("JAXPE_SOME_FLAG", True)


def test_cpu_flash_setting_disabled_is_refused_not_taken_as_on(monkeypatch):
  monkeypatch.setattr(cpu_flash, "_state", {})  # a fresh first use; the module's state comes back after
  monkeypatch.setenv("JAXPE_CPU_FLASH", "disabled")
  with pytest.raises(ValueError, match=r"JAXPE_CPU_FLASH='disabled' is not an on/off setting"):
    cpu_flash.available()
  with pytest.raises(ValueError, match=r"JAXPE_CPU_FLASH='disabled'"):
    blockwise_attention(Q, KK, V, scale=SCALE, mask=AttentionMask(causal=True))
  monkeypatch.setenv("JAXPE_CPU_FLASH", "Off")
  assert not cpu_flash.available()
  assert cpu_flash.unavailable_reason() == "turned off by JAXPE_CPU_FLASH=Off"
  # the XLA loops then: the dense reference's values
  got = blockwise_attention(Q, KK, V, scale=SCALE, mask=AttentionMask(causal=True))
  np.testing.assert_allclose(got, dot_product_attention(Q, KK, V, scale=SCALE, is_causal=True), atol=1e-5)


# 3. the kernel's scratch, checked before allocation


def test_kernel_scratch_is_o_of_s_per_thread():
  # closed form of the C++ Scratch and BwdScratch vectors (BQ = 64, PAD = 16), in floats (a double
  # counts two): Scratch kt, vp, sc, o, qs and the float64 od [BQ, max(Hp, Hqp)]; BwdScratch kp, vt,
  # dkp, dvp, dsc, dop, qp, dqb and the float64 dk / dv sums dkd, dvd
  s, hq, h = 100, 20, 17
  sp, hqp, hp = 112, 32, 32
  forward = hq * sp + s * hp + 64 * sp + 64 * hp + 64 * hqp + 2 * 64 * max(hp, hqp)
  backward = 2 * s * hqp + h * sp + s * hp + 64 * (sp + hp + 2 * hqp) + 2 * s * hqp + 2 * s * hp
  assert cpu_flash.workspace_bytes(5, s, hq, h) == 4 * (forward + backward)
  need, room = cpu_flash.scratch_fits(5, s, hq, h)
  assert need >= 4 * (forward + backward) and room == int(0.5 * checks.host_memory_bytes())


@kernel
def test_a_scratch_too_large_is_refused_by_the_kernel_and_routed_to_the_loops(monkeypatch):
  need, _ = cpu_flash.scratch_fits(6, 6, H, H)
  monkeypatch.setattr(checks, "host_memory_bytes", lambda: need)  # half of it is the kernel's share
  with pytest.raises(
    ValueError, match=r"^k: S = 6 keys: the kernel's scratch .* needs .* GiB, more than the"
  ):
    cpu_flash.cpu_flash_attention(Q, KK, V, scale=SCALE)
  with pytest.raises(ValueError, match=r"S = 6 keys"):  # shapes alone: nothing is allocated
    jax.eval_shape(lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, scale=SCALE), Q, KK, V)

  def lowered():  # a new function each time: jit caches the trace of a function it has seen
    run = lambda q, k, v: blockwise_attention(q, k, v, scale=SCALE, mask=AttentionMask(causal=True))  # noqa: E731
    return jax.jit(run).lower(Q, KK, V).as_text()

  assert cpu_flash.call.FORWARD not in lowered()
  got = blockwise_attention(Q, KK, V, scale=SCALE, mask=AttentionMask(causal=True))
  np.testing.assert_allclose(got, dot_product_attention(Q, KK, V, scale=SCALE, is_causal=True), atol=1e-5)
  monkeypatch.setattr(checks, "host_memory_bytes", lambda: 2 * need)  # fits exactly: the kernel runs
  assert cpu_flash.call.FORWARD in lowered()


# 4. zero sizes: the dense reference's result everywhere

EMPTY = [(0, 6, 6), (1, 0, 6), (1, 6, 0), (1, 0, 0), (0, 0, 0)]


def _dense(q, k, v, causal=False):
  return dot_product_attention(q, k, v, scale=SCALE, is_causal=causal)


@pytest.mark.parametrize("b, t, s", EMPTY, ids=str)
@pytest.mark.parametrize("impl", available_backends(interpret=True))
def test_empty_sizes_give_the_dense_result_on_every_backend(impl, b, t, s):
  q, k, v = _qkv(b, t, s)
  want = _dense(q, k, v)
  assert want.shape == (b, t, N, H) and not np.any(np.asarray(want))
  if impl != "xla" and t != s:  # the fused kernels are for self-attention: T != S is refused
    with pytest.raises(ValueError, match=r"is for self-attention \(T == S\)"):
      attention(q, k, v, scale=SCALE, implementation=impl, interpret=True)
    return
  got = attention(q, k, v, scale=SCALE, implementation=impl, interpret=True)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)
  if t == s:
    got = attention(
      q, k, v, scale=SCALE, implementation=impl, interpret=True, mask=AttentionMask(causal=True)
    )
    np.testing.assert_array_equal(got, _dense(q, k, v, causal=True))


@pytest.mark.parametrize("b, t, s", EMPTY, ids=str)
def test_empty_sizes_in_the_xla_paths(b, t, s):
  q, k, v = _qkv(b, t, s)
  want = _dense(q, k, v)
  qi = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  ki = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  got = [
    blockwise_attention(q, k, v, scale=SCALE),
    blockwise_attention(q, k, v, scale=SCALE, block_q=4, block_k=4),
    attention(q, k, v, scale=SCALE, mask=IndexMask(qi, ki, False)),
  ]
  if cpu_flash.available():
    got.append(cpu_flash.cpu_flash_attention(q, k, v, scale=SCALE))
  for out in got:
    assert out.shape == want.shape
    np.testing.assert_array_equal(out, want)
  grads = jax.grad(lambda q, k, v: blockwise_attention(q, k, v, scale=SCALE).sum(), (0, 1, 2))(q, k, v)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def _mapped(fn):
  return jax.vmap(lambda q, k, v: fn(q, k, v))


VMAPPED = {
  "dense": lambda q, k, v: _dense(q, k, v, causal=True),
  "blockwise": lambda q, k, v: blockwise_attention(q, k, v, scale=SCALE, mask=AttentionMask(causal=True)),
  "attention": lambda q, k, v: attention(q, k, v, scale=SCALE, mask=AttentionMask(causal=True)),
  "cpu_flash": lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, scale=SCALE, causal=True),
}


@pytest.mark.parametrize("name", VMAPPED)
@pytest.mark.parametrize("size", [0, 2])
def test_vmap_over_a_size_zero_axis(name, size):
  if name == "cpu_flash" and not cpu_flash.available():
    pytest.skip("the CPU kernel does not build here")
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(size, 1, 6, N, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(size, 1, 6, K, H)), jnp.float32)
  fn = VMAPPED[name]
  got = jax.vmap(fn)(q, k, k)
  want = jax.vmap(VMAPPED["dense"])(q, k, k)
  assert got.shape == (size, 1, 6, N, H)
  np.testing.assert_allclose(got, want, atol=1e-5)
  grads = jax.vmap(jax.grad(lambda q, k: fn(q, k, k).sum(), (0, 1)))(q, k)
  assert [g.shape for g in grads] == [q.shape, k.shape]


@pytest.mark.parametrize("strategy", context.STRATEGIES)
@pytest.mark.parametrize("b, t", [(0, 4), (2, 0)], ids=str)
def test_context_attention_of_empty_sizes(strategy, b, t):
  from jaxpe.train import sharding  # the mesh helper of the runs (the tests' 8 CPU devices)

  mesh = sharding.make_mesh((4, 1, 1, 2))
  q, k, v = _qkv(b, t, t)
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

  def run(q, k, v):
    mask = IndexMask(idx, idx, True)
    alibi = AlibiSpec(SLOPES, idx, idx, max_position=64)
    return context.context_attention(
      q, k, v, scale=SCALE, mesh=mesh, strategy=strategy, mask=mask, alibi=alibi
    )

  out = jax.jit(run)(q, k, v)
  np.testing.assert_array_equal(out, _dense(q, k, v, causal=True))
  grads = jax.jit(jax.grad(lambda q, k, v: run(q, k, v).sum(), (0, 1, 2)))(q, k, v)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# 5. arrays of numbers

NOT_ARRAYS = {"string": "abc", "None": None, "object": object(), "ragged": [[1.0, 2.0], [3.0]]}
NESTED = np.asarray(Q).tolist()
TAKES_ARRAYS = [
  (lambda x: cpu_flash.cpu_flash_attention(x, KK, V, scale=SCALE), "q"),
  (lambda x: cpu_flash.cpu_flash_attention(Q, KK, x, scale=SCALE), "v"),
  (lambda x: cpu_flash.cpu_flash_attention(Q, KK, V, scale=SCALE, k_valid=x), "k_valid?"),
  (
    lambda x: cpu_flash.cpu_flash_attention(Q, KK, V, scale=SCALE, q_segment_ids=x, k_segment_ids=POS),
    "q_segment_ids?",
  ),
  (
    lambda x: cpu_flash.cpu_flash_attention(
      Q, KK, V, scale=SCALE, slopes=x, q_positions=POS, k_positions=POS
    ),
    "slopes?",
  ),
  (lambda x: blockwise_attention(x, KK, V, scale=SCALE), "q"),
  (lambda x: blockwise_attention(Q, x, V, scale=SCALE), "k"),
  (lambda x: dot_product_attention(Q, KK, x, scale=SCALE), "v"),
  (lambda x: attention(x, KK, V, scale=SCALE), "q"),
  (lambda x: attention(Q, x, V, scale=SCALE, implementation="splash", interpret=True), "k"),
  (lambda x: emulated_alibi_attention(x, KK, V, POS, POS, slopes=SLOPES), "q"),
  (lambda x: context.context_attention(x, KK, V, scale=SCALE, mesh=jax.make_mesh((1,), ("context",))), "q"),
  (lambda x: combine_partials(x, jnp.zeros(Q.shape[:3]), Q, jnp.zeros(Q.shape[:3])), "out_a"),
  (lambda x: combine_partials(Q, jnp.zeros(Q.shape[:3]), Q, x), "lse_b"),
  (lambda x: ops.cope_positions(x, npos_max=4), "gate_logits"),
  (lambda x: ops.cope_bias(Q, x, jnp.zeros((H, 4)), scale=SCALE), "k"),
]


@pytest.mark.parametrize("bad", NOT_ARRAYS.values(), ids=NOT_ARRAYS.keys())
@pytest.mark.parametrize(
  "call, name", TAKES_ARRAYS, ids=[f"{i}-{n}" for i, (_, n) in enumerate(TAKES_ARRAYS)]
)
def test_a_non_array_is_refused_naming_the_argument(call, name, bad):
  if "cpu_flash" in call.__code__.co_names and not cpu_flash.available():
    pytest.skip("the CPU kernel does not build here")
  if name.endswith("?") and bad is None:
    return  # an optional argument: None means absent
  with pytest.raises(TypeError, match=rf"^{name.rstrip('?')} must be an array of numbers, got"):
    call(bad)


def test_lists_of_numbers_are_arrays():
  want = _dense(Q, KK, V, causal=True)
  got = [
    dot_product_attention(NESTED, KK, V, scale=SCALE, is_causal=True),
    attention(NESTED, np.asarray(KK).tolist(), V, scale=SCALE, mask=AttentionMask(causal=True)),
    blockwise_attention(NESTED, KK, V, scale=SCALE, mask=AttentionMask(causal=True)),
  ]
  if cpu_flash.available():
    got.append(cpu_flash.cpu_flash_attention(NESTED, KK, V, scale=SCALE, causal=True, k_valid=[[True] * 6]))
  for out in got:
    np.testing.assert_allclose(out, want, atol=1e-5)
  out, lse = combine_partials(NESTED, np.zeros(Q.shape[:3]).tolist(), NESTED, np.zeros(Q.shape[:3]).tolist())
  np.testing.assert_allclose(out, Q, atol=1e-6)
  np.testing.assert_allclose(lse, np.log(2.0), atol=1e-6)


# 6. dense results the argument sizes: refused before allocation when they cannot fit the device

P16 = np.broadcast_to(np.arange(16, dtype=np.int32), (1, 16))
FIRE = dict(
  w1=jnp.ones(4),
  b1=jnp.zeros(4),
  w2=jnp.ones((4, 2)),
  b2=jnp.zeros(2),
  c=jnp.float32(1),
  threshold=jnp.float32(16),
)
DENSE = [  # (call, argument named, bytes of the dense result for these sizes)
  (lambda: ops.alibi_bias(SLOPES, P16, P16), "q_positions / k_positions", 2 * 16 * 16 * 4),
  (lambda: ops.alibi_bias_symmetric(SLOPES, P16, P16), "q_positions / k_positions", 2 * 16 * 16 * 4),
  (lambda: ops.alibi_bias_causal(SLOPES, q_len=16, k_len=16), "q_len / k_len", 2 * 16 * 16 * 4),
  (lambda: ops.t5_bias(jnp.zeros((32, 2)), P16, P16, bidirectional=True), "q_positions / k_positions", 2048),
  (lambda: ops.kerple_log_bias(SLOPES, SLOPES, P16, P16), "q_positions / k_positions", 2048),
  (
    lambda: ops.fire_bias(P16, P16, **FIRE),
    "q_positions / k_positions",
    16 * 16 * 4 * 4,
  ),  # MLP [B, T, S, F = 4]
  (lambda: ops.cope_bias(*_qkv(1, 16, 16)[:2], jnp.zeros((H, 4)), scale=SCALE), "q / k", 2 * 16 * 16 * 4),
  (lambda: dense_attention_mask(P16, P16), "q_index / k_index", 16 * 16),
  (lambda: AttentionMask(causal=True).dense(1, 16), "q_index / k_index", 16 * 16),
  (lambda: dot_product_attention(*_qkv(1, 16, 16), scale=SCALE), "q / k", 2 * 16 * 16 * 4),
]


@pytest.mark.parametrize("call, name, need", DENSE, ids=[n + str(i) for i, (_, n, _) in enumerate(DENSE)])
def test_a_dense_result_too_large_is_refused_before_allocation(monkeypatch, call, name, need):
  monkeypatch.setattr(checks, "device_memory_bytes", lambda: need - 1)
  with pytest.raises(ValueError, match=rf"^{re.escape(name)}: a dense \[.*\] \w+ array needs"):
    call()
  monkeypatch.setattr(checks, "device_memory_bytes", lambda: need)
  out = call()  # fits exactly: runs
  # the output is the dense array, except for the reference and CoPE (their [B, N, T, S] scores) and FIRE (its MLP)
  assert out.size * out.dtype.itemsize == need or name == "q / k" or "fire_bias" in call.__code__.co_names


def test_huge_dense_shapes_are_refused_from_the_shapes_alone():
  # 2^20 x 2^20 scores: 8 TiB; eval_shape traces without allocating anything
  q = jax.ShapeDtypeStruct((1, 2**20, N, H), jnp.float32)
  k = jax.ShapeDtypeStruct((1, 2**20, K, H), jnp.float32)
  with pytest.raises(
    ValueError, match=r"^q / k: a dense \[1, 2, 1048576, 1048576\] float32 array needs 8,192"
  ):
    jax.eval_shape(lambda q, k: dot_product_attention(q, k, k, scale=SCALE), q, k)
  with pytest.raises(ValueError, match=r"^q_len / k_len: .* needs 8,192\.00 GiB"):
    ops.alibi_bias_causal(SLOPES, q_len=2**20, k_len=2**20)
  # the blockwise path takes these shapes (nothing dense): it traces
  out = jax.eval_shape(lambda q, k: blockwise_attention(q, k, k, scale=SCALE, block_q=512, block_k=512), q, k)
  assert out.shape == (1, 2**20, N, H)


class _FakeDevice:
  def __init__(self, process_index, bytes_limit=None):
    self.process_index, self._limit = process_index, bytes_limit

  def memory_stats(self):
    return {"bytes_limit": self._limit} if self._limit else None


def test_device_memory_counts_each_process_host_once(monkeypatch):
  # a two-process CPU job: two hosts' memory (a dense array sharded over both fits there), counted
  # once per host however many devices each has; accelerators by their own limits
  monkeypatch.setattr(checks, "host_memory_bytes", lambda: 1000)
  cpu_job = [_FakeDevice(0), _FakeDevice(0), _FakeDevice(1), _FakeDevice(1)]
  monkeypatch.setattr(jax, "devices", lambda: cpu_job)
  assert checks.device_memory_bytes() == 2000
  monkeypatch.setattr(jax, "devices", lambda: [_FakeDevice(0, 300), _FakeDevice(1, 300), _FakeDevice(1)])
  assert checks.device_memory_bytes() == 1600


# Issue 48, kind 6a: every public helper that answers for one backend checks the name (``auto``
# names none until a platform is known) and its sizes; padded_head_dim("auto", 64) was a raw KeyError,
# padded_v_dim and kernel_length answered for "auto" and for any string.
_BACKEND_HELPERS = {
  "padded_head_dim": lambda impl, n=64: backends.padded_head_dim(impl, n),
  "padded_v_dim": lambda impl, n=64: backends.padded_v_dim(impl, n, 72),
  "kernel_length": lambda impl, n=100: backends.kernel_length(impl, n),
  "emulation_dim_count": lambda impl, n=None: backends.emulation_dim_count(impl, alibi_form="lean"),
}


@pytest.mark.parametrize("helper", sorted(_BACKEND_HELPERS))
def test_backend_helpers_check_the_backend_name_and_their_sizes(helper):
  call = _BACKEND_HELPERS[helper]
  with pytest.raises(ValueError, match=r"implementation must be one of .*got 'auto' .*resolve_backend"):
    call("auto")
  for bad in ("bogus", None, 3, ["xla"]):
    with pytest.raises(ValueError, match=r"implementation must be one of \("):
      call(bad)
  assert call("flash") == {"padded_head_dim": 64, "padded_v_dim": 72, "kernel_length": 128}.get(helper, 0)
  if helper != "emulation_dim_count":
    for bad in (-1, 2.0, True, "64"):
      with pytest.raises(ValueError, match=r"must be an integer"):
        call("xla", bad)
    assert call("splash", np.int64(100)) == {"padded_head_dim": 128, "padded_v_dim": 100}.get(helper, 128)
