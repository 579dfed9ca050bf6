"""The RoPE pair layout: required by every op that rotates (no default), and the conversion
(interleaved <-> rotate-half) of activations and q/k projection weights."""

import inspect
import re

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpe
import jaxpe.ops
from jaxpe.ops import layouts, rope


def hf_permute(w, n_heads):
  """HF convert_llama_weights_to_hf.py ``permute`` (Meta interleaved -> HF rotate-half), numpy."""
  dim1, dim2 = w.shape
  return w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3).reshape(dim1, dim2)


def test_fused_weight_matches_hf_permute():
  w = np.random.default_rng(0).normal(size=(4 * 16, 24)).astype(np.float32)
  out = layouts.convert_qk_proj_weight(w, num_heads=4, head_dim=16, src="interleaved", dst="half")
  assert isinstance(out, np.ndarray)
  np.testing.assert_array_equal(out, hf_permute(w, 4))
  back = layouts.convert_qk_proj_weight(out, num_heads=4, head_dim=16, src="half", dst="interleaved")
  np.testing.assert_array_equal(back, w)


def test_permutation_by_hand():
  # H = 8, R = 6: pairs (0,1),(2,3),(4,5) -> (0,3),(1,4),(2,5); dims 6, 7 stay.
  perm = layouts.layout_permutation(8, src="interleaved", dst="half", rotary_dim=6)
  np.testing.assert_array_equal(perm, [0, 2, 4, 1, 3, 5, 6, 7])
  inv = layouts.layout_permutation(8, src="half", dst="interleaved", rotary_dim=6)
  np.testing.assert_array_equal(inv, [0, 3, 1, 4, 2, 5, 6, 7])
  np.testing.assert_array_equal(layouts.layout_permutation(8, src="half", dst="half"), np.arange(8))


_ROT = jax.jit(rope.apply_rope, static_argnames=("layout",))


@settings(max_examples=20, deadline=None)
@given(
  x=hnp.arrays(np.float32, (2, 3, 2, 12), elements=st.floats(-10, 10, width=32)),
  pos=hnp.arrays(np.int32, (2, 3), elements=st.integers(0, 100000)),
  rotary_dim=st.sampled_from([4, 8, 12]),
  src=st.sampled_from(["interleaved", "half"]),
)
def test_conversion_commutes_with_rotation(x, pos, rotary_dim, src):
  dst = "half" if src == "interleaved" else "interleaved"
  inv = rope.rope_inv_freq(12, rotary_dim=rotary_dim)
  x, pos = jnp.asarray(x), jnp.asarray(pos)
  a = layouts.convert_layout(_ROT(x, pos, inv_freq=inv, layout=src), src=src, dst=dst, rotary_dim=rotary_dim)
  b = _ROT(layouts.convert_layout(x, src=src, dst=dst, rotary_dim=rotary_dim), pos, inv_freq=inv, layout=dst)
  np.testing.assert_array_equal(a, b)  # the same float32 operations on the same numbers


def _scores(x, wq, bq, wk, bk, pos, inv, layout):
  q = jnp.einsum("BTD,DNH->BTNH", x, wq) + bq[None, None]
  k = jnp.einsum("BSD,DKH->BSKH", x, wk) + bk[None, None]
  q = rope.apply_rope(q, pos, inv_freq=inv, layout=layout)
  k = rope.apply_rope(k, pos, inv_freq=inv, layout=layout)
  n, kv = q.shape[2], k.shape[2]
  k = jnp.repeat(k, n // kv, axis=2)
  return jnp.einsum("BTNH,BSNH->BNTS", q, k)


class ModelScoresTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(heads=((4, 4), (6, 2)), rotary_dim=(16, 8), src=("interleaved", "half"))
  def test_same_scores_after_weight_conversion(self, heads, rotary_dim, src):
    n, kv = heads
    h, d = 16, 20
    dst = "half" if src == "interleaved" else "interleaved"
    rng = np.random.default_rng(0)  # numpy: a jax.random draw compiles once per shape (1-3 s of CPU)
    x, wq, wk, bq, bk = (
      jnp.asarray(rng.standard_normal(shape, np.float32))
      for shape in ((2, 9, d), (d, n, h), (d, kv, h), (n, h), (kv, h))
    )
    pos = jnp.asarray(np.random.default_rng(1).integers(0, 3000, (2, 9)), jnp.int32)
    inv = rope.rope_inv_freq(h, rotary_dim=rotary_dim)
    conv = lambda w: layouts.convert_layout(w, src=src, dst=dst, rotary_dim=rotary_dim)  # noqa: E731
    f = self.variant(_scores, static_argnames=("layout",))
    before = f(x, wq, bq, wk, bk, pos, inv, layout=src)
    after = f(x, conv(wq), conv(bq), conv(wk), conv(bk), pos, inv, layout=dst)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-4 * float(jnp.abs(before).max()))
    # Without conversion the scores differ: the test can fail.
    wrong = f(x, wq, bq, wk, bk, pos, inv, layout=dst)
    assert float(jnp.abs(wrong - before).max()) > 1e-2 * float(jnp.abs(before).max())
    # The fused torch form [N*H, D] agrees with the jaxpe kernel form [D, N, H].
    fused = np.asarray(wq).reshape(d, n * h).T
    np.testing.assert_array_equal(
      layouts.convert_qk_proj_weight(fused, num_heads=n, head_dim=h, src=src, dst=dst, rotary_dim=rotary_dim),
      np.asarray(conv(wq)).reshape(d, n * h).T,
    )


def test_a_kernel_in_the_flax_orientation_is_refused():
  # A GQA k kernel in the Flax/JAX orientation [D, K*H] (D = 48, K = 2, H = 8): D is a multiple of K,
  # so without head_dim its D axis would be permuted as 2 "heads" of 24.
  rng = np.random.default_rng(0)
  torch_w = rng.normal(size=(2 * 8, 48)).astype(np.float32)
  with pytest.raises(
    ValueError, match=r"got shape \(48, 16\); it looks like a Flax/JAX \[D, N\*H\] kernel: pass w.T"
  ):
    layouts.convert_qk_proj_weight(torch_w.T, num_heads=2, head_dim=8, src="interleaved", dst="half")
  # Transposed, it is converted like the torch weight (the jaxpe [D, K, H] kernel route agrees).
  out = layouts.convert_qk_proj_weight(torch_w, num_heads=2, head_dim=8, src="interleaved", dst="half")
  kernel = torch_w.T.reshape(48, 2, 8)
  expected = layouts.convert_layout(kernel, src="interleaved", dst="half").reshape(48, 16).T
  np.testing.assert_array_equal(out, expected)
  np.testing.assert_array_equal(out, hf_permute(torch_w, 2))


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="src must be one of"):
    layouts.layout_permutation(8, src="neox", dst="half")
  with pytest.raises(ValueError, match="rotary_dim must be even"):
    layouts.layout_permutation(8, src="half", dst="interleaved", rotary_dim=5)
  with pytest.raises(ValueError, match="rotary_dim must be <= head_dim"):
    layouts.layout_permutation(8, src="half", dst="interleaved", rotary_dim=10)
  with pytest.raises(ValueError, match=r"num_heads \* head_dim = 4 \* 8, got shape \(30, 4\)$"):
    layouts.convert_qk_proj_weight(np.zeros((30, 4)), num_heads=4, head_dim=8, src="half", dst="interleaved")
  with pytest.raises(ValueError, match="w must have shape"):
    layouts.convert_qk_proj_weight(
      np.zeros((2, 8, 4)), num_heads=2, head_dim=4, src="half", dst="interleaved"
    )
  with pytest.raises(ValueError, match="head_dim must be a positive integer"):
    layouts.convert_qk_proj_weight(np.zeros((8, 4)), num_heads=2, head_dim=0, src="half", dst="interleaved")
  with pytest.raises(ValueError, match="axis"):
    layouts.convert_layout(np.zeros((2, 8)), src="half", dst="interleaved", axis=2)
  with pytest.raises(ValueError, match="rotary_dim must be even"):
    layouts.convert_layout(np.zeros((2, 7)), src="half", dst="interleaved")


# ---------------------------------------------------------------- the layout is required

# Arguments (all but the layout) of every public op that takes a layout.
_LAYOUT_CALLS = {
  "apply_rope": lambda **kw: jaxpe.ops.apply_rope(jnp.ones((1, 3, 2, 8)), jnp.arange(3), **kw),
  "apply_xpos": lambda **kw: jaxpe.ops.apply_xpos(jnp.ones((1, 3, 2, 8)), jnp.arange(3), kind="query", **kw),
}


def _public_ops_with_a_layout():
  return sorted(
    name
    for name in jaxpe.ops.__all__
    if inspect.isfunction(getattr(jaxpe.ops, name))
    and "layout" in _parameters(getattr(jaxpe.ops, name))
    and name != "rope_from_hf_config"
  )  # HFRope, a class, carries the layout read from an HF config; rope_from_hf_config reads it from
  # a verified family's tables and refuses an unverified family without layout= (hf_families_test)


def _parameters(fn):
  return inspect.signature(fn).parameters


def test_every_public_op_with_a_layout_is_walked():
  assert _public_ops_with_a_layout() == sorted(_LAYOUT_CALLS)
  for name in _LAYOUT_CALLS:  # keyword-only, no usable default
    parameter = _parameters(getattr(jaxpe.ops, name))["layout"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is layouts.REQUIRED


@pytest.mark.parametrize("name", sorted(_LAYOUT_CALLS))
def test_a_call_without_layout_is_a_type_error_naming_it_and_both_values(name):
  call = _LAYOUT_CALLS[name]
  pattern = rf"{name}\(\) missing required keyword argument 'layout'.*'half'.*'interleaved'"
  with pytest.raises(TypeError, match=pattern):
    call()
  with pytest.raises(TypeError, match=pattern):  # the same under jit (the check is at trace time)
    jax.jit(lambda: call())()
  # The message says why there is no default and where an HF model's layout comes from.
  with pytest.raises(TypeError) as info:
    call()
  assert "wrong attention" in str(info.value) and "rope_from_hf_config" in str(info.value)
  for layout in layouts.LAYOUTS:  # given, either layout runs
    assert call(layout=layout).shape == (1, 3, 2, 8)
  with pytest.raises(ValueError, match=re.escape("layout must be one of ('interleaved', 'half')")):
    call(layout="complex")


def test_the_layouts_rotate_different_pairs():
  """Why no default: the same weights under the other layout give other scores, and nothing fails."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 1, 8), np.float32))
  pos = jnp.arange(4)
  q = {layout: rope.apply_rope(x, pos, layout=layout) for layout in layouts.LAYOUTS}
  scores = {layout: jnp.einsum("BTNH,BSNH->BNTS", v, v) for layout, v in q.items()}
  assert bool(jnp.all(jnp.isfinite(scores["half"]))) and bool(jnp.all(jnp.isfinite(scores["interleaved"])))
  assert float(jnp.abs(scores["half"] - scores["interleaved"]).max()) > 0.1
