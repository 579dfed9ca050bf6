"""Positions from padding masks and segment ids, and the packed-document mask, against loops."""

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpe.attention import masks
from jaxpe.ops import positions


def mask_positions_loop(mask, start=0):
  out = np.zeros(mask.shape, np.int64)
  for b in range(mask.shape[0]):
    count = 0
    for t in range(mask.shape[1]):
      if mask[b, t]:
        out[b, t] = count + (start[b] if np.ndim(start) else start)
        count += 1
  return out


def segment_positions_loop(ids):
  out = np.zeros(ids.shape, np.int64)
  for b in range(ids.shape[0]):
    for t in range(1, ids.shape[1]):
      out[b, t] = out[b, t - 1] + 1 if ids[b, t] == ids[b, t - 1] else 0
  return out


_FROM_MASK = jax.jit(positions.positions_from_mask)
_FROM_SEG = jax.jit(positions.positions_from_segment_ids)


@settings(max_examples=30, deadline=None)
@given(mask=hnp.arrays(np.bool_, (3, 10)), start=hnp.arrays(np.int32, (3,), elements=st.integers(0, 1000)))
def test_positions_from_mask_any_padding(mask, start):
  np.testing.assert_array_equal(_FROM_MASK(jnp.asarray(mask)), mask_positions_loop(mask))
  np.testing.assert_array_equal(
    _FROM_MASK(jnp.asarray(mask), start=jnp.asarray(start)), mask_positions_loop(mask, start)
  )


@settings(max_examples=30, deadline=None)
@given(ids=hnp.arrays(np.int32, (2, 12), elements=st.integers(0, 3)))
def test_positions_from_segment_ids(ids):
  np.testing.assert_array_equal(_FROM_SEG(jnp.asarray(ids)), segment_positions_loop(ids))


class PositionsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_left_and_right_padding_by_hand(self):
    mask = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], jnp.int32)
    out = self.variant(positions.positions_from_mask)(mask)
    np.testing.assert_array_equal(out, [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0]])
    out = self.variant(lambda m: positions.positions_from_mask(m, start=7))(mask)
    np.testing.assert_array_equal(out, [[0, 0, 7, 8, 9], [7, 8, 9, 0, 0]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_document_mask(self):
    ids = jnp.asarray([[1, 1, 2, 2, 2, 3]], jnp.int32)
    m = self.variant(masks.document_mask)(ids, ids)
    ref = np.zeros((6, 6), bool)
    idv = np.asarray(ids[0])
    for i in range(6):
      for j in range(6):
        ref[i, j] = idv[i] == idv[j] and j <= i
    np.testing.assert_array_equal(m[0, 0], ref)
    both = self.variant(lambda a, b: masks.document_mask(a, b, causal=False))(ids, ids)
    np.testing.assert_array_equal(both[0, 0], idv[:, None] == idv[None, :])
    # last two queries against all six keys
    tail = self.variant(lambda a, b: masks.document_mask(a, b, q_offset=4))(ids[:, 4:], ids)
    np.testing.assert_array_equal(tail[0, 0], ref[4:])


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="attention_mask must have shape"):
    positions.positions_from_mask(jnp.ones((3,), jnp.int32))
  with pytest.raises(TypeError, match="attention_mask must be a bool or integer"):
    positions.positions_from_mask(jnp.ones((1, 3), jnp.float32))
  with pytest.raises(ValueError, match="start must be >= 0"):
    positions.positions_from_mask(jnp.ones((1, 3), jnp.int32), start=-1)
  with pytest.raises(ValueError, match="start.shape"):
    positions.positions_from_mask(jnp.ones((2, 3), jnp.int32), start=jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="start must be >= 0"):
    positions.positions_from_mask(jnp.ones((1, 3), jnp.int32), start=jnp.asarray([-2], jnp.int32))
  with pytest.raises(TypeError, match="segment_ids must be an integer"):
    positions.positions_from_segment_ids(jnp.ones((1, 3), jnp.float32))
  with pytest.raises(ValueError, match="segment_ids must have shape"):
    positions.positions_from_segment_ids(jnp.ones((3,), jnp.int32))
  with pytest.raises(ValueError, match="same batch size"):
    masks.document_mask(jnp.ones((1, 3), jnp.int32), jnp.ones((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="q_offset"):
    masks.document_mask(jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3), jnp.int32), q_offset=-1)
  with pytest.raises(TypeError, match="k_segment_ids must be an integer"):
    masks.document_mask(jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3), jnp.float32))
