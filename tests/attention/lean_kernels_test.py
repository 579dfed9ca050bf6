"""The lean ALiBi emulation on the Pallas kernels (interpret mode) against native ALiBi on xla:
forward and gradients, causal, odd T, left padding, packed segments, grouped-query heads kept,
slopes that are and are not powers of two, zero slopes; and a decoder with the default form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore

from jaxpe.attention import backends, fused, kernels, masks
from jaxpe.model.config import ModelConfig
from jaxpe.model.decoder import Decoder

B, T, N, K, H = 2, 75, 4, 2, 32  # odd T (the kernels pad it to whole blocks)
PAD = 9
SLOPES = np.array([0.5, 0.3, 0.0, 2.0**-7])  # power of two, not, zero (alibi_heads), small


def _inputs():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
  valid = jnp.asarray(np.arange(T)[None, :] >= np.array([[0], [PAD]]))
  segments = jnp.asarray(np.stack([np.repeat([3, 1, 8], [30, 20, 25]), np.zeros(T, int)]), jnp.int32)
  # row 0: packed documents, positions restart per document; row 1: left padding, positions from 0
  pos0 = np.concatenate([np.arange(30), np.arange(20), np.arange(25)])
  pos1 = np.maximum(np.arange(T) - PAD, 0)
  positions = jnp.asarray(np.stack([pos0, pos1]), jnp.int32)
  mask = masks.AttentionMask(valid=valid, segment_ids=segments, causal=True)
  return q, k, v, positions, mask


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_lean_alibi_on_kernel_matches_native_alibi_forward_and_gradients(impl):
  q, k, v, positions, mask = _inputs()
  spec = backends.AlibiSpec(SLOPES, positions, positions, max_position=65536, form="lean")

  def loss(impl, q, k, v):
    out = kernels.attention(
      q, k, v, scale=H**-0.5, mask=mask, alibi_spec=spec, implementation=impl, interpret=True
    )
    return jnp.sum(jnp.where(mask.valid[:, :, None, None], out, 0.0) ** 2), out

  def run(impl):
    return jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (_, out), grads = run(impl)
  (_, ref), ref_grads = run("xla")  # native ALiBi bias, float32
  ok = np.asarray(mask.valid)
  np.testing.assert_allclose(np.asarray(out)[ok], np.asarray(ref)[ok], atol=2e-5, rtol=0)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5, rtol=0)


def _kernel_operands(impl, spec, q, k, v, mask):
  """Shapes of the arrays the kernel call receives, read from the jaxpr of ``attention``."""
  jaxpr = jax.make_jaxpr(
    lambda q, k, v: kernels.attention(
      q, k, v, scale=H**-0.5, mask=mask, alibi_spec=spec, implementation=impl, interpret=True
    )
  )(q, k, v)

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        yield from (tuple(var.aval.shape)[-3:] for var in e.invars)
      for sub in jcore.jaxprs_in_params(e.params):
        yield from walk(sub)

  return list(walk(jaxpr.jaxpr))


def test_lean_keys_keep_the_kv_heads_and_v_its_dim():
  # Grouped-query sharing kept: prepare's k has K heads (the rotated form with one theta too); v
  # keeps its own dim on splash and the q/k width on cudnn / pallas_gpu. Read on CPU by tracing.
  q, k, v, positions, mask = _inputs()
  for form, kv in (("lean", K), ("exact", K), ("rotated", K)):
    spec = backends.check_alibi_spec(
      backends.AlibiSpec(np.array([0.5, 0.3, 0.2, 0.1]), positions, positions, max_position=65536, form=form),
      B,
      T,
      T,
      N,
      fused=True,
    )
    for impl in ("splash", "cudnn", "pallas_gpu"):
      qf, kf, vf, _ = jax.eval_shape(
        lambda q, k, v, spec=spec, impl=impl: fused.prepare(
          q, k, v, scale=H**-0.5, mask=mask, alibi_spec=spec, precise_dims=0, implementation=impl
        ),
        q,
        k,
        v,
      )
      assert kf.shape[2] == kv and qf.shape[2] == N, (form, impl, kf.shape)
      assert vf.shape[-1] == (H if impl == "splash" else qf.shape[-1]), (form, impl, vf.shape)
  # The kernel itself (splash keeps K; pallas_gpu's mha has no grouped heads, so attend repeats there)
  spec = backends.AlibiSpec(SLOPES, positions, positions, max_position=65536)
  shapes = _kernel_operands("splash", spec, q, k, v, mask)
  assert (N, 128, 128) in shapes and (K, 128, 128) in shapes and (K, 128, H) in shapes, shapes


def test_decoder_with_default_lean_emulation_on_splash_matches_xla():
  assert ModelConfig().alibi_emulation == "lean"
  base = dict(vocab_size=64, d_model=2 * 32, num_layers=1, num_heads=2, num_kv_heads=1, max_len=64)
  base.update(pos_encoding="alibi", alibi_heads=1)  # one zero slope
  ref_model = Decoder(ModelConfig(**base), rngs=nnx.Rngs(0))
  model = Decoder(
    ModelConfig(**base, attn_implementation="splash", attention_interpret=True), rngs=nnx.Rngs(0)
  )
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 64)), jnp.int32)
  valid = jnp.asarray(np.arange(64)[None, :] >= np.array([[0], [5]]))

  def run(m):
    return nnx.jit(lambda m, t, v: m(t, attention_mask=v))(m, tokens, valid)

  ok = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(run(model))[ok], np.asarray(run(ref_model))[ok], atol=2e-4, rtol=0)
