"""CoPE (jaxpe.ops.cope) against the paper's own torch code (arXiv 2405.18719, its CoPE module, in
float64 with autograd) and a float64 numpy transcription of its formula; jitted, with gradients."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.ops import cope

B, T, N, K, H, P = 2, 10, 4, 2, 8, 6


@functools.cache
def _paper_cope():
  """The paper's CoPE module class (torch is imported at the first call, not at collection)."""
  import torch
  from torch import nn

  class CoPE(nn.Module):
    """The paper's reference code (Golovneva et al. 2024, arXiv 2405.18719, Section 3 / appendix;
    facebookresearch/RAM projects/cope), unchanged but for the layout of this file."""

    def __init__(self, npos_max, head_dim):
      super().__init__()
      self.npos_max = npos_max
      self.pos_emb = nn.parameter.Parameter(torch.zeros(1, head_dim, npos_max))

    def forward(self, query, attn_logits):
      # compute positions
      gates = torch.sigmoid(attn_logits)
      pos = gates.flip(-1).cumsum(dim=-1).flip(-1)
      pos = pos.clamp(max=self.npos_max - 1)
      # interpolate from integer positions
      pos_ceil = pos.ceil().long()
      pos_floor = pos.floor().long()
      logits_int = torch.matmul(query, self.pos_emb)
      logits_ceil = logits_int.gather(-1, pos_ceil)
      logits_floor = logits_int.gather(-1, pos_floor)
      w = pos - pos_floor
      return logits_ceil * w + logits_floor * (1 - w)

  return CoPE


def _paper_bias(q, k, pos_emb, mask):
  """The paper's SelfAttn up to the CoPE term, per head (q [B, T, N, H] as [B*N, T, H]): returns
  (bias [B, N, T, S], grads of q, k, pos_emb of sum(bias * w) where visible)."""
  import torch

  g = q.shape[2] // k.shape[2]
  tq = torch.tensor(np.asarray(q, np.float64), requires_grad=True)
  tk = torch.tensor(np.asarray(k, np.float64), requires_grad=True)
  module = _paper_cope()(pos_emb.shape[-1], pos_emb.shape[0]).double()
  with torch.no_grad():
    module.pos_emb.copy_(torch.tensor(np.asarray(pos_emb, np.float64))[None])
  query = tq.permute(0, 2, 1, 3).reshape(-1, q.shape[1], q.shape[3])  # [B*N, T, H]
  key = tk.repeat_interleave(g, dim=2).permute(0, 2, 1, 3).reshape(-1, k.shape[1], k.shape[3])
  m = torch.tensor(np.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))).reshape(
    -1, q.shape[1], k.shape[1]
  )
  attn_logits = torch.bmm(query, key.transpose(-1, -2)) / math.sqrt(q.shape[3])
  attn_logits = attn_logits + m.double().log()
  bias = module(query, attn_logits).reshape(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
  w = torch.tensor(_weights(bias.shape)) * torch.tensor(np.asarray(mask, np.float64))
  (bias * w).sum().backward()
  return bias.detach().numpy(), (tq.grad.numpy(), tk.grad.numpy(), module.pos_emb.grad.numpy()[0])


def _numpy_bias(q, k, pos_emb, mask):
  """float64 numpy from the paper's formula: p_ij = min(sum_{k=j..} sigma(q_i.k_k / sqrt H), P-1)."""
  q, k, e = (np.asarray(x, np.float64) for x in (q, k, pos_emb))
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  z = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[3])
  gates = np.where(mask, 1.0 / (1.0 + np.exp(-z)), 0.0)
  pos = np.minimum(np.cumsum(gates[..., ::-1], axis=-1)[..., ::-1], e.shape[-1] - 1)
  lo, hi = np.floor(pos).astype(int), np.ceil(pos).astype(int)
  table = np.einsum("btnh,hp->bntp", q, e)
  at = lambda idx: np.take_along_axis(table, idx, axis=-1)  # noqa: E731
  return at(hi) * (pos - lo) + at(lo) * (1 - (pos - lo)), pos


def _weights(shape):
  return np.random.default_rng(7).normal(size=shape)


def _inputs(scale_q=1.0):
  rng = np.random.default_rng(0)
  q = (rng.normal(size=(B, T, N, H)) * scale_q).astype(np.float32)
  k = rng.normal(size=(B, T, K, H)).astype(np.float32)
  pos_emb = rng.normal(size=(H, P)).astype(np.float32)
  # causal; row 1 left-padded by 2 keys; row 0 two packed documents (5 + 5)
  causal = np.tril(np.ones((T, T), bool))
  valid = np.arange(T)[None] >= np.array([[0], [2]])
  seg = np.stack([np.repeat([1, 2], 5), np.ones(T, int)])
  mask = (causal[None] & valid[:, None, :] & (seg[:, :, None] == seg[:, None, :]))[:, None]
  return q, k, pos_emb, mask


@pytest.mark.parametrize("scale_q", [1.0, 4.0])
def test_cope_bias_matches_the_papers_code_and_formula(scale_q):
  # scale_q 4: gates near 0 and 1, counts past P - 1 = 5 clamp
  q, k, pos_emb, mask = _inputs(scale_q)
  fn = jax.jit(lambda q, k, e: cope.cope_bias(q, k, e, scale=H**-0.5, mask=mask))
  got = np.asarray(fn(q, k, pos_emb))
  want, want_grads = _paper_bias(q, k, pos_emb, mask)
  want_np, pos = _numpy_bias(q, k, pos_emb, mask)
  vis = np.broadcast_to(mask, got.shape)
  np.testing.assert_allclose(want[vis], want_np[vis], atol=1e-12)  # the two references agree
  np.testing.assert_allclose(got[vis], want[vis], atol=2e-5, rtol=1e-5)
  assert pos.max() > 1.5 and (scale_q == 1.0 or pos.max() == P - 1)  # counts spread over several positions
  # gradients of sum(bias * w) over visible entries: q, k (through the gates and w) and pos_emb
  w = jnp.asarray(_weights(got.shape) * vis, jnp.float32)
  grads = jax.jit(jax.grad(lambda q, k, e: jnp.sum(fn(q, k, e) * w), argnums=(0, 1, 2)))(q, k, pos_emb)
  for name, g, ref in zip(("q", "k", "pos_emb"), grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), ref, atol=5e-5, rtol=1e-4, err_msg=name)
  assert np.abs(want_grads[1]).max() > 1e-3  # the gates' gradient reaches k


def test_per_head_tables_and_positions():
  q, k, _, mask = _inputs()
  tables = np.random.default_rng(2).normal(size=(N, H, P)).astype(np.float32)
  got = np.asarray(jax.jit(lambda q, k, e: cope.cope_bias(q, k, e, scale=H**-0.5, mask=mask))(q, k, tables))
  for n in range(N):  # head n with its own table equals the shared form with that table
    want, _ = _numpy_bias(q[:, :, n : n + 1], k[:, :, n // (N // K) : n // (N // K) + 1], tables[n], mask)
    vis = np.broadcast_to(mask, want.shape)
    np.testing.assert_allclose(got[:, n : n + 1][vis], want[vis], atol=2e-5, rtol=1e-5)
  # cope_positions: a key hidden by the mask counts nothing; the diagonal counts the query's own gate
  z = np.random.default_rng(3).normal(size=(1, 1, T, T)).astype(np.float32)
  pos = np.asarray(jax.jit(lambda z: cope.cope_positions(z, mask[:1], npos_max=100))(z))
  np.testing.assert_allclose(np.diagonal(pos[0, 0]), 1 / (1 + np.exp(-np.diagonal(z[0, 0]))), rtol=1e-6)
  assert np.all(pos[0, 0][np.triu(np.ones((T, T), bool), 1)] == 0)  # keys after the query
  # row 0's second document (queries 5..9): its count stops at its first key, hidden keys add nothing
  np.testing.assert_array_equal(pos[0, 0, 5:, :5], np.repeat(pos[0, 0, 5:, 5:6], 5, axis=1))


def test_cope_errors():
  q, k, pos_emb, mask = _inputs()
  with pytest.raises(ValueError, match=r"pos_emb must be \[H, P\] or \[N, H, P\]"):
    cope.cope_bias(q, k, pos_emb[:4], scale=1.0)
  with pytest.raises(ValueError, match="pos_emb .N, H, P. must have N = 4"):
    cope.cope_bias(q, k, np.zeros((3, H, P), np.float32), scale=1.0)
  with pytest.raises(ValueError, match="scale"):
    cope.cope_bias(q, k, pos_emb, scale=0.0)
  with pytest.raises(TypeError, match="mask must be a bool array"):
    cope.cope_bias(q, k, pos_emb, scale=1.0, mask=mask.astype(np.float32))
  with pytest.raises(ValueError, match="mask must broadcast"):
    cope.cope_bias(q, k, pos_emb, scale=1.0, mask=mask[:, :, :3])
  with pytest.raises(ValueError, match="npos_max"):
    cope.cope_positions(np.zeros((2, 2), np.float32), npos_max=0)
  with pytest.raises(ValueError, match="q, k must be"):
    cope.cope_bias(q, np.zeros((B, T, 3, H), np.float32), pos_emb, scale=1.0)
