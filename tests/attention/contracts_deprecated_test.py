"""The old names of the attention surface keep working for one release, with a DeprecationWarning.

- ``make_attention_mask`` (Flax linen's name, other arguments) -> ``dense_attention_mask``.
- the backend keyword ``impl=`` -> ``implementation=`` (``jax.nn.dot_product_attention``'s name).

Each gives the same result as the new name; the new names do not warn. The old module path
``jaxpe.emulation.emulated_alibi_attention`` is gone (issue 38).
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.attention import backends, emulated, kernels, masks
from jaxpe.attention.masks import AttentionMask

B, T, N, K, H = 2, 8, 2, 1, 8
POS = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
SLOPES = np.array([0.5, 0.25])


def _rand(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


Q, KK, V = _rand(0, B, T, N, H), _rand(1, B, T, K, H), _rand(2, B, T, K, H)


def _attention(**kw):
  return kernels.attention(Q, KK, V, scale=0.5, mask=AttentionMask(causal=True), **kw)


def _emul_attn(**kw):
  return emulated.emulated_alibi_attention(Q, KK, V, POS, POS, slopes=SLOPES, theta=0.01, **kw)


def test_make_attention_mask_is_a_deprecated_alias_of_dense_attention_mask():
  valid = jnp.asarray(np.arange(8)[None] >= np.array([[0], [2]]))
  want = masks.dense_attention_mask(POS, POS, k_valid=valid)
  for make in (jaxpe.make_attention_mask, masks.make_attention_mask):
    with pytest.warns(DeprecationWarning, match="use jaxpe.dense_attention_mask"):
      got = make(POS, POS, k_valid=valid)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      with pytest.raises(TypeError, match="q_index must be an integer array"):
        make(POS.astype(jnp.float32), POS)
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # the new name and AttentionMask.dense do not warn
    masks.dense_attention_mask(POS, POS)
    AttentionMask(causal=True).dense(B, 8)


@pytest.mark.parametrize("call", [_attention, _emul_attn], ids=["attention", "emulated_alibi_attention"])
def test_impl_keyword_is_a_deprecated_spelling_of_implementation(call):
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    want = call(implementation="xla")
  with pytest.warns(
    DeprecationWarning, match=r"\(impl=\.\.\.\) is deprecated: the keyword is implementation="
  ):
    got = call(impl="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(TypeError, match="deprecated spelling impl="):
    call(impl="xla", implementation="xla")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with pytest.raises(ValueError, match="attention implementation must be one of"):
      call(impl="triton")


def test_backend_helpers_take_implementation_and_the_old_keyword():
  assert backends.resolve_backend("auto") == backends.resolve_backend(implementation="auto") == "xla"
  with pytest.warns(DeprecationWarning):
    assert backends.padded_head_dim(impl="splash", dim=130) == backends.padded_head_dim("splash", 130) == 256
  with pytest.warns(DeprecationWarning):
    assert (
      backends.kernel_length(impl="pallas_gpu", length=20) == backends.kernel_length("pallas_gpu", 20) == 32
    )
  with pytest.warns(DeprecationWarning):
    got = backends.emulation_dim_count(impl="cudnn", alibi_form="exact", max_position=65536)
  assert got == backends.emulation_dim_count("cudnn", alibi_form="exact", max_position=65536) == 18


def test_emulated_alibi_attention_old_path_is_removed():
  # jaxpe.emulation.emulated_alibi_attention (the old flat module's name) was removed with the other
  # old paths (issue 38; docs/architecture.md's changelog): one name, in jaxpe.attention.
  assert emulated.emulated_alibi_attention is jaxpe.emulated_alibi_attention
  with pytest.raises(AttributeError, match="has no attribute 'emulated_alibi_attention'"):
    jaxpe.emulation.emulated_alibi_attention  # noqa: B018
  with pytest.raises(ImportError, match="cannot import name 'emulated_alibi_attention'"):
    from jaxpe.emulation import emulated_alibi_attention  # noqa: F401
