"""The KV cache of decoding: keys and values of earlier tokens, one chunk appended per call.

Shape alphabet: B batch, S cache slots, K kv heads, H head dim, L layers.

The keys and values lie heads first, ``[B, K, S, H]``: a decode step's attention is then two batched
matmuls over the cache as it lies (``jaxpe.attention.decode_attention(heads_first=True)``), where
``[B, S, K, H]`` made XLA:CPU write a transposed copy of every layer's cache at every step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpe.attention import platforms
from jaxpe.model import encodings
from jaxpe.model.config import ModelConfig
from jaxpe.ops import checks as _checks


class KVCache(NamedTuple):
  """Keys and values of earlier tokens, for decoding one chunk at a time.

  Slots ``0..end-1`` are filled. Keys are stored after the positional encoding (rotated keys for
  ``rope``; the augmented float32 keys for ``rope_alibi``). Slots from ``end`` on are dead, whatever
  they hold: moving ``end`` back (rejecting speculated tokens) rolls the cache back, and nothing reads
  a slot past ``end`` as live (``live_slots``: the next positions, the encodings' checks, the valid
  flags of the cache a call returns; attention masks them causally).

  A windowed layer (``sliding_attention`` / ``chunked_attention``, ``ModelConfig.layer_pattern``)
  holds a ring of ``W = ring_slots < S`` slots instead (``layer_slots``; ``jaxpe.model.ring_cache``):
  its arrays are ``[B, K, W, .]``, its slot g in ring slot ``g % W``; ``positions`` and ``valid``
  keep all S columns for every layer.

  Attributes:
    k: L arrays ``[B, K, S, Hk]`` (Hk = H, or H + 2k for ``rope_alibi`` of order k), heads first.
    v: L arrays ``[B, K, S, H]``.
    positions: ``[B, S]`` int32 token positions of the slots.
    valid: ``[B, S]`` bool, True for slots holding a real (non-padding) token (read only below
      ``end``: ``live_slots``).
    end: ``[]`` int32 number of filled slots.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  positions: jax.Array
  valid: jax.Array
  end: jax.Array


def layer_slots(cfg: ModelConfig, max_len: int) -> tuple[int, ...]:
  """``[L]`` the cache slots of each layer in a cache of ``max_len`` slots: a windowed layer's
  ``ring_slots`` (``sliding_window - 1`` or ``attention_chunk_size - 1``) when fewer, else ``max_len``."""
  rings = (cfg.layer_pattern(i).ring_slots for i in range(cfg.num_layers))
  return tuple(max_len if r is None or r > max_len else r for r in rings)


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int) -> int:
  """Bytes of ``init_cache(cfg, batch_size, max_len)``: per layer ``[B, K, S_l, Hk]`` keys and
  ``[B, K, S_l, H]`` values (``S_l = layer_slots``), plus the ``[B, S]`` int32 positions and bool
  validity."""
  key_dim, k_dtype = encodings.for_config(cfg).cache_key()
  per_slot = cfg.kv_heads * (
    key_dim * jnp.dtype(k_dtype).itemsize + cfg.head_size * jnp.dtype(cfg.dtype).itemsize
  )
  return batch_size * (sum(layer_slots(cfg, max_len)) * per_slot + 5 * max_len)


def check_cache_fits(cfg: ModelConfig, batch_size: int, max_len: int, name: str, fix: str) -> None:
  """ValueError naming ``name`` when the cache of ``batch_size`` x ``max_len`` slots exceeds the
  memory of JAX's devices (``jaxpe.ops.checks.device_memory_bytes``), before it is allocated."""
  need = cache_bytes(cfg, batch_size, max_len)
  _checks.check_fits(
    name, need, _checks.device_memory_bytes(), f"a KV cache of B = {batch_size} x S = {max_len} slots", fix
  )


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> KVCache:
  """Empty cache for ``batch_size`` sequences of up to ``max_len`` tokens (prompt + generated).

  Args:
    cfg: the ``ModelConfig`` of the ``Decoder`` that will use the cache.
    batch_size: B, a positive Python int.
    max_len: S, the number of slots, a positive Python int.

  Returns:
    a ``KVCache`` with ``end = 0``: k ``L x [B, K, S_l, Hk]`` (``S_l = layer_slots``: a windowed
    layer's ring, else S) (float32 for ``rope_alibi``, else
    ``cfg.dtype``), v ``L x [B, K, S, H]`` ``cfg.dtype``, positions ``[B, S]`` int32, valid
    ``[B, S]`` bool.

  Raises:
    TypeError: ``cfg`` not a ``ModelConfig``.
    ValueError: ``batch_size`` or ``max_len`` not a positive integer; ``max_len`` beyond 2^31 - 1
      (int32 positions); a cache larger than the device's memory (``cache_bytes``: checked before
      anything is allocated, the message names both sizes).
  """
  if not isinstance(cfg, ModelConfig):
    raise TypeError(f"cfg must be a jaxpe.config.ModelConfig, got {type(cfg).__name__}")
  batch_size = _checks.check_positive_int("batch_size", batch_size)
  max_len = _checks.check_positive_int("max_len", max_len, maximum=_checks.MAX_POSITION - 1)
  check_cache_fits(cfg, batch_size, max_len, "max_len", "give a smaller max_len or batch_size")
  key_dim, k_dtype = encodings.for_config(cfg).cache_key()
  shapes = [(batch_size, cfg.kv_heads, s) for s in layer_slots(cfg, max_len)]
  return KVCache(
    k=tuple(jnp.zeros((*shape, key_dim), k_dtype) for shape in shapes),
    v=tuple(jnp.zeros((*shape, cfg.head_size), cfg.dtype) for shape in shapes),
    positions=jnp.zeros((batch_size, max_len), jnp.int32),
    valid=jnp.zeros((batch_size, max_len), bool),
    end=jnp.zeros((), jnp.int32),
  )


def live_slots(cache) -> jax.Array:
  """``[B, S]`` bool: the slots below ``cache.end`` that hold a real token (``valid``). A slot from
  ``end`` on is dead even where ``valid`` still says True (a cache rolled back by moving ``end``).
  Every reader of ``valid`` goes through this."""
  slots = jnp.arange(cache.valid.shape[-1], dtype=jnp.int32)
  return jnp.asarray(cache.valid).astype(bool) & (slots < jnp.asarray(cache.end, jnp.int32))[None, :]


def is_empty_cache(cache: KVCache) -> bool:
  """Whether ``cache.end`` is known at trace time to be 0 (a fresh ``init_cache``, called eagerly or
  with ``end`` a concrete value under jit): the next chunk is then a prefill that attends only to
  itself. False for a traced ``end`` (the chunk then attends to every slot through the mask)."""
  end = cache.end
  if isinstance(end, jax.core.Tracer):
    return False
  return int(end) == 0


def _raise_overflow(end, t_len: int, slots: int) -> None:
  raise ValueError(
    f"the KV cache has {slots} slots; {t_len} new tokens after {int(end)} filled ones do not fit "
    "(init_cache with a larger max_len)"
  )


def check_cache(cfg: ModelConfig, cache, batch: int, t_len: int) -> None:
  """The KV cache matches the model (``init_cache(cfg, B, S)``) and has room for ``t_len`` tokens."""
  if not isinstance(cache, KVCache):
    raise TypeError(f"cache must be a KVCache from jaxpe.model.init_cache, got {type(cache).__name__}")
  ref = jax.eval_shape(lambda: init_cache(cfg, batch, cache.positions.shape[1]))
  if jnp.ndim(cache.positions) != 2:
    raise ValueError(f"cache.positions must have shape [B, S], got {jnp.shape(cache.positions)}")
  for name in ("k", "v"):
    got = getattr(cache, name)
    if not isinstance(got, tuple | list) or len(got) != cfg.num_layers:
      raise ValueError(
        f"cache.{name} must hold num_layers = {cfg.num_layers} arrays, got {type(got).__name__}"
      )
  for name, want, got in [
    *((f"cache.k[{i}]", r, g) for i, (r, g) in enumerate(zip(ref.k, cache.k))),
    *((f"cache.v[{i}]", r, g) for i, (r, g) in enumerate(zip(ref.v, cache.v))),
    ("cache.positions", ref.positions, cache.positions),
    ("cache.valid", ref.valid, cache.valid),
    ("cache.end", ref.end, cache.end),
  ]:
    if tuple(jnp.shape(got)) != tuple(want.shape):
      raise ValueError(
        f"{name} must have shape {tuple(want.shape)} (init_cache(cfg, B={batch}, S) of this model), "
        f"got {tuple(jnp.shape(got))}"
      )
    if jnp.result_type(got) != want.dtype:
      raise TypeError(
        f"{name} must have dtype {want.dtype} (init_cache of this model), got {jnp.result_type(got)}"
      )
  slots = cache.positions.shape[1]
  if t_len > slots:
    raise ValueError(
      f"the KV cache has {slots} slots; {t_len} new tokens do not fit (init_cache with a larger max_len)"
    )
  if isinstance(cache.end, jax.core.Tracer):
    # traced: checked when the call runs (a host callback, run only on overflow), in a program
    # lowered for this host's platform; a host callback cannot be lowered for another platform (a
    # CPU host exporting for cuda or tpu), so a program lowered for another platform has no check
    def check():
      jax.lax.cond(
        (cache.end < 0) | (cache.end > slots - t_len),
        lambda: jax.debug.callback(_raise_overflow, cache.end, t_len, slots),
        lambda: None,
      )

    platforms.per_platform({platforms.host_platform(): check}, default=lambda: None)
    return
  end = int(cache.end)
  if end < 0 or end + t_len > slots:
    _raise_overflow(end, t_len, slots)


def _raise_position_overflow(last, count) -> None:
  raise ValueError(
    f"the KV cache's last position is {int(last)}; {int(count)} more real tokens would pass 2^31 - 1 "
    "(positions are int32 token indices): give positions= explicitly, or start a new cache"
  )


def next_positions_start(cache: KVCache, valid) -> jax.Array:
  """``[B]`` int32 position of the first real token of the next chunk: one past the position of the
  cache's last real token below ``end`` (``live_slots``; 0 in a row with none), as ``start`` of
  ``positions_from_mask``.

  Raises:
    ValueError: when the chunk's ``valid [B, T]`` real tokens would take a position past
      ``2^31 - 1``: at trace time from a concrete cache, else when the call runs (a host callback,
      as ``check_cache``), never a position that wraps to a negative or repeats an earlier one.
  """
  last = jnp.max(jnp.where(live_slots(cache), cache.positions, -1), axis=1)  # [B], -1: no real token yet
  count = jnp.sum(jnp.asarray(valid).astype(jnp.int32), axis=1)
  over = last > jnp.int32(_checks.MAX_POSITION - 1) - count  # last + count > 2^31 - 1, without a wrap
  if any(isinstance(x, jax.core.Tracer) for x in (last, count)):

    def check():
      at = jnp.argmax(over)
      jax.lax.cond(
        jnp.any(over),
        lambda: jax.debug.callback(_raise_position_overflow, last[at], count[at]),
        lambda: None,
      )

    platforms.per_platform({platforms.host_platform(): check}, default=lambda: None)
  elif bool(jnp.any(over)):
    at = int(jnp.argmax(over))
    _raise_position_overflow(last[at], count[at])
  return last + 1
