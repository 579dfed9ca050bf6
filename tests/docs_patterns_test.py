"""The attention layers of README.md (Flax NNX) and docs/api.md (Flax Linen), as written there,
on padded and packed batches: each real token's output equals the output of its row without the
padding, and each packed document's equals the document run alone (a mask built from positions
instead lets real tokens attend padding and other documents: 3.1 max logit difference). And the
API refuses the mistake: ``dense_attention_mask`` / ``IndexMask`` on positions that repeat."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.attention import IndexMask

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)


def _documented(path: str, name: str):
  """The namespace of the python block of ``path`` that defines class ``name``: the block as
  written up to its first use (``layer = ...``; tests/docs_test.py runs the whole block)."""
  for body in FENCE.findall((ROOT / path).read_text()):
    if f"class {name}(" in body:
      body = body[: body.index("\nlayer = ")]
      namespace: dict = {}
      exec(compile(body, f"{path}:{name}", "exec"), namespace)  # noqa: S102
      return namespace
  raise AssertionError(f"{path} has no python block defining {name}")


@pytest.fixture(scope="module")
def nnx_layer():
  ns = _documented("README.md", "MyAttention")
  from flax import nnx

  layer = ns["MyAttention"](64, 4, rngs=nnx.Rngs(3))
  return nnx.jit(lambda x, positions, mask: layer(x, positions, mask))


@pytest.fixture(scope="module")
def linen_layer():
  ns = _documented("docs/api.md", "LinenAttention")
  layer = ns["LinenAttention"](num_heads=4, head_dim=16)
  x = jnp.ones((1, 4, 64))
  params = layer.init(jax.random.key(3), x, jnp.arange(4), jaxpe.AttentionMask())
  return jax.jit(lambda x, positions, mask: layer.apply(params, x, positions, mask))


@pytest.fixture(params=["nnx", "linen"])
def layer(request, nnx_layer, linen_layer):
  return nnx_layer if request.param == "nnx" else linen_layer


X = jax.random.normal(jax.random.key(7), (3, 12, 64))  # [B, T, D]; padding slots hold other values


def test_padded_rows_equal_their_unpadded_selves(layer):
  # row 0: 4 left-pad tokens, row 1: 3 right-pad tokens, row 2: none
  lengths, starts = np.asarray([8, 9, 12]), np.asarray([4, 0, 0])
  slot = np.arange(12)[None]
  valid = jnp.asarray((slot >= starts[:, None]) & (slot < (starts + lengths)[:, None]))
  out = layer(X, jaxpe.positions_from_mask(valid), jaxpe.AttentionMask(valid=valid))
  for row, (start, length) in enumerate(zip(starts, lengths)):
    real = slice(start, start + length)
    alone = layer(X[row : row + 1, real], jnp.arange(length)[None], jaxpe.AttentionMask())
    np.testing.assert_allclose(out[row, real], alone[0], atol=2e-5, err_msg=f"row {row}")


def test_packed_documents_equal_each_document_alone(layer):
  segment_ids = jnp.asarray([[0] * 5 + [1] * 4 + [2] * 3, [7] * 12, [1] * 6 + [0] * 6])
  out = layer(X, jaxpe.positions_from_segment_ids(segment_ids), jaxpe.AttentionMask(segment_ids=segment_ids))
  ids = np.asarray(segment_ids)
  for row in range(3):
    starts = [0, *np.flatnonzero(ids[row, 1:] != ids[row, :-1]) + 1, 12]
    for a, b in zip(starts[:-1], starts[1:]):
      alone = layer(X[row : row + 1, a:b], jnp.arange(b - a)[None], jaxpe.AttentionMask())
      np.testing.assert_allclose(out[row, a:b], alone[0], atol=2e-5, err_msg=f"row {row}, tokens {a}:{b}")


def test_masks_from_positions_are_refused_with_what_to_pass():
  valid = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
  segment_ids = jnp.asarray([[0, 0, 1, 1, 1], [3, 3, 3, 3, 3]])
  for positions in (jaxpe.positions_from_mask(valid), jaxpe.positions_from_segment_ids(segment_ids)):
    with pytest.raises(ValueError, match=r"not token positions.*AttentionMask\(valid=attention_mask"):
      jaxpe.dense_attention_mask(positions, positions)
    with pytest.raises(ValueError, match=r"q_index repeats slot 0 in row 0"):
      IndexMask(positions, positions).dense()
  # slots with the padding in k_valid: the AttentionMask's mask
  slots = jnp.broadcast_to(jnp.arange(5), (2, 5))
  np.testing.assert_array_equal(
    jaxpe.dense_attention_mask(slots, slots, k_valid=valid), jaxpe.AttentionMask(valid=valid).dense(2, 5)
  )
  # distinct slots in any order (a KV cache, context-parallel shards) still pass
  jaxpe.dense_attention_mask(jnp.asarray([[6, 7]]), jnp.asarray([[3, 1, 0, 2, 6, 7, 4, 5]]))
