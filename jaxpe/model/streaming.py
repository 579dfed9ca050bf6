"""StreamingLLM's KV cache: the first ``start_size`` tokens (attention sinks) and the last
``recent_size`` ones, positions assigned inside the cache (Xiao et al., "Efficient Streaming Language
Models with Attention Sinks", arXiv 2309.17453, section 3.2; reference code mit-han-lab/streaming-llm,
``StartRecentKVCache`` and its ``pos_shift`` attention).

A ``StreamingCache`` holds ``C = start_size + recent_size`` slots per layer, whatever the number of
tokens seen (memory O(C)). Token g (the g-th token fed, from 0) lies in slot g while ``g <
start_size`` (a sink, never evicted), else in the ring slot ``start_size + (g - start_size) mod
recent_size`` (overwriting the token ``recent_size`` before it). Keys are cached **before** RoPE:
after a chunk brings the count to n tokens, the kept tokens (the sinks, then the last
``min(recent_size, n - start_size)`` ones, in order) are rotated at positions ``0, 1, 2, ...`` of the
cache, contiguous, whatever their positions in the text; the queries of the chunk take their own
positions in that order (the last one ``min(n, C) - 1``). As the reference code, each step therefore
sees the positions a fresh forward over [sinks + recent window] would give; the keys and values of
layers after the first are those computed when their token was fed (its context then), as the paper's
cache (not its "sliding window with re-computation" baseline): a one-layer model equals the fresh
forward exactly, a deeper one equals it until the first eviction.

Restricted to what this is correct for (``check_streaming``): ``pos_encoding='rope'`` (any
``rope_scaling``, per-layer RoPE and NoPE layers, GQA, qk-norm, soft-caps and learned sinks), every
layer global (no ``sliding_window`` / ``attention_chunk_size`` layers), no attention temperature
tuning; rows without padding (each row's n tokens are real). A chunk of T > 1 tokens must fit before
any eviction (``end + T <= C``, ``end`` concrete): generation feeds a longer prompt's rest one token at
a time.

Shape alphabet: B batch, T new tokens, C cache slots, K kv heads, H head dim, L layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpe.model.config import ModelConfig
from jaxpe.ops import checks as _checks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamingCache:
  """Keys (before RoPE) and values of the sink tokens and the recent window (module docstring).

  Attributes:
    k: L arrays ``[B, K, C, H]`` ``cfg.dtype``, unrotated keys (after qk-norm), heads first.
    v: L arrays ``[B, K, C, H]`` ``cfg.dtype``.
    end: ``[]`` int32 number of tokens fed so far (may exceed C).
    start_size: static Python int >= 0, the sink tokens (streaming-llm's ``start_size``).
    recent_size: static Python int >= 1, the recent window (streaming-llm's ``recent_size``).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  end: jax.Array
  start_size: int = dataclasses.field(metadata=dict(static=True))
  recent_size: int = dataclasses.field(metadata=dict(static=True))


def check_streaming(cfg: ModelConfig, streaming) -> tuple[int, int]:
  """``streaming = (start_size, recent_size)`` checked against the model: Python ints, ``start_size
  >= 0``, ``recent_size >= 1``; a config this cache is correct for (module docstring).

  Raises:
    TypeError: not a pair of Python ints.
    ValueError: a size out of range; ``pos_encoding`` other than ``rope``; a sliding / chunked layer;
      ``attn_temperature_tuning``, each named.
  """
  if not (
    isinstance(streaming, tuple | list) and len(streaming) == 2 and all(map(_checks.is_int, streaming))
  ):
    raise TypeError(f"streaming must be (start_size, recent_size), two Python ints, got {streaming!r}")
  start, recent = (int(x) for x in streaming)
  if start < 0:
    raise ValueError(f"streaming start_size (sink tokens) must be >= 0, got {start}")
  if recent < 1:
    raise ValueError(f"streaming recent_size (window) must be >= 1, got {recent}")
  if start + recent > _checks.MAX_POSITION:
    raise ValueError(f"streaming start_size + recent_size must be <= 2^31 - 1, got {start + recent}")
  if cfg.pos_encoding != "rope":
    raise ValueError(
      "streaming (StreamingLLM sinks + window) re-rotates cached keys by their position in the cache: it "
      f"runs with pos_encoding='rope' only, got pos_encoding={cfg.pos_encoding!r}"
    )
  for i in range(cfg.num_layers):
    kind = cfg.layer_pattern(i).layer_type
    if kind != "full_attention":
      raise ValueError(
        f"streaming runs models whose every layer attends globally; layer {i} is {kind!r} "
        "(layer_types / sliding_window / attention_chunk_size)"
      )
  if cfg.attn_temperature_tuning:
    raise ValueError("streaming does not run attn_temperature_tuning (Llama 4's NoPE-layer temperature)")
  return start, recent


def init_streaming_cache(
  cfg: ModelConfig, batch_size: int, start_size: int, recent_size: int
) -> StreamingCache:
  """Empty ``StreamingCache``: ``L x [B, K, C, H]`` zeros, ``end = 0``.

  Raises:
    TypeError / ValueError: as ``check_streaming``; ``batch_size`` not a positive int.
  """
  if not isinstance(cfg, ModelConfig):
    raise TypeError(f"cfg must be a jaxpe.config.ModelConfig, got {type(cfg).__name__}")
  start, recent = check_streaming(cfg, (start_size, recent_size))
  batch_size = _checks.check_positive_int("batch_size", batch_size)
  shape = (batch_size, cfg.kv_heads, start + recent, cfg.head_size)
  zeros = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers))
  return StreamingCache(zeros, zeros, jnp.zeros((), jnp.int32), start, recent)


def check_chunk(cfg: ModelConfig, cache: StreamingCache, batch: int, t_len: int) -> None:
  """The cache matches the model and batch, and a chunk of ``t_len > 1`` tokens fits before any
  eviction (``end + T <= C`` with a concrete ``end``)."""
  ref = jax.eval_shape(lambda: init_streaming_cache(cfg, batch, cache.start_size, cache.recent_size))
  for name, want, got in [
    *((f"cache.k[{i}]", r, g) for i, (r, g) in enumerate(zip(ref.k, cache.k, strict=True))),
    *((f"cache.v[{i}]", r, g) for i, (r, g) in enumerate(zip(ref.v, cache.v, strict=True))),
    ("cache.end", ref.end, cache.end),
  ]:
    if tuple(jnp.shape(got)) != want.shape or jnp.result_type(got) != want.dtype:
      raise ValueError(
        f"{name} must be {want.dtype}{list(want.shape)} (init_streaming_cache of this model and batch), got "
        f"{jnp.result_type(got)}{list(jnp.shape(got))}"
      )
  if t_len == 1:
    return
  slots = cache.start_size + cache.recent_size
  if isinstance(cache.end, jax.core.Tracer) or int(cache.end) + t_len > slots:
    raise ValueError(
      f"a StreamingCache takes a chunk of T = {t_len} > 1 tokens only before any eviction (a concrete "
      f"cache.end with end + T <= start_size + recent_size = {slots}); feed the rest one token at a time"
    )


def cache_positions(end: jax.Array, t_len: int, start: int, recent: int):
  """Slot bookkeeping after a chunk of ``t_len`` tokens at ``end``: ``(write [T] slot of each new
  token, q_positions [T], kv_positions [C], filled [C] bool)``, int32 positions in the cache (module
  docstring); an empty slot j gets position ``C + j`` (after every query, distinct)."""
  slots = start + recent
  end = jnp.asarray(end, jnp.int32)
  n = end + t_len
  lo = jnp.maximum(start, n - recent)  # the first recent token kept
  g_new = end + jnp.arange(t_len, dtype=jnp.int32)
  write = jnp.where(g_new < start, g_new, start + jnp.mod(g_new - start, recent))
  q_pos = jnp.where(g_new < start, g_new, g_new - lo + start)
  j = jnp.arange(slots, dtype=jnp.int32)
  g = jnp.where(j < start, j, n - 1 - jnp.mod(n - 1 - j, recent))  # the token each slot holds
  filled = jnp.where(j < start, j < n, g >= start)
  kv_pos = jnp.where(j < start, j, g - lo + start)
  return write, q_pos, jnp.where(filled, kv_pos, slots + j), filled


def write(cache_kv: tuple[jax.Array, jax.Array], k: jax.Array, v: jax.Array, slot: jax.Array):
  """``cache_kv`` (``[B, K, C, .]``) with the chunk's ``k``, ``v`` ``[B, T, K, .]`` at slots
  ``slot [T]`` (distinct: ``check_chunk``)."""
  return tuple(c.at[:, :, slot].set(jnp.swapaxes(x, 1, 2).astype(c.dtype)) for c, x in zip(cache_kv, (k, v)))
