"""The ``xla`` backend: the dense reference attention (``jaxpe.attention.dot_product_attention``).

Takes a dense bias, any mask (an ``AttentionMask`` becomes its dense form) and the KV cache; ALiBi
of an ``AlibiSpec`` is added as its native bias. A causal ``AttentionMask`` longer than
``XLA_CAUSAL_BLOCK`` runs in query blocks that skip the keys after each block (``causal_block``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.attention import reference
from jaxpe.attention.backends import AlibiSpec
from jaxpe.attention.masks import AttentionMask
from jaxpe.ops import alibi

HEAD_DIM_MULTIPLE: dict[str, int] = {"xla": 1, "cudnn": 8, "splash": 128, "pallas_gpu": 0}
# Query block of the ``xla`` backend's causal self-attention (``dot_product_attention(causal_block=)``):
# each block of queries meets only the keys up to its end. Measured on CPU (B 8, T 512, N 8, H 64,
# forward + backward): 64 and 128 ran 1.7-2.1x the dense path, 32 slower (small matmuls).
XLA_CAUSAL_BLOCK = 128


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  scale: float,
  mask: AttentionMask | jax.Array | None,
  bias: jax.Array | None,
  alibi_spec: AlibiSpec | None,
  precise_dims: int,
) -> jax.Array:
  """``jaxpe.attention.attention`` on ``xla``, its arguments already checked: ``[B, T, N, H]``."""
  causal_block = None
  if isinstance(mask, AttentionMask):
    if mask.causal and q.shape[1] > XLA_CAUSAL_BLOCK:
      causal_block = XLA_CAUSAL_BLOCK  # self-attention: key slot t is query slot t
    mask = (
      mask.dense(q.shape[0], q.shape[1])
      if (mask.causal or mask.valid is not None or mask.segment_ids is not None)
      else None
    )
  if alibi_spec is not None:
    native = alibi.alibi_bias(
      jnp.asarray(alibi_spec.slopes, jnp.float32), alibi_spec.q_positions, alibi_spec.k_positions
    )
    bias = native if bias is None else bias + native
  # Looked up at call time so tests can wrap reference.dot_product_attention.
  return reference.dot_product_attention(
    q, k, v, scale=scale, bias=bias, mask=mask, precise_dims=precise_dims, causal_block=causal_block
  )
