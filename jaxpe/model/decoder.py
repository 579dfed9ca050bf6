"""Flax NNX decoder-only transformer that composes the jaxpe ops: the ``Decoder`` and the layouts of
its stacked layers (``stack_blocks``, ``to_scan_layout``, ``to_loop_layout``).

Pre-LayerNorm blocks (LayerNorm -> causal multi-head attention -> residual, LayerNorm -> GELU MLP
-> residual), final LayerNorm, output head tied to the token embedding by default. The positional
encoding is chosen by ``ModelConfig.pos_encoding``: ``none``, ``learned`` (absolute table),
``sinusoidal``, ``rope`` (with ``rope_scaling`` and ``rotary_dim``), ``xpos``, ``alibi`` or
``rope_alibi`` (RoPE-emulated ALiBi), each a module of ``jaxpe.model.encodings`` that the decoder
and its layers (``jaxpe.model.layers``) ask once per concern. BLOOM-compatible options:
``use_bias``, ``embed_layernorm``, ``gelu_approximate`` (tanh GELU), ``layernorm_eps``.

Parameters carry logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``pos``); ``jaxpe.model.partitioning`` maps them onto mesh axes.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
D model dim, F MLP dim, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.attention import masks
from jaxpe.model import call_checks, encodings, initializers, llama_layers, partitioning, streaming
from jaxpe.model.cache import KVCache, check_cache, is_empty_cache, live_slots, next_positions_start
from jaxpe.model.config import ModelConfig
from jaxpe.model.layers import Block, dense, layer_norm
from jaxpe.ops import positions as positions_lib


class Decoder(nnx.Module):
  """Decoder-only language model.

  Call: ``model(tokens [B, T] int) -> logits [B, T, V] float32``; with ``cache=...`` returns
  ``(logits, new_cache)``.

  Source: GPT-style pre-LN decoder (Radford et al. 2019); BLOOM options follow HF
  ``modeling_bloom.py`` (arXiv 2211.05100).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    # Parameters are annotated with logical axis names but built unsharded (no mesh needed);
    # ``jaxpe.train.sharding.create_sharded`` places them on a mesh.
    with nnx.use_eager_sharding(False):
      self._build(cfg, rngs)
    if cfg.param_dtype != "float32":  # drawn in float32 (the same values, rounded), stored narrower
      params = nnx.state(self, nnx.Param)
      nnx.update(self, jax.tree.map(lambda x: x.astype(cfg.param_dtype), params))

  def _build(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    self.cfg = cfg
    enc = encodings.for_config(cfg)
    self.embed = nnx.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=cfg.dtype,
      embedding_init=initializers.normal(enc.token_embed_std(), ("vocab", "embed")),
      rngs=rngs,
    )
    for name, module in enc.params(rngs).items():  # learned: pos_embed
      setattr(self, name, module)
    if cfg.embed_layernorm:
      self.embed_norm = layer_norm(cfg, rngs)
    blocks = [Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)]
    self.blocks = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.final_norm = llama_layers.make_norm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.lm_head = dense(
        cfg,
        "BTD,DV->BTV",
        (cfg.d_model, cfg.vocab_size),
        (cfg.vocab_size,),
        ("embed", "vocab"),
        cfg.init_std,
        rngs,
      )

  def embed_inputs(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """Token embeddings plus the absolute position encoding, the input of the first block.

    The encoding's ``embed_inputs`` (``jaxpe.model.encodings``): ``sinusoidal`` follows Vaswani et
    al. (arXiv 1706.03762, section 3.4) and fairseq's ``TransformerEncoder``: token embeddings
    initialised with std ``D ** -0.5`` and multiplied by ``sqrt(D)`` (unit scale, like the
    sinusoids), so neither drowns the other; ``learned`` adds its table; the relative encodings add
    nothing here.

    Args:
      tokens: ``[B, T]`` int token ids in ``[0, V)``.
      positions: ``[B, T]`` int32 token indices.

    Returns:
      ``[B, T, D]`` float32 (the residual stream's dtype), after ``embed_layernorm`` if configured.

    Raises:
      ValueError: T or a concrete position beyond ``max_len`` for learned positions; concrete ids
        outside ``[0, V)`` are refused by ``__call__``. Under ``jax.jit`` a token id outside
        ``[0, V)`` (or a learned position outside ``[0, max_len)``) embeds as NaN, which makes the
        row's logits NaN (never another row of the table).
    """
    cfg = self.cfg
    # A traced id outside [0, V) embeds as NaN (jnp.take's fill mode), never as another token: negative
    # ids would otherwise wrap to V + id.
    x = self.embed(jnp.where(tokens < 0, cfg.vocab_size, tokens))
    if cfg.scale_embeddings:  # Gemma: times sqrt(D), rounded to the embedding's dtype as transformers
      x = x * jnp.asarray(cfg.d_model**0.5, x.dtype)
    x = encodings.for_config(cfg).embed_inputs(self, x, positions)
    if cfg.embed_layernorm:
      x = self.embed_norm(x)
    return x.astype(jnp.float32)  # residual stream in float32

  def __call__(
    self,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    slot_index: jax.Array | None = None,
    cache: KVCache | None = None,
    logits_index: jax.Array | None = None,
  ):
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` integer token ids in ``[0, V)``, B, T >= 1. Under ``jax.jit`` ids are not
        checked: an id outside ``[0, V)`` embeds as NaN, which makes that row's logits NaN.
      positions: ``[B, T]`` integer token indices in ``[0, 2^31)`` (``[0, max_len)`` for learned
        positions; checked when concrete). Default: from ``segment_ids`` (restart per document),
        else from ``attention_mask`` (count real tokens; continuing from the cache when one is
        given), else ``0..T-1`` (offset by the cache's filled slots).
      attention_mask: ``[B, T]`` bool or integer, 0 for padding tokens (any padding: left, right,
        inner). Padding keys are ignored; the logits at padding queries are meaningless.
      segment_ids: ``[B, T]`` integer document ids of packed sequences (no cache).
      slot_index: ``[B, T]`` integer slot of each token in its sequence before the tokens were
        reordered (no cache): the causal mask lets the token at slot t see the keys of slots <= t,
        whatever the order of the T tokens given. Default ``0..T-1`` (tokens in order). Context
        parallelism gives the tokens in the load-balanced zig-zag order with their original slots
        (``jaxpe.model.partitioning.zigzag_inputs``). Positions are not slots (packed documents
        restart them): with ``slot_index`` and a mask or segment ids, give ``positions`` too;
        without them the positions default to ``slot_index``.
      cache: a ``KVCache`` of this model's config (``init_cache(cfg, B, S)``) to append this chunk
        to (prefill or decode); it must have room for the T new tokens. Or a
        ``jaxpe.model.streaming.StreamingCache`` (StreamingLLM: sinks + recent window, positions
        inside the cache; no ``positions`` / ``attention_mask``; T > 1 only before any eviction).

      logits_index: optional ``[B]`` integer token index in ``[0, T)`` per row: only that token's
        logits are computed (``[B, 1, V]``; the prefill of generation needs one row, and the
        ``D x V`` head is most of a short forward's work). Under ``jax.jit`` an index outside
        ``[0, T)`` is clamped.

    Returns:
      ``[B, T, V]`` float32 logits (``[B, 1, V]`` with ``logits_index``), or ``(logits,
      new_cache)`` when ``cache`` is given.

    Raises:
      TypeError: non-integer tokens, positions, segment ids or ``logits_index``; a float mask; a cache that is no
        ``KVCache`` or holds arrays of the wrong dtype.
      ValueError: ``logits_index`` not ``[B]`` or (concrete) outside ``[0, T)``; an argument not ``[B, T]`` (tokens; positions, mask, segment ids, slot index of the
        tokens' shape); B or T = 0; ``slot_index`` with a cache, or with a mask or segment ids but no
        positions; ``slot_index`` or a sequence split over a mesh (context parallelism) on a backend other
        than ``xla``; T not divisible by the devices the sequence is split over; ids or positions out of range
        (when concrete); T beyond ``max_len`` for learned positions; T (or the cache's slots) beyond
        ``rope_alibi_context`` for ``rope_alibi``; segment ids together with a cache; a cache of another
        config, batch or layer count; a cache without room for T more tokens: checked at trace time from the
        static shapes (T > S) and, when ``cache.end`` is concrete, from it. Under ``jax.jit`` / ``nnx.jit`` a
        traced ``cache.end + T > S`` cannot raise at trace time: the call then fails when it runs (a
        ``JaxRuntimeError`` carrying this ValueError's message, from a host callback run only on overflow),
        never silently.
    """
    cfg = self.cfg
    tokens, positions, attention_mask, segment_ids, slot_index = call_checks.check_call(
      cfg, tokens, positions, attention_mask, segment_ids, slot_index, cache
    )
    batch, t_len = tokens.shape
    if isinstance(cache, streaming.StreamingCache):
      given = {"positions": positions, "attention_mask": attention_mask}
      for name, value in given.items():
        if value is not None:
          raise ValueError(
            f"{name} cannot be combined with a StreamingCache (positions are assigned inside the cache; "
            "rows hold no padding)"
          )
      return self._stream_call(tokens, cache, logits_index)
    if cache is not None:
      check_cache(cfg, cache, batch, t_len)
    encodings.for_config(cfg).check_call(
      t_len if cache is None else cache.positions.shape[1], positions, cache
    )
    valid = jnp.ones((batch, t_len), bool) if attention_mask is None else attention_mask.astype(bool)
    if positions is None:
      if slot_index is not None:
        positions = slot_index
      elif segment_ids is not None:
        positions = positions_lib.positions_from_segment_ids(segment_ids)
      elif cache is not None:  # continue after the real tokens already cached
        prior = next_positions_start(cache, valid)  # no int32 wrap past 2^31 - 1: an error
        positions = positions_lib.positions_from_mask(valid, start=prior)
      elif attention_mask is not None:
        positions = positions_lib.positions_from_mask(attention_mask)
      else:
        positions = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
    positions = positions.astype(jnp.int32)

    x = self.embed_inputs(tokens, positions)

    if cache is None and slot_index is None and partitioning.sequence_split() is None:
      mask = masks.AttentionMask(
        valid=None if attention_mask is None else valid, segment_ids=segment_ids, causal=True
      )
      kv_positions, layer_caches = positions, None
    elif cache is None:  # tokens out of slot order, or split over devices: masked by their slots
      slots = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
      slots = slots if slot_index is None else slot_index.astype(jnp.int32)
      k_valid = None if attention_mask is None else valid
      # chunked layers count chunks in the tokens' positions (from each row's first real token)
      mask = masks.IndexMask(slots, slots, True, k_valid, segment_ids, segment_ids, positions, positions)
      kv_positions, layer_caches = positions, None
    else:
      slots = cache.positions.shape[1]
      k_positions = jax.lax.dynamic_update_slice_in_dim(cache.positions, positions, cache.end, axis=1)
      # slots from end on are dead (a cache rolled back by moving end): cleared in the cache returned
      k_valid = jax.lax.dynamic_update_slice_in_dim(live_slots(cache), valid, cache.end, axis=1)
      layer_caches = (cache.k, cache.v)
      if is_empty_cache(cache) and partitioning.sequence_split() is None:
        # prefill of an empty cache: the tokens see only each other, self-attention on the
        # configured backend (the CPU kernel, a fused kernel); their keys are written to slots 0..T-1
        mask = masks.AttentionMask(valid=None if attention_mask is None else valid, causal=True)
        kv_positions = positions
      else:  # the new tokens against every slot: few queries run in one pass over the cache on xla
        q_index = cache.end + jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
        k_index = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
        mask = masks.IndexMask(
          q_index, k_index, causal=True, k_valid=k_valid, q_positions=positions, k_positions=k_positions
        )
        kv_positions = k_positions

    q_slots = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
    q_slots = q_slots + cache.end if cache is not None else q_slots if slot_index is None else slot_index
    x, new_kv = self._blocks(
      x,
      positions,
      mask,
      kv_positions,
      layer_caches,
      cache_end=None if cache is None else cache.end,
      q_slots=q_slots,
    )
    logits = self._logits(x, logits_index)
    if cache is None:
      return logits
    new_cache = KVCache(
      k=new_kv[0],
      v=new_kv[1],
      positions=k_positions,
      valid=k_valid,
      end=cache.end + t_len,
    )
    return logits, new_cache

  def _logits(self, x, logits_index):
    """``[B, T, V]`` float32 logits of the last block's output ``x [B, T, D]`` (``[B, 1, V]`` at
    ``logits_index [B]``)."""
    cfg = self.cfg
    if logits_index is not None:
      index = call_checks.check_logits_index(logits_index, x.shape[0], x.shape[1])
      x = jnp.take_along_axis(x, index[:, None, None], axis=1)
    x = self.final_norm(x)
    if cfg.tie_embeddings:
      logits = jnp.einsum("BTD,VD->BTV", x, self.embed.embedding[...].astype(jnp.float32))
    else:
      logits = self.lm_head(x.astype(cfg.dtype)).astype(jnp.float32)
    return llama_layers.soft_cap(logits, cfg.final_logit_softcapping)  # Gemma 2

  def _stream_call(self, tokens, cache, logits_index):
    """``Decoder.__call__`` on a ``StreamingCache`` (``jaxpe.model.streaming``): ``(logits, new
    cache)``, every position the token's position inside the cache."""
    batch, t_len = tokens.shape
    streaming.check_chunk(self.cfg, cache, batch, t_len)
    write, q_pos, kv_pos, filled = streaming.cache_positions(
      cache.end, t_len, cache.start_size, cache.recent_size
    )
    positions = jnp.broadcast_to(q_pos, (batch, t_len))
    kv_positions = jnp.broadcast_to(kv_pos, (batch, kv_pos.shape[0]))
    mask = masks.IndexMask(positions, kv_positions, True, jnp.broadcast_to(filled, kv_positions.shape))
    x = self.embed_inputs(tokens, positions)
    x, (new_k, new_v) = self._blocks(
      x, positions, mask, kv_positions, (cache.k, cache.v), cache_end=write, q_slots=positions, stream=True
    )
    new_cache = dataclasses.replace(cache, k=new_k, v=new_v, end=cache.end + t_len)
    return self._logits(x, logits_index), new_cache

  def _blocks(self, x, positions, mask, kv_positions, layer_caches, *, cache_end, q_slots, stream=False):
    """The L blocks on the residual stream ``x [B, T, D]`` float32, pinned to the ``(batch,
    length, embed)`` sharding at every block boundary (``jaxpe.model.partitioning.constrain``).

    ``layer_caches``: None, or ``(k, v)`` tuples of L cache arrays. Returns ``(x, None or (k, v))``
    with the updated caches. ``scan_layers`` runs one block under ``nnx.scan`` over the stacked
    parameters (caches stacked to ``[L, ...]`` for it and split back); ``remat`` wraps each block
    in ``nnx.remat`` with the configured policy. A per-layer RoPE schedule (``cfg.rope_layers()``)
    reaches each block as its flag: a Python bool in the loop, scanned data under ``scan_layers``.
    """
    cfg = self.cfg
    flags = cfg.rope_layers()  # per-layer RoPE schedule (NoPE layers), or None
    shared = encodings.for_config(cfg).shared_bias_params(self)  # T5: the one bias table of all layers

    def run(block, x, kv, use_rope):
      x, new_kv = block(
        x,
        positions,
        mask,
        kv_positions=kv_positions,
        cache_kv=kv,
        cache_end=cache_end,
        use_rope=use_rope,
        shared_bias=shared,
        q_slots=q_slots,
        stream=stream,
      )
      return partitioning.constrain(x, partitioning.ACTIVATION), new_kv

    if cfg.remat != "none":
      policy = jax.checkpoint_policies.dots_saveable if cfg.remat == "dots_saveable" else None
      run = nnx.remat(run, policy=policy, prevent_cse=not cfg.scan_layers)
    x = partitioning.constrain(x, partitioning.ACTIVATION)
    if cfg.scan_layers:
      stacked = None if layer_caches is None else tuple(jnp.stack(c) for c in layer_caches)
      scan = nnx.scan(
        run,
        in_axes=(0, nnx.Carry, 0, 0),
        out_axes=(nnx.Carry, 0),
        transform_metadata={nnx.PARTITION_NAME: "layers"},
      )
      x, new_kv = scan(self.blocks, x, stacked, None if flags is None else jnp.asarray(flags))
      if new_kv is None:
        return x, None
      return x, tuple(tuple(c[i] for i in range(cfg.num_layers)) for c in new_kv)
    new_k, new_v = [], []
    for i, block in enumerate(self.blocks):
      kv = None if layer_caches is None else (layer_caches[0][i], layer_caches[1][i])
      x, kv = run(block, x, kv, None if flags is None else flags[i])
      if kv is not None:
        new_k.append(kv[0])
        new_v.append(kv[1])
    return x, None if layer_caches is None else (tuple(new_k), tuple(new_v))


def stack_blocks(blocks: list[Block]) -> Block:
  """One ``Block`` whose parameters are those of ``blocks`` stacked on a new leading ``layers``
  axis (``[L, ...]``; logical name ``layers`` prepended), for ``nnx.scan``.

  Built from the same per-layer modules as the loop, so a ``scan_layers`` model starts with the
  same parameters as the loop model of the same config and seed.
  """
  graphdef, first = nnx.split(blocks[0])
  states = [first, *(nnx.split(b)[1] for b in blocks[1:])]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  stacked = nnx.spmd.add_axis(stacked, 0, {nnx.PARTITION_NAME: "layers"})
  return nnx.merge(graphdef, stacked)


def _is_layer_dict(key, value) -> bool:
  return (
    key == "blocks" and isinstance(value, dict) and bool(value) and all(isinstance(i, int) for i in value)
  )


def to_scan_layout(tree: Any) -> Any:
  """Converts the pure-dict state (``nnx.State.to_pure_dict()``) of a loop model - or of anything
  holding it, such as ``(model, optimizer)`` with its Adam moments - to ``scan_layers`` layout:
  every ``blocks`` dict ``{0: layer, 1: layer, ...}`` becomes one layer tree of ``[L, ...]`` arrays.
  Other leaves are returned as they are.
  """
  if not isinstance(tree, dict):
    return tree
  out = {}
  for key, value in tree.items():
    if _is_layer_dict(key, value):
      out[key] = jax.tree.map(lambda *xs: jnp.stack(xs), *(value[i] for i in sorted(value)))
    else:
      out[key] = to_scan_layout(value)
  return out


def to_loop_layout(tree: Any) -> Any:
  """The inverse of ``to_scan_layout``: every ``blocks`` tree of ``[L, ...]`` arrays becomes
  ``{0: layer, ..., L-1: layer}``.

  Raises:
    ValueError: a ``blocks`` tree whose arrays disagree on L.
  """
  if not isinstance(tree, dict):
    return tree
  out = {}
  for key, value in tree.items():
    if key == "blocks" and isinstance(value, dict) and not _is_layer_dict(key, value):
      sizes = {x.shape[0] for x in jax.tree.leaves(value)}
      if len(sizes) != 1:
        raise ValueError(f"stacked blocks disagree on the number of layers: {sorted(sizes)}")
      out[key] = {i: jax.tree.map(lambda x, i=i: x[i], value) for i in range(sizes.pop())}
    else:
      out[key] = to_loop_layout(value)
  return out
