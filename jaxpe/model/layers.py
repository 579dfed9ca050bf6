"""The decoder's layers: LayerNorm, the attention layer, the MLP and the pre-LayerNorm block.

The attention layer asks the configured positional encoding (``jaxpe.model.encodings``) for the
q/k projection width, the q/k transform and the ALiBi bias, and runs on the configured backend
(``jaxpe.attention.kernels``). Parameters carry logical axis names (``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
D model dim, F MLP dim, L layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.attention import context, decode, kernels, masks
from jaxpe.model import encodings, llama_layers, moe, partitioning, pattern_options, ring_cache, streaming
from jaxpe.model.config import ModelConfig
from jaxpe.model.primitives import LayerNorm, dense, gelu, layer_norm  # noqa: F401 (re-exported)


class Attention(nnx.Module):
  """Causal multi-head (or grouped-query) self-attention with the configured position encoding.

  With ``cfg.attention_sinks`` it holds ``sinks [N]`` float32 (logical name ``heads``; gpt-oss's
  learned sink logits, Normal(0, ``init_std``) as HF's ``GptOssPreTrainedModel._init_weights``),
  passed to the backend (``jaxpe.attention.sinks``); the encoding's per-layer parameters
  (``layer_params``, CoPE's ``cope_pos_emb``) are attributes too. Layer ``layer``'s pattern
  (``cfg.layer_pattern``: window, chunk, soft-cap) and RoPE (``pattern_options.rope_config``) apply;
  with ``cfg.qk_norm`` it holds ``q_norm`` / ``k_norm`` (``[H]``, the ``norm_type``); ``cfg.use_qk_norm``
  (Llama 4) normalises q and k of RoPE layers after RoPE, without weights.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
    self.cfg = cfg
    self.pattern = cfg.layer_pattern(layer)
    self.rope_cfg = pattern_options.rope_config(cfg, layer)
    d, n, kv, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size
    enc = encodings.for_config(cfg)
    hq = h + enc.qk_extra_dims()  # q/k dims per head
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    b = cfg.attention_bias  # gpt-oss, Qwen3 / Gemma with attention_bias: q, k, v, o biases
    q_names, kv_names = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
    self.q = dense(cfg, "BTD,DNH->BTNH", (d, n, hq), (n, hq), q_names, cfg.init_std, rngs, bias=b)
    self.k = dense(cfg, "BSD,DKH->BSKH", (d, kv, hq), (kv, hq), kv_names, cfg.init_std, rngs, bias=b)
    enc.init_qk(self.q, self.k)
    self.v = dense(cfg, "BSD,DKH->BSKH", (d, kv, h), (kv, h), kv_names, cfg.init_std, rngs, bias=b)
    o_names = ("heads", "head_dim", "embed")
    self.o = dense(cfg, "BTNH,NHD->BTD", (n, h, d), (d,), o_names, out_std, rngs, bias=b)
    for name, param in enc.layer_params(rngs).items():  # cope, kerple, fire: per-layer parameters
      setattr(self, name, param)
    if cfg.attention_sinks:  # gpt-oss: one learned logit per head, Normal(0, init_std)
      sinks = nnx.initializers.normal(cfg.init_std)(rngs.params(), (n,), jnp.float32)
      self.sinks = nnx.Param(sinks, out_sharding=("heads",))
    if cfg.qk_norm:  # Qwen3 / Gemma 3: over H, shared by the heads
      self.q_norm = llama_layers.make_norm(cfg, rngs, h, ("head_dim",))
      self.k_norm = llama_layers.make_norm(cfg, rngs, h, ("head_dim",))

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    mask: masks.AttentionMask | masks.IndexMask,
    *,
    kv_positions: jax.Array,
    cache_kv: tuple[jax.Array, jax.Array] | None = None,
    cache_end: jax.Array | None = None,
    use_rope: bool | jax.Array | None = None,
    shared_bias=None,
    q_slots: jax.Array | None = None,
    stream: bool = False,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """x ``[B, T, D]`` -> ``([B, T, D], updated (k, v) cache or None)``.

    ``mask`` (an ``AttentionMask`` without a cache or for the prefill of an empty one; an
    ``IndexMask`` of the slots otherwise: of the cache, of the tokens when they are reordered or
    split over devices) and ``kv_positions`` ``[B, S]`` describe the keys: the T new tokens under an
    ``AttentionMask`` (the cache, if any, gets their keys at ``cache_end``), all S cache slots under
    a cache's ``IndexMask``. Runs on ``cfg.attn_implementation`` (``jaxpe.attention.kernels``) under
    an ``AttentionMask``; under an ``IndexMask`` on ``xla`` (few queries over a cache in one pass,
    ``jaxpe.attention.decode``); with the sequence split over mesh axes
    (``partitioning.sequence_split``) across them (``jaxpe.attention.context``, strategy
    ``cfg.context_attention``). ``use_rope``: this layer's flag of a per-layer RoPE schedule
    (``cfg.rope_layers()``; false = NoPE layer, ``encode_qk_nope``), None without one.
    ``shared_bias``: the encoding's ``shared_bias_params`` (T5's table). ``q_slots`` ``[B, T]``: the
    queries' sequence slots (Llama 4's temperature, ``attn_temperature_tuning``). A ring layer's
    cache (fewer slots than ``kv_positions``) runs as ``jaxpe.model.ring_cache`` says. ``stream``:
    ``cache_kv`` is a ``StreamingCache``'s (unrotated keys), ``cache_end`` the ``[T]`` slots the chunk
    is written to, ``positions`` / ``kv_positions`` / ``mask`` those inside the cache
    (``jaxpe.model.streaming``).
    """
    q, k, v = self.q(x), self.k(x), self.v(x)  # [B,T,N,H], [B,T,K,H], [B,T,K,H]
    if self.cfg.qk_norm:
      q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
    enc = encodings.for_config(self.rope_cfg)  # this layer's RoPE (Gemma 3: local base)
    if stream:  # StreamingLLM: keys cached unrotated, all rotated by their slot's position in the cache
      return self._stream_attend(enc, q, k, v, positions, mask, kv_positions, cache_kv, cache_end, use_rope)
    rope_spec = None
    if (
      self.cfg.attn_implementation == "flash"
      and cache_kv is None
      and isinstance(mask, masks.AttentionMask)
      and (use_rope is None or (isinstance(use_rope, bool) and use_rope))
      and not self.cfg.use_qk_norm  # Llama 4 normalises the rotated q, k
    ):  # flash rotates q/k blocks inside its kernel (rope, xpos): q and k stay unrotated here
      rope_spec = enc.rope_spec(positions, kv_positions)
    if rope_spec is None:
      q, k = enc.encode_layer_qk(q, k, positions, use_rope)
    new_kv = None
    cfg = self.cfg
    if cfg.use_qk_norm:  # Llama 4: after RoPE, on RoPE layers
      q, k = llama_layers.weightless_qk_norm(q, k, use_rope, cfg.layernorm_eps)
    if cfg.attn_temperature_tuning and use_rope is not None:  # Llama 4: NoPE layers only
      t = llama_layers.temperature_scale(q_slots, cfg.floor_scale, cfg.attn_scale)
      q = (q * jnp.where(jnp.asarray(use_rope), 1.0, t)).astype(q.dtype)
    scale, sinks, pattern = self._options()
    if cache_kv is not None and cache_kv[0].shape[2] == self.pattern.ring_slots:  # a ring layer
      new_kv = tuple(ring_cache.ring_write(c, n, cache_end) for c, n in zip(cache_kv, (k, v)))
      if not isinstance(mask, masks.AttentionMask):  # the chunk against the ring's slots and itself
        k, v, mask, kv_positions = ring_cache.ring_keys(cache_kv, k, v, mask, kv_positions, cache_end)
      cache_kv = None
    if cache_kv is not None:  # the cache lies heads first: [B, K, S, H] (jaxpe.model.cache)
      k_cache, v_cache = cache_kv
      k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
      new_kv = (
        jax.lax.dynamic_update_slice_in_dim(k_cache, jnp.swapaxes(k, 1, 2), cache_end, axis=2),
        jax.lax.dynamic_update_slice_in_dim(v_cache, jnp.swapaxes(v, 1, 2), cache_end, axis=2),
      )
      if not isinstance(mask, masks.AttentionMask):  # attend over every slot (an empty cache's
        # prefill, under an AttentionMask, attends to its own keys alone)
        position_bias = enc.position_bias(self, shared_bias, positions, kv_positions)
        if q.shape[1] <= decode.DECODE_MAX_QUERIES and partitioning.sequence_split() is None:
          # decoding: two batched matmuls over the cache as it lies, in place (no copy of it)
          k_sk = jnp.swapaxes(new_kv[0], 1, 2)  # only a dense bias (cope) reads it; else dropped
          out = decode.decode_attention(
            q,
            *new_kv,
            scale=scale,
            mask=mask,
            bias=enc.attention_bias(self, q, k_sk, mask, scale=scale),
            alibi=enc.alibi_spec(positions, kv_positions),
            position_bias=position_bias,
            precise_dims=q.shape[-1] - cfg.head_size,
            sinks=sinks,
            heads_first=True,
            **pattern,
          )
          return self.o(out), new_kv
        k, v = (jnp.swapaxes(c, 1, 2) for c in new_kv)  # a long chunk: blockwise over [B, S, K, H]
    bias = enc.attention_bias(self, q, k, mask, scale=scale)  # cope: a dense [B, N, T, S] bias
    split = partitioning.sequence_split()
    position_bias = enc.position_bias(self, shared_bias, positions, kv_positions)
    if cache_kv is None and isinstance(mask, masks.IndexMask) and split is not None:
      if sinks is not None or bias is not None:
        raise ValueError(
          "context parallelism (a sequence split over mesh axes) runs without attention sinks and "
          f"dense biases; got attention_sinks={cfg.attention_sinks}, pos_encoding={cfg.pos_encoding!r}"
        )
      out = context.context_attention(
        q,
        k,
        v,
        scale=scale,
        mesh=split[0],
        axes=split[1],
        strategy=cfg.context_attention,
        mask=mask,
        alibi=enc.alibi_spec(positions, kv_positions),
        position_bias=position_bias,
        precise_dims=q.shape[-1] - cfg.head_size,
        **pattern,
      )
      return self.o(out), None
    fused = isinstance(mask, masks.AttentionMask)  # without a cache, or an empty cache's prefill
    implementation = cfg.attn_implementation if fused else "xla"

    def attend(q, k, v, positions, kv_positions, valid, segment_ids, bias, sinks):
      local_mask = (
        mask if not fused else masks.AttentionMask(valid=valid, segment_ids=segment_ids, causal=mask.causal)
      )
      return kernels.attention(
        q,
        k,
        v,
        scale=scale,
        mask=local_mask,
        bias=bias,
        sinks=sinks,
        alibi_spec=enc.alibi_spec(positions, kv_positions),
        precise_dims=q.shape[-1] - cfg.head_size,  # the rope_alibi emulation dims (float32)
        implementation=implementation,
        interpret=cfg.attention_interpret,
        position_bias=position_bias,
        rope_spec=None if rope_spec is None else enc.rope_spec(positions, kv_positions),
        **pattern,
      )

    rows = (q, k, v, positions, kv_positions)
    rows += (mask.valid, mask.segment_ids) if fused else (None, None)
    if fused and implementation != "xla" and position_bias is None:
      # a fused kernel on a mesh runs on each device's batch rows (XLA cannot partition a Mosaic
      # kernel, nor cuDNN's on an abstract mesh); the heads are gathered to each device
      out = partitioning.batch_local(attend, (*rows, bias), (sinks,))
    else:
      out = attend(*rows, bias, sinks)
    return self.o(out), new_kv

  def _options(self):
    """``(scale, sinks, pattern)``: the score scale, the learned sink logits (or None) and the
    layer's window / chunk / soft-cap as ``jaxpe.attention.attention``'s keywords."""
    cfg = self.cfg
    scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else 1.0 / math.sqrt(cfg.head_size)
    sinks = self.sinks[...] if cfg.attention_sinks else None
    names = ("local_window_size", "chunk_size", "logits_soft_cap")
    pattern = {k: v for k, v in zip(names, self.pattern[1:3] + self.pattern[4:]) if v is not None}
    return scale, sinks, pattern

  def _stream_attend(self, enc, q, k, v, positions, mask, kv_positions, cache_kv, slots, use_rope):
    """The chunk's q / unrotated k, v against a ``StreamingCache`` layer (``[B, K, C, H]``): writes
    k, v to ``slots``, rotates q at ``positions`` and every cached key at ``kv_positions``."""
    new_kv = streaming.write(cache_kv, k, v, slots)
    k_all, v_all = (jnp.swapaxes(c, 1, 2) for c in new_kv)  # [B, C, K, H]
    q, _ = enc.encode_layer_qk(q, q, positions, use_rope)
    _, k_all = enc.encode_layer_qk(k_all, k_all, kv_positions, use_rope)
    if self.cfg.use_qk_norm:  # Llama 4: after RoPE, on RoPE layers
      q, k_all = llama_layers.weightless_qk_norm(q, k_all, use_rope, self.cfg.layernorm_eps)
    scale, sinks, pattern = self._options()
    out = kernels.attention(
      q, k_all, v_all, scale=scale, mask=mask, sinks=sinks, implementation="xla", **pattern
    )  # fmt: skip
    return self.o(out), new_kv


class MLP(nnx.Module):
  """``D -> F -> GELU -> D`` (biases with ``use_bias`` or ``mlp_bias``)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    d, f, b = cfg.d_model, cfg.mlp_size, cfg.mlp_bias
    self.up = dense(cfg, "BTD,DF->BTF", (d, f), (f,), ("embed", "mlp"), cfg.init_std, rngs, bias=b)
    self.down = dense(cfg, "BTF,FD->BTD", (f, d), (d,), ("mlp", "embed"), out_std, rngs, bias=b)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.up(x)
    # GELU on the [B*T, F] view (the same values): XLA CPU ran GELU's erfc and its gradient on the
    # [B, T, F] array about 2x slower, which doubled the MLP's forward + backward (B 8, T 512,
    # D 512: 1151 -> 593 ms per layer; benchmarks/train_bench.py's "step part: mlp").
    flat = h.reshape(-1, h.shape[-1])
    flat = jax.nn.gelu(flat, approximate=True) if self.cfg.gelu_approximate else gelu(flat)
    return self.down(flat.reshape(h.shape))


class Block(nnx.Module):
  """Pre-norm transformer block (``norm_type``; ``sandwich_norm``: Gemma 2/3's norms after attention
  and MLP too, ``post_attn_norm`` / ``post_mlp_norm``), layer ``layer`` of the model."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
    self.cfg = cfg
    self.attn_norm = llama_layers.make_norm(cfg, rngs)
    self.attn = Attention(cfg, rngs=rngs, layer=layer)
    self.mlp_norm = llama_layers.make_norm(cfg, rngs)
    if cfg.mlp_type == "moe":
      self.mlp = moe.MoEMLP(cfg, rngs=rngs)
    else:
      self.mlp = llama_layers.GatedMLP(cfg, rngs=rngs) if cfg.mlp_type == "gated" else MLP(cfg, rngs=rngs)
    if cfg.sandwich_norm:
      self.post_attn_norm = llama_layers.make_norm(cfg, rngs)
      self.post_mlp_norm = llama_layers.make_norm(cfg, rngs)

  def __call__(self, x, positions, mask, **attn_kwargs):
    h, new_kv = self.attn(self.attn_norm(x).astype(self.cfg.dtype), positions, mask, **attn_kwargs)
    h = self.post_attn_norm(h) if self.cfg.sandwich_norm else h
    x = x + h.astype(jnp.float32)
    h = self.mlp(self.mlp_norm(x).astype(self.cfg.dtype))
    h = self.post_mlp_norm(h) if self.cfg.sandwich_norm else h
    x = x + h.astype(jnp.float32)
    return x, new_kv
