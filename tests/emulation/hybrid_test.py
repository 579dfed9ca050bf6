"""RoPE and emulated ALiBi in one head (``apply_rope_alibi(content_inv_freq=...)``, issue 20).

References are independent of the code under test: the content score from a float64 rotation of q
and k (RoPE's complex form written out in numpy), the exact ALiBi bias ``-m (i - j)`` in float64,
and the solver's bound on the bias deviation.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe import emulation
from jaxpe.ops import rope_scaling


def rotate_f64(x, pos, inv_freq, layout):
  """RoPE in float64: pair p of row t times ``exp(1j pos[t] inv_freq[p])``; ``[B, T, N, H]``."""
  x = np.asarray(x, np.float64)
  r = 2 * len(inv_freq)
  if layout == "interleaved":
    z = x[..., 0:r:2] + 1j * x[..., 1:r:2]
  else:
    z = x[..., : r // 2] + 1j * x[..., r // 2 : r]
  z = z * np.exp(1j * np.asarray(pos, np.float64)[:, :, None, None] * np.asarray(inv_freq, np.float64))
  out = x.copy()
  if layout == "interleaved":
    out[..., 0:r:2], out[..., 1:r:2] = z.real, z.imag
  else:
    out[..., : r // 2], out[..., r // 2 : r] = z.real, z.imag
  return out


def hybrid_reference(q, k, qpos, kpos, slopes, inv_freq, layout):
  """float64 ``[B, N, T, S]``: RoPE content score / sqrt(H) + exact ALiBi ``-m (i - j)``; distances."""
  h = q.shape[-1]
  qr, kr = rotate_f64(q, qpos, inv_freq, layout), rotate_f64(k, kpos, inv_freq, layout)
  kr = np.repeat(kr, q.shape[2] // k.shape[2], axis=2)
  content = np.einsum("btnh,bsnh->bnts", qr, kr) / math.sqrt(h)
  d = np.asarray(qpos, np.float64)[:, None, :, None] - np.asarray(kpos, np.float64)[:, None, None, :]
  return content - np.asarray(slopes, np.float64)[None, :, None, None] * d, d


def scores(qa, ka, h):
  ka = jnp.repeat(ka, qa.shape[2] // ka.shape[2], axis=2)
  out = jnp.einsum("BTNH,BSNH->BNTS", qa, ka, preferred_element_type=jnp.float32) / jnp.float32(math.sqrt(h))
  return np.asarray(out, np.float64)


SLOPES = np.asarray([2.0**-1, 2.0**-3, 2.0**-5, 2.0**-8])
B, T, N, K, H, LENGTH = 1, 48, 4, 2, 16, 512


def data(seed):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, LENGTH, K, H)).astype(np.float32)
  qpos = np.sort(rng.choice(LENGTH, T, replace=False))[None].astype(np.int32)
  kpos = np.arange(LENGTH, dtype=np.int32)[None]
  return q, k, qpos, kpos


@pytest.mark.parametrize(
  "scaling, layout, order",
  [
    (None, "interleaved", 1),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, "half", 2),
  ],
)
def test_hybrid_scores_are_rope_plus_alibi_within_the_solver_bound(scaling, layout, order):
  q, k, qpos, kpos = data(0)
  inv_freq, factor = rope_scaling.rope_frequencies(
    scaling, head_dim=H, rope_theta=100.0, max_position_embeddings=512
  )
  plan = emulation.solve_emulation(SLOPES, head_dim=H, max_len=LENGTH, order=order, max_phase=0.1)
  fn = jax.jit(
    lambda q, k, qp, kp: emulation.apply_rope_alibi(
      q,
      k,
      qp,
      kp,
      slopes=SLOPES,
      theta=float(plan.theta[0]),
      order=order,
      content_inv_freq=inv_freq,
      content_layout=layout,
      content_attention_factor=factor,
    )
  )
  qa, ka = fn(q, k, qpos, kpos)
  assert qa.shape == (B, T, N, H + 2 * order) and ka.shape == (B, LENGTH, K, H + 2 * order)
  # The reference rotates by the float32 frequencies the op uses and scales each pair by the factor
  # (a YaRN attention factor multiplies cos and sin of q and of k).
  ref, d = hybrid_reference(
    q * factor, k * factor, qpos, kpos, SLOPES, np.asarray(inv_freq, np.float64), layout
  )
  causal = d >= 0
  dev = np.where(causal, np.abs(scores(qa, ka, H) - ref), 0.0)[0]  # [N, T, S]
  # Bias part: the solver's pointwise bound; content part: float32 rounding of an H-term dot product
  # of unit-normal rows (|score| a few units): 1e-5 logits is ~100 ulps of slack.
  bound = plan.bound_at(np.maximum(d[0, 0], 0.0), qpos[0][:, None])  # [N, T, S]
  print("solver bound per head (logits):", plan.bound, "max measured:", dev.max(axis=(1, 2)))
  assert np.all(dev <= bound + 1e-5), float(np.max(dev - bound))
  # The content is really rotated: without it the scores miss RoPE by far more than the bound.
  plain, _ = hybrid_reference(q, k, qpos, kpos, SLOPES, np.zeros(H // 2), layout)
  assert np.max(np.where(causal, np.abs(plain - ref), 0.0)) > 0.1


def test_content_frequencies_zero_are_todays_form_bit_for_bit():
  """BLOOM-style check: ``content_inv_freq`` all zero (and None) equals the published form exactly,
  for float32 and bfloat16 content."""
  q, k, qpos, kpos = data(1)
  kw = dict(slopes=SLOPES, theta=0.1 / LENGTH, order=2)
  for dtype in (jnp.float32, jnp.bfloat16):
    qd, kd = jnp.asarray(q, dtype), jnp.asarray(k, dtype)
    today = jax.jit(lambda q, k, a, b: emulation.apply_rope_alibi(q, k, a, b, **kw))(qd, kd, qpos, kpos)
    zero = jax.jit(
      lambda q, k, a, b: emulation.apply_rope_alibi(q, k, a, b, content_inv_freq=np.zeros(H // 2), **kw)
    )(qd, kd, qpos, kpos)
    for got, want in zip(zero, today, strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_hybrid_gradients_match_the_float64_scores():
  """d(sum of w * scores)/dq under jit against the float64 reference's analytic gradient: the
  content rotation is linear in q, so the gradient is the rotated keys weighted by w."""
  rng = np.random.default_rng(2)
  t, s = 6, 6
  q = rng.standard_normal((1, t, 2, 8)).astype(np.float32)
  k = rng.standard_normal((1, s, 1, 8)).astype(np.float32)
  pos = np.arange(t, dtype=np.int32)[None]
  inv_freq = 0.5 ** np.arange(4)
  w = rng.standard_normal((1, 2, t, s))
  slopes = np.asarray([0.5, 0.25])

  def loss(q):
    qa, ka = emulation.apply_rope_alibi(
      q, k, pos, pos, slopes=slopes, theta=0.01, content_inv_freq=inv_freq.astype(np.float32)
    )
    ka = jnp.repeat(ka, 2, axis=2)
    return jnp.sum(jnp.einsum("BTNH,BSNH->BNTS", qa, ka) / math.sqrt(8) * w)

  g = np.asarray(jax.jit(jax.grad(loss))(q), np.float64)
  f32 = np.asarray(inv_freq.astype(np.float32), np.float64)
  kr = np.repeat(rotate_f64(k, pos, f32, "interleaved"), 2, axis=2)  # [1, S, 2, 8]
  gr = np.einsum("bnts,bsnh->btnh", w, kr) / math.sqrt(8)  # gradient w.r.t. the rotated q
  ref = rotate_f64(gr, -pos, f32, "interleaved")  # the rotation's transpose: rotate back
  np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-5)


def test_content_frequencies_are_checked():
  q, k, qpos, kpos = data(3)
  with pytest.raises(ValueError, match="rotary_dim must be <= head_dim"):
    emulation.apply_rope_alibi(
      q, k, qpos, kpos, slopes=SLOPES, theta=1e-4, content_inv_freq=np.ones(H // 2 + 1, np.float32)
    )
