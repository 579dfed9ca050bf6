"""ALiBi forms against closed forms (numpy float64) and HF BLOOM's build_alibi_tensor."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxpe.ops import alibi, positions


def paper_slopes(n):
  """ofirpress/attention_with_linear_biases get_slopes, written out independently."""

  def pow2(k):
    return [2.0 ** (-8.0 * (i + 1) / k) for i in range(k)]

  if math.log2(n).is_integer():
    return pow2(n)
  c = 2 ** int(math.floor(math.log2(n)))
  return pow2(c) + pow2(2 * c)[0::2][: n - c]


def hf_build_alibi_tensor(mask, n):
  """HF BLOOM's ``build_alibi_tensor(torch.tensor(mask), n, torch.float32)`` as numpy (torch and
  transformers are imported at the call, not when the file is collected)."""
  import torch
  from transformers.models.bloom.modeling_bloom import build_alibi_tensor

  return build_alibi_tensor(torch.tensor(mask), n, torch.float32).numpy()


@pytest.mark.parametrize("n", list(range(1, 41)) + [48, 64, 71, 96, 112, 128])
def test_slopes_any_head_count(n):
  np.testing.assert_allclose(alibi.alibi_slopes(n), paper_slopes(n), rtol=1e-7)
  f64 = alibi.alibi_slopes(n, dtype=np.float64)  # for the float64 emulation solvers
  assert isinstance(f64, np.ndarray) and f64.dtype == np.float64
  np.testing.assert_allclose(f64, paper_slopes(n), rtol=1e-14)  # a few float64 ulps
  hf = hf_build_alibi_tensor(np.ones((1, 2), np.float32), n)[:, 0, 1]
  np.testing.assert_allclose(alibi.alibi_slopes(n), hf, rtol=1e-6)


class AlibiFormsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((5, 12, None), (1, 12, 7), (4, 4, 0), (3, 10, 2))
  def test_causal_offset_bias_closed_form(self, q_len, k_len, q_offset):
    slopes = alibi.alibi_slopes(6)
    bias = self.variant(lambda s: alibi.alibi_bias_causal(s, q_len=q_len, k_len=k_len, q_offset=q_offset))(
      slopes
    )
    off = k_len - q_len if q_offset is None else q_offset
    i = off + np.arange(q_len)[:, None]
    j = np.arange(k_len)[None, :]
    ref = -np.asarray(paper_slopes(6))[:, None, None] * (i - j)[None]
    chex.assert_shape(bias, (1, 6, q_len, k_len))
    np.testing.assert_allclose(bias[0], ref, rtol=1e-6, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_chunked_prefill_rows_equal_full_bias(self):
    slopes = alibi.alibi_slopes(4)
    full = alibi.alibi_bias_causal(slopes, q_len=16, k_len=16)
    chunk_fn = self.variant(lambda off: alibi.alibi_bias_causal(slopes, q_len=4, k_len=16, q_offset=off))
    for off in (0, 4, 8, 12):  # traced offset under jit (the cache fill level)
      np.testing.assert_array_equal(chunk_fn(jnp.int32(off))[0], full[0, :, off : off + 4])
    # and the general form with explicit positions agrees
    idx = jnp.arange(16, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(alibi.alibi_bias(slopes, idx, idx), full)

  @chex.variants(with_jit=True, without_jit=True)
  def test_bloom_form_matches_hf_build_alibi_tensor(self):
    mask = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], np.int64)
    n = 6
    out = self.variant(alibi.alibi_bias_bloom)(alibi.alibi_slopes(n), jnp.asarray(mask, jnp.int32))
    hf = hf_build_alibi_tensor(mask, n).reshape(3, n, 1, 7)
    chex.assert_shape(out, (3, n, 1, 7))
    np.testing.assert_allclose(out, hf, rtol=1e-6, atol=1e-6)

  def test_bloom_form_equals_distance_form_after_softmax(self):
    # Left and right padding: +m * pos_j and -m (i - j) differ by a per-row constant.
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], jnp.int32)
    pos = positions.positions_from_mask(mask)
    slopes = alibi.alibi_slopes(4)
    scores = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 6, 6), np.float32))
    idx = jnp.arange(6)
    visible = (idx[None, :] <= idx[:, None])[None, None] & mask.astype(bool)[:, None, None, :]

    def probs(bias):
      logits = jnp.where(visible, scores + bias, -jnp.inf)
      return jax.nn.softmax(logits, axis=-1)

    a = probs(alibi.alibi_bias_bloom(slopes, mask))
    b = probs(alibi.alibi_bias(slopes, pos, pos))
    real_rows = np.asarray(mask, bool)
    np.testing.assert_allclose(
      np.asarray(a)[real_rows[:, None, :].repeat(4, 1)],
      np.asarray(b)[real_rows[:, None, :].repeat(4, 1)],
      rtol=1e-5,
      atol=1e-6,
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_symmetric_form(self):
    rng = np.random.default_rng(0)
    qp = jnp.asarray(rng.integers(0, 50, (2, 5)), jnp.int32)
    kp = jnp.asarray(rng.integers(0, 50, (2, 7)), jnp.int32)
    slopes = alibi.alibi_slopes(3)
    out = self.variant(alibi.alibi_bias_symmetric)(slopes, qp, kp)
    ref = -np.asarray(paper_slopes(3))[None, :, None, None] * np.abs(
      np.asarray(qp)[:, None, :, None] - np.asarray(kp)[:, None, None, :]
    )
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    swapped = alibi.alibi_bias_symmetric(slopes, kp, qp)
    np.testing.assert_array_equal(out, jnp.swapaxes(swapped, 2, 3))

  @chex.variants(with_jit=True, without_jit=True)
  def test_subset_of_heads(self):
    slopes = alibi.alibi_slopes_for_heads(8, alibi_heads=[1, 4, 6, 7])
    np.testing.assert_allclose(np.asarray(slopes)[[1, 4, 6, 7]], paper_slopes(4), rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(slopes)[[0, 2, 3, 5]], 0.0)
    bias = self.variant(lambda s: alibi.alibi_bias_causal(s, q_len=3, k_len=5))(slopes)
    np.testing.assert_array_equal(bias[0, [0, 2, 3, 5]], 0.0)
    assert float(jnp.abs(bias[0, 1]).max()) > 0
    first = alibi.alibi_slopes_for_heads(6, alibi_heads=3)
    np.testing.assert_allclose(first, paper_slopes(3) + [0.0] * 3, rtol=1e-7)


def test_errors_name_the_argument():
  s = alibi.alibi_slopes(2)
  p = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="dtype must be float32 or float64"):
    alibi.alibi_slopes(2, dtype=np.int32)
  with pytest.raises(ValueError, match="k_len .* must be >= q_len"):
    alibi.alibi_bias_causal(s, q_len=5, k_len=3)
  with pytest.raises(ValueError, match="q_offset must be in"):
    alibi.alibi_bias_causal(s, q_len=2, k_len=5, q_offset=4)
  with pytest.raises(ValueError, match="q_offset must be an integer"):
    alibi.alibi_bias_causal(s, q_len=2, k_len=5, q_offset=1.5)
  with pytest.raises(ValueError, match="q_len"):
    alibi.alibi_bias_causal(s, q_len=0, k_len=5)
  with pytest.raises(ValueError, match="slopes must be finite and >= 0"):
    alibi.alibi_bias_symmetric(jnp.asarray([0.5, -0.1]), p, p)
  with pytest.raises(ValueError, match="slopes must have shape"):
    alibi.alibi_bias_bloom(jnp.ones((2, 2)), p)
  with pytest.raises(ValueError, match="attention_mask must have shape"):
    alibi.alibi_bias_bloom(s, jnp.ones((3,), jnp.int32))
  with pytest.raises(ValueError, match="same batch size"):
    alibi.alibi_bias_symmetric(s, p, jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="q_positions must be >= 0"):
    alibi.alibi_bias_symmetric(s, p.at[0, 0].set(-1), p)
  with pytest.raises(TypeError, match="k_positions must be an integer"):
    alibi.alibi_bias_symmetric(s, p, p.astype(jnp.float32))
  with pytest.raises(ValueError, match="alibi_heads must be distinct"):
    alibi.alibi_slopes_for_heads(4, alibi_heads=[1, 1])
  with pytest.raises(ValueError, match="alibi_heads must be distinct"):
    alibi.alibi_slopes_for_heads(4, alibi_heads=[4])
  with pytest.raises(ValueError, match="alibi_heads must be in"):
    alibi.alibi_slopes_for_heads(4, alibi_heads=5)
  with pytest.raises(ValueError, match="num_heads"):
    alibi.alibi_slopes_for_heads(0, alibi_heads=1)
