"""The optional ``tokamax`` backend (``jaxpe.attention.tokamax``).

Where tokamax is not installed (CI): the refusal runs for real (``resolve_backend`` and
``attention`` name the missing package and the available backends) and the numeric tests are
skipped by ``pytest.importorskip`` (shown as skipped, not passed). Where it is installed
(``pip install --target DIR tokamax`` and ``PYTHONPATH=DIR``): the numeric tests compare it, jitted,
with a float64 numpy ALiBi attention written from the paper's formula (arXiv 2108.12409), and its
gradients with the ``xla`` backend's; on CPU tokamax runs its XLA implementation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import backends, kernels, masks
from jaxpe.ops import alibi

B, T, N, K, H = 2, 33, 4, 2, 16  # odd T, grouped-query heads
PAD = 5  # left padding of batch row 1


def test_refused_without_the_package_naming_the_available_backends(monkeypatch):
  monkeypatch.setattr(backends, "BACKENDS", tuple(b for b in backends.BACKENDS if b != "tokamax"))
  monkeypatch.setattr(
    backends, "IMPLEMENTATIONS", tuple(b for b in backends.IMPLEMENTATIONS if b != "tokamax")
  )
  available = backends.available_backends()
  assert "tokamax" not in available and "xla" in available
  with pytest.raises(ValueError, match=r"needs the optional package 'tokamax'.*available: \('xla'"):
    backends.resolve_backend("tokamax")
  q = jnp.zeros((1, 4, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match="needs the optional package 'tokamax'"):
    kernels.attention(q, q, q, scale=0.5, implementation="tokamax")


def test_listed_exactly_when_installed():
  import importlib.util

  installed = importlib.util.find_spec("tokamax") is not None
  assert ("tokamax" in backends.BACKENDS) == installed
  assert ("tokamax" in backends.available_backends()) == installed


def _reference(q, k, v, slopes, q_pos, k_pos, allowed, scale):
  """float64 softmax(q.k scale - m_h (i - j), masked) v, ``[B, T, N, H]``; GQA by repeating k/v."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  rep = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  dist = (q_pos[:, :, None] - k_pos[:, None, :]).astype(np.float64)  # [B, T, S]
  logits = logits - slopes[None, :, None, None] * dist[:, None]
  logits = np.where(allowed[:, None], logits, -np.inf)
  logits = logits - logits.max(-1, keepdims=True)
  w = np.exp(logits)
  w = w / w.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", w, v)


def _inputs():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k, v = (rng.normal(size=(B, T, K, H)).astype(np.float32) for _ in range(2))
  valid = np.arange(T)[None, :] >= np.array([[0], [PAD]])
  segments = np.stack([np.repeat([0, 1], [20, T - 20]), np.zeros(T, int)]).astype(np.int32)
  positions = np.stack(
    [np.concatenate([np.arange(20), np.arange(T - 20)]), np.maximum(np.arange(T) - PAD, 0)]
  )
  return q, k, v, valid, segments, positions


def test_alibi_gqa_padding_segments_match_float64_reference():
  pytest.importorskip("tokamax")
  q, k, v, valid, segments, positions = _inputs()
  slopes = alibi.alibi_slopes_f64(N)
  scale = H**-0.5
  mask = masks.AttentionMask(valid=jnp.asarray(valid), segment_ids=jnp.asarray(segments), causal=True)
  spec = backends.AlibiSpec(slopes, jnp.asarray(positions), jnp.asarray(positions), max_position=T)
  fn = jax.jit(
    lambda q, k, v: kernels.attention(
      q, k, v, scale=scale, mask=mask, alibi_spec=spec, implementation="tokamax"
    )
  )
  out = np.asarray(fn(q, k, v))
  idx = np.arange(T)
  allowed = (idx[None, :, None] >= idx[None, None, :]) & (segments[:, :, None] == segments[:, None, :])
  allowed = allowed & valid[:, None, :]
  ref = _reference(q, k, v, slopes, positions, positions, allowed | ~valid[:, :, None], scale)
  rows = valid[:, :, None, None]
  np.testing.assert_allclose(np.where(rows, out, 0), np.where(rows, ref, 0), atol=2e-5, rtol=0)
  assert np.all(out[~valid] == 0)  # padding query rows are zeros, as on the fused kernels


def test_gradients_match_xla():
  pytest.importorskip("tokamax")
  q, k, v, _, _, positions = _inputs()
  spec = backends.AlibiSpec(
    alibi.alibi_slopes_f64(N), jnp.asarray(positions), jnp.asarray(positions), max_position=T
  )
  mask = masks.AttentionMask(causal=True)

  def loss(impl):
    def f(q, k, v):
      out = kernels.attention(q, k, v, scale=H**-0.5, mask=mask, alibi_spec=spec, implementation=impl)
      return jnp.sum(out * jnp.cos(out))

    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  got, want = loss("tokamax")(q, k, v), loss("xla")(q, k, v)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5, rtol=0)


def test_refuses_sinks_and_index_masks():
  pytest.importorskip("tokamax")
  q = jnp.zeros((1, 4, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match="takes no attention sinks"):
    kernels.attention(q, q, q, scale=0.5, implementation="tokamax", sinks=jnp.zeros(2))
  index = masks.IndexMask(q_index=jnp.arange(4)[None], k_index=jnp.arange(4)[None])
  with pytest.raises(ValueError, match="not an IndexMask"):
    kernels.attention(q, q, q, scale=0.5, mask=index, implementation="tokamax")


def test_key_bias_is_alibi_up_to_a_row_constant_at_far_positions():
  # no tokamax needed: the bias it would get. Positions near 2^28 (past float32's exact integers):
  # bias + m (i - j) is the same for every key j of a row (float64 numpy, the formula)
  pos = (2**28 + 3 * np.arange(9))[None].astype(np.int32)
  slopes = np.array([0.5, 0.0625])
  spec = backends.AlibiSpec(slopes, jnp.asarray(pos), jnp.asarray(pos), max_position=2**24)
  from jaxpe.attention.tokamax import alibi_key_bias

  bias = np.asarray(jax.jit(lambda: alibi_key_bias(spec))(), np.float64)  # [1, N, 1, S]
  dist = (pos[:, :, None] - pos[:, None, :]).astype(np.float64)  # [1, T, S]
  rest = bias + slopes[None, :, None, None] * dist[:, None]  # [1, N, T, S]: a constant per row
  assert bias.shape == (1, 2, 1, 9)
  np.testing.assert_array_equal(rest, np.broadcast_to(rest[..., :1], rest.shape))
