"""The attention patterns (local_window_size, chunk_size, logits_soft_cap) on the fused backends:
splash in interpret mode against the float64 reference of patterns_test (padding, packing, GQA, sinks,
T = 100 padded to the kernel's 128; values, and gradients for the combined option); cudnn's window as
jax.nn.dot_product_attention(local_window_size=) (run through jax's own XLA implementation on this
CPU host: the same call with implementation='xla'); the refusals by backend and option; 'auto'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from patterns_test import (
  OPTIONS,
  SCALE,
  _allowed,
  _check,
  _data,
  _pattern,
  _reference,
)  # tests/attention/patterns_test.py

from jaxpe.attention import AlibiSpec, AttentionMask, attention, cpu_flash_attention, cudnn, patterns

B, N = 2, 4


def _splash_case(name, grad):
  opts = OPTIONS[name]
  t = 100
  q, k, v, w = _data(t)
  valid = np.ones((B, t), bool)
  valid[0, :6] = False
  seg = np.zeros((B, t), np.int32)
  seg[1, 40:] = 1
  sinks = np.array([0.3, -1.0, 2.0, 0.0], np.float32)
  pos = np.broadcast_to(np.arange(t), (B, t))
  allowed = _allowed(pos, pos, causal=True, k_valid=valid, q_seg=seg, k_seg=seg, **_pattern(opts))
  mask = AttentionMask(valid=valid, segment_ids=seg, causal=True)
  if "chunk_size" in opts:  # splash counts chunks from slot 0: chunks with padding / packing are refused
    valid = np.ones((B, t), bool)
    allowed = _allowed(pos, pos, causal=True, **_pattern(opts))
    mask = AttentionMask(causal=True)

  def fn(q, k, v):
    return attention(
      q, k, v, scale=SCALE, mask=mask, sinks=sinks, implementation="splash", interpret=True, **opts
    )

  real = valid[:, :, None, None].astype(np.float32)
  if grad:
    _check(fn, q, k, v, w, allowed, cap=opts.get("logits_soft_cap"), sinks=sinks, real_rows=real)
    return
  out = np.asarray(fn(q, k, v), np.float64) * real
  want = _reference(
    np, *(np.asarray(x, np.float64) for x in (q, k, v)), allowed, cap=opts.get("logits_soft_cap"), sinks=sinks
  )
  np.testing.assert_allclose(out, want * real, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["window", "chunk", "cap"])
def test_splash_values(name):
  _splash_case(name, grad=False)


def test_splash_values_and_gradients_all_options():
  _splash_case("all", grad=True)


def test_cudnn_window_is_jax_nn_local_window_size(monkeypatch):
  """cudnn.attend passes a causal window as jax.nn.dot_product_attention(local_window_size=(left, 0));
  run here through jax's XLA implementation (no cuDNN on this host) against the float64 reference."""
  calls = []
  real = jax.nn.dot_product_attention

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **{**kwargs, "implementation": "xla"})

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  t = 24
  q, k, v, _ = _data(t)
  pattern = patterns.Pattern(window=(5, 3))
  out = cudnn.attend(q, k, v, AttentionMask(causal=True), scale=SCALE, pattern=pattern)
  assert calls[-1]["local_window_size"] == (5, 0) and calls[-1]["implementation"] == "cudnn"
  pos = np.broadcast_to(np.arange(t), (B, t))
  want = _reference(
    np, *(np.asarray(x, np.float64) for x in (q, k, v)), _allowed(pos, pos, causal=True, window=(5, 0))
  )
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5)


@pytest.mark.parametrize("impl", ["splash", "flash"])
@pytest.mark.parametrize(
  "mask",
  [AttentionMask(valid=np.ones((B, 16), bool)), AttentionMask(segment_ids=np.zeros((B, 16), np.int32))],
)
def test_chunks_with_padding_or_packing_refused_on_kernels(impl, mask):
  """The kernels count chunks from slot 0, transformers from each row's first real token: chunk_size
  with padding or segment ids is refused by name there, and 'auto' runs xla."""
  q, k, v, _ = _data(16)
  with pytest.raises(ValueError, match=f"{impl!r} cannot run chunk_size with an AttentionMask"):
    attention(q, k, v, scale=SCALE, mask=mask, implementation=impl, interpret=True, chunk_size=4)
  with pytest.raises(ValueError, match="cpu_flash_attention cannot run chunk_size with k_valid"):
    cpu_flash_attention(q, k, v, scale=SCALE, causal=True, k_valid=np.ones((B, 16), bool), chunk_size=4)


@pytest.mark.parametrize(
  "impl, opts, mask, words",
  [
    ("pallas_gpu", dict(local_window_size=4), AttentionMask(), "'pallas_gpu' cannot run local_window_size"),
    ("pallas_gpu", dict(chunk_size=4), AttentionMask(), "'pallas_gpu' cannot run chunk_size"),
    ("pallas_gpu", dict(logits_soft_cap=5.0), AttentionMask(), "'pallas_gpu' cannot run logits_soft_cap"),
    (
      "splash",
      dict(chunk_size=4),
      AttentionMask(causal=False),
      "'splash' runs chunk_size with a causal mask",
    ),
  ],
)
def test_refusals_name_backend_and_option(impl, opts, mask, words):
  q, k, v, _ = _data(16)
  with pytest.raises(ValueError, match=words):
    attention(q, k, v, scale=SCALE, mask=mask, implementation=impl, interpret=True, **opts)


def test_cudnn_refusals():
  q, k, v, _ = _data(8)
  for pattern, mask, words in [
    (patterns.Pattern(chunk=4), AttentionMask(), "'cudnn' cannot run chunk_size"),
    (patterns.Pattern(cap=5.0), AttentionMask(), "'cudnn' cannot run logits_soft_cap"),
    (
      patterns.Pattern(window=(2, 2)),
      AttentionMask(causal=False),
      "'cudnn' runs local_window_size with a causal",
    ),
  ]:
    with pytest.raises(ValueError, match=words):
      patterns.refuse("cudnn", pattern)
      cudnn.local_window(mask, pattern)


def test_soft_cap_refused_with_emulated_alibi():
  q, k, v, _ = _data(16)
  pos = np.broadcast_to(np.arange(16), (B, 16))
  spec = AlibiSpec(np.full(N, 0.5), pos, pos, max_position=1024)
  with pytest.raises(ValueError, match="'splash' with logits_soft_cap and alibi_spec"):
    attention(
      q, k, v, scale=SCALE, mask=AttentionMask(), alibi_spec=spec, logits_soft_cap=5.0,
      implementation="splash", interpret=True,
    )  # fmt: skip


def test_auto_lowered_for_tpu_passes_over_refusing_kernels():
  """implementation='auto' lowered for TPU: splash takes a causal window, a non-causal chunk goes to
  flash (splash refuses it; flash runs every option in its Mosaic kernel)."""
  q = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.float32)

  def lowered(mask, **opts):
    fn = jax.jit(lambda q, k, v: attention(q, k, v, scale=0.1, mask=mask, implementation="auto", **opts))
    return fn.trace(q, q, q).lower(lowering_platforms=("tpu",)).as_text()

  assert "tpu_custom_call" in lowered(AttentionMask(), local_window_size=(16, 0))
  chunked = lowered(AttentionMask(causal=False), chunk_size=32)
  assert "jaxpe_flash_tpu_forward_kernel" in chunked and "tpu_custom_call" in chunked


@pytest.mark.parametrize("name", ["window", "chunk"])
def test_splash_window_with_emulated_alibi(name):
  """splash runs ALiBi as its bias-free lean emulation (extra q/k dims) beside the window / chunks:
  the float64 reference with the native bias -m (i - j)."""
  opts = OPTIONS[name]
  t = 100
  q, k, v, _ = _data(t)
  pos = np.broadcast_to(np.arange(t), (B, t))
  slopes = np.array([0.5, 0.25, 0.125, 0.0625])
  spec = AlibiSpec(slopes, pos, pos, max_position=1024)
  bias = -slopes[None, :, None, None] * (pos[:, None, :, None] - pos[:, None, None, :])
  allowed = _allowed(pos, pos, causal=True, **_pattern(opts))
  out = attention(
    q,
    k,
    v,
    scale=SCALE,
    mask=AttentionMask(),
    alibi_spec=spec,
    implementation="splash",
    interpret=True,
    **opts,
  )
  want = _reference(np, *(np.asarray(x, np.float64) for x in (q, k, v)), allowed, bias=bias)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-4)
