"""``pos_encoding='cope'``: contextual position encoding (Golovneva et al. 2024, arXiv 2405.18719).

Each ``Attention`` layer holds ``cope_pos_emb [H, P]`` (P = ``cope_npos_max``, default ``max_len``;
zeros at init, as the paper's ``CoPE`` module) and adds ``jaxpe.ops.cope.cope_bias`` to its logits:
positions counted by sigmoid gates of the layer's own q.k over the keys its mask shows, so padding,
other packed documents and empty KV-cache slots count nothing. The bias depends on q.k: a dense
``[B, N, T, S]`` array per layer on the ``xla`` backend (no fused kernel takes it; no token
positions are used).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.attention import masks
from jaxpe.model.encodings.base import PositionalEncoding, register
from jaxpe.ops import cope


@register("cope")
class CoPE(PositionalEncoding):
  """CoPE's per-layer ``cope_pos_emb [H, P]`` (logical names ``head_dim, pos``) and its dense bias."""

  def npos_max(self) -> int:
    """P: ``cope_npos_max``, default ``max_len`` (a count never exceeds the context)."""
    return self.cfg.cope_npos_max or self.cfg.max_len

  def matmul_flops_per_token(self, seq_len: int) -> float:
    """``q @ pos_emb``: ``[H] @ [H, P]`` per head and query (P = ``npos_max``); the gates reuse the
    attention's q.k (not counted again)."""
    del seq_len
    return 2.0 * self.cfg.num_heads * self.cfg.head_size * self.npos_max()

  def layer_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Param]:
    del rngs
    table = jnp.zeros((self.cfg.head_size, self.npos_max()), jnp.float32)
    return {"cope_pos_emb": nnx.Param(table, out_sharding=("head_dim", "pos"))}

  def attention_bias(self, layer, q, k, mask, *, scale: float) -> jax.Array:
    dense = mask.dense(q.shape[0], q.shape[1]) if isinstance(mask, masks.AttentionMask) else mask.dense()
    return cope.cope_bias(q, k, layer.cope_pos_emb[...], scale=scale, mask=dense)
