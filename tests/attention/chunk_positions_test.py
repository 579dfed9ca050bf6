"""Chunked attention counts chunks in the tokens' positions, not the slots (issue 47): each row's
chunks start at its first real token (left padding) and restart with each packed document, as
transformers' ``create_chunked_causal_mask`` (``chunked_overlay``'s left-padding offset,
``remap_positions_for_packed_sequence``); an ``IndexMask``'s ``q_positions`` / ``k_positions`` (the
KV cache) on the decode path and the blockwise loops; the window stays a distance (packed windows
as transformers' position-remapped ones). Visibility probed through the softmax weights against
transformers' own mask functions; values in patterns_test (float64 reference)."""

import jax
import numpy as np
import pytest
import torch
from patterns_test import _doc_positions, _hf_mask, _visible_by_probe  # tests/attention/patterns_test.py
from transformers.masking_utils import (
  and_masks,
  chunked_causal_mask_function,
  packed_sequence_mask_function,
  padding_mask_function,
  remap_positions_for_packed_sequence,
  sliding_window_causal_mask_function,
)

from jaxpe.attention import AttentionMask, IndexMask, attention, blockwise, patterns

B, T, C = 2, 19, 4
PAD = torch.tensor([0, 3])  # row 1: three padding tokens on the left


def _left_padded():
  valid = (torch.arange(T)[None, :] >= PAD[:, None]).numpy()
  return valid, valid[:, :, None] & valid[:, None, :]  # real query and key pairs


def test_left_padding_matches_transformers_chunks():
  valid, real = _left_padded()
  hf = and_masks(chunked_causal_mask_function(C, PAD), padding_mask_function(torch.as_tensor(valid)))
  want = _hf_mask(hf, T, T)
  mask = AttentionMask(valid=valid, causal=True)
  for fn in (
    lambda q, k, v: attention(q, k, v, scale=1.0, mask=mask, chunk_size=C),  # CPU: the XLA loops
    lambda q, k, v: blockwise.blockwise_attention(
      q, k, v, scale=1.0, mask=mask, chunk_size=C, block_q=8, block_k=8
    ),
    lambda q, k, v: attention(
      q, k, v, scale=1.0, mask=mask, chunk_size=C, bias=np.zeros((B, 1, T, T), np.float32)
    ),
  ):
    got = _visible_by_probe(jax.jit(fn), T, T)  # jitted: one compile, not op-by-op dispatch
    np.testing.assert_array_equal(got[real], want[real])
  # the slots' chunks differ on the padded row: the test can fail
  assert (
    want[1]
    != (np.arange(T)[:, None] // C == np.arange(T)[None, :] // C)
    & (np.arange(T)[None, :] <= np.arange(T)[:, None])
  )[real[1]].any()


def test_packed_documents_restart_chunks_and_windows_as_transformers():
  seg = np.zeros((B, T), np.int32)
  seg[0, 7:] = 1  # row 0: documents of 7 and 12 tokens
  seg[1, 10:] = 2
  valid = np.ones((B, T), bool)
  position_ids = torch.as_tensor(_doc_positions(valid, seg))
  same_doc = packed_sequence_mask_function(torch.as_tensor(seg))
  for hf_fn, opts in (
    (chunked_causal_mask_function(C, torch.zeros(B, dtype=torch.long)), dict(chunk_size=C)),
    (sliding_window_causal_mask_function(3), dict(local_window_size=(2, 0))),
  ):
    want = _hf_mask(and_masks(remap_positions_for_packed_sequence(hf_fn, position_ids), same_doc), T, T)
    mask = AttentionMask(segment_ids=seg, causal=True)
    got = _visible_by_probe(
      lambda q, k, v, mask=mask, opts=opts: attention(q, k, v, scale=1.0, mask=mask, **opts), T, T
    )
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("t_len", [2, 9])  # the decode path (<= 8 queries) and the blockwise loops
def test_index_mask_positions_as_transformers_cache(t_len):
  """A KV cache of T slots (row 1 left-padded by 3) and t_len new queries at its end: q_positions /
  k_positions (positions from the first real token) give transformers' chunks; the slots do not."""
  valid, real = _left_padded()
  hf = and_masks(chunked_causal_mask_function(C, PAD), padding_mask_function(torch.as_tensor(valid)))
  want = _hf_mask(hf, t_len, T, q_offset=T - t_len)
  slots = np.broadcast_to(np.arange(T), (B, T))
  pos = np.maximum(slots - PAD.numpy()[:, None], 0)
  index = IndexMask(slots[:, T - t_len :], slots, True, valid, None, None, pos[:, T - t_len :], pos)
  got = _visible_by_probe(lambda q, k, v: attention(q, k, v, scale=1.0, mask=index, chunk_size=C), t_len, T)
  keep = real[:, T - t_len :]
  np.testing.assert_array_equal(got[keep], want[keep])
  plain = IndexMask(slots[:, T - t_len :], slots, True, valid)
  slot_based = _visible_by_probe(
    lambda q, k, v: attention(q, k, v, scale=1.0, mask=plain, chunk_size=C), t_len, T
  )
  assert (slot_based[keep] != want[keep]).any()


def test_document_positions_in_loops():
  rng = np.random.default_rng(0)
  valid = rng.random((3, 23)) > 0.3
  valid[0] = True
  seg = np.sort(rng.integers(0, 4, (3, 23)), axis=1).astype(np.int32)
  got = np.asarray(patterns.document_positions(valid, seg, 3, 23))
  want = _doc_positions(valid, seg)
  np.testing.assert_array_equal(got[valid], want[valid])
  np.testing.assert_array_equal(np.asarray(patterns.document_positions(None, None, 1, 5)), [np.arange(5)])
