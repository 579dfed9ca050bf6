"""The interface between the decoder and a positional encoding, and the registry of encodings.

The decoder asks the encoding of its config (``for_config(cfg)``) once per concern and never
looks at ``cfg.pos_encoding`` itself:

====================  =======================================  ===================================
concern               hook                                     who overrides it
====================  =======================================  ===================================
parameters            ``token_embed_std``, ``params``,         sinusoidal, learned, rope_alibi
                      ``qk_extra_dims``, ``init_qk``           (in-projection form)
inputs                ``embed_inputs``                         learned, sinusoidal
queries and keys      ``encode_qk``, ``encode_qk_nope``        rope, xpos, rope_alibi
per-layer parameters  ``layer_params``                         cope, kerple_log, kerple_power, fire
attention bias        ``alibi_spec``, ``attention_bias``       alibi; cope (dense, xla only)
learned bias          ``shared_bias_params``,                  t5, kerple_log, kerple_power, fire
                      ``position_bias``
KV cache              ``cache_key``                            rope_alibi
call checks           ``check_call``                           rope_alibi
====================  =======================================  ===================================

Every hook has a do-nothing default (NoPE), so an encoding overrides only what it changes. A new
encoding is one module in ``jaxpe/model/encodings/`` holding a ``@register("name")`` subclass of
``PositionalEncoding``, its import line in ``jaxpe/model/encodings/__init__.py`` and its name in
``jaxpe.model.config.POS_ENCODINGS``;
``ModelConfig.pos_encoding`` then accepts ``"name"``. An encoding is a plain object built from the
config (no state): parameters it needs are created by ``params`` and live on the ``Decoder``.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
D model dim.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe import emulation
from jaxpe.attention.kernels import AlibiSpec
from jaxpe.attention.position_bias import PositionBias
from jaxpe.attention.rope_spec import RopeSpec
from jaxpe.model import config
from jaxpe.model.config import ModelConfig


class CachedSlots(Protocol):
  """What an encoding reads of the call's KV cache (``jaxpe.model.cache.KVCache``, which imports
  this registry): ``positions`` ``[B, S]`` int32, ``valid`` ``[B, S]`` bool and ``end`` (the slots
  from ``end`` on are dead: read ``valid`` only below it, as ``jaxpe.model.cache.live_slots``)."""

  positions: jax.Array
  valid: jax.Array
  end: jax.Array


class PositionalEncoding:
  """One family of positional encodings, as the decoder uses it; the defaults encode nothing.

  Built as ``cls(cfg)`` from the model's ``ModelConfig`` (``self.cfg``); holds no parameters and
  no state. ``name`` is the ``pos_encoding`` value it is registered under (``register``).
  """

  name: ClassVar[str] = ""

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg

  # -- parameters ---------------------------------------------------------------------------

  def token_embed_std(self) -> float:
    """Init std of the token embedding ``[V, D]``; default ``cfg.init_std``."""
    return self.cfg.init_std

  def params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    """Modules holding the encoding's own parameters, set as attributes of the ``Decoder`` under
    these names (right after the token embedding, so their place in the parameter tree and in the
    initialisation's random stream is fixed); default none."""
    del rngs
    return {}

  def layer_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module | nnx.Param]:
    """Modules (or ``nnx.Param``) of the encoding's per-layer parameters (CoPE's table, Kerple's and
    FIRE's), set as attributes of each ``Attention`` layer under these names after its projections
    (stacked on ``layers`` with ``scan_layers``); default none."""
    del rngs
    return {}

  def qk_extra_dims(self) -> int:
    """Extra outputs per head of the q and k projections (``H + extra``); default 0."""
    return 0

  def matmul_flops_per_token(self, seq_len: int) -> float:
    """Forward model FLOPs (2 per multiply-add) per token and layer of the encoding's own matmuls on
    sequences of ``seq_len`` tokens, beyond the decoder's projections and attention products
    (``jaxpe.train.flops``; a query's causal pairs counted as attention's, ``(T + 1) / 2``); default
    0 (rotations, biases, lookups and gates are elementwise, no matmuls)."""
    del seq_len
    return 0.0

  def init_qk(self, q: nnx.Einsum, k: nnx.Einsum) -> None:
    """Adjusts the freshly initialised q / k projections of one ``Attention`` in place (kernels
    ``[D, N, H + extra]`` / ``[D, K, H + extra]``); default nothing."""
    del q, k

  # -- inputs -------------------------------------------------------------------------------

  def embed_inputs(self, model: nnx.Module, x: jax.Array, positions: jax.Array) -> jax.Array:
    """The first block's input from the token embeddings.

    Args:
      model: the ``Decoder`` (holding the modules made by ``params``).
      x: ``[B, T, D]`` token embeddings in ``cfg.dtype``.
      positions: ``[B, T]`` int32 token positions.

    Returns:
      ``[B, T, D]``; default ``x`` unchanged (relative encodings add nothing here).
    """
    del model, positions
    return x

  # -- queries and keys ---------------------------------------------------------------------

  def encode_qk(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q ``[B, T, N, Hq]`` and k ``[B, T, K, Hq]`` of the new tokens at ``positions [B, T]`` int32
    -> the encoded ``(q, k)`` (k as stored in the KV cache, ``cache_key``); default unchanged."""
    del positions
    return q, k

  def encode_qk_nope(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``encode_qk`` of a NoPE layer of a per-layer schedule (``ModelConfig.no_rope_layers``): q and
    k not rotated; default unchanged (rope, xpos). Must return ``encode_qk``'s shapes and dtypes."""
    del positions
    return q, k

  def encode_layer_qk(
    self, q: jax.Array, k: jax.Array, positions: jax.Array, use_rope: bool | jax.Array | None
  ) -> tuple[jax.Array, jax.Array]:
    """``encode_qk`` (``use_rope`` None or true) or ``encode_qk_nope`` (false) of one layer:
    ``use_rope`` is the layer's flag, a Python bool in the layer loop or a traced bool scalar under
    ``scan_layers`` / ``remat`` (then ``jax.lax.cond`` runs one of the two)."""
    if use_rope is None:
      return self.encode_qk(q, k, positions)
    if isinstance(use_rope, bool):
      return (self.encode_qk if use_rope else self.encode_qk_nope)(q, k, positions)
    return jax.lax.cond(use_rope, self.encode_qk, self.encode_qk_nope, q, k, positions)

  def rope_spec(self, positions: jax.Array, kv_positions: jax.Array) -> RopeSpec | None:
    """The rotation ``encode_qk`` applies, as a ``RopeSpec`` for a backend that rotates inside its
    kernel (``flash``), from query ``positions [B, T]`` and key ``kv_positions [B, S]``; default
    None (``encode_qk`` runs instead)."""
    del positions, kv_positions
    return None

  # -- attention bias -----------------------------------------------------------------------

  def alibi_spec(self, positions: jax.Array, kv_positions: jax.Array) -> AlibiSpec | None:
    """The ALiBi bias for the attention backend (``jaxpe.attention.kernels.attention``), from query
    ``positions [B, T]`` and key ``kv_positions [B, S]`` int32; default None (no bias)."""
    del positions, kv_positions
    return None

  def attention_bias(
    self, layer: nnx.Module, q: jax.Array, k: jax.Array, mask, *, scale: float
  ) -> jax.Array | None:
    """A dense, context-dependent bias ``[B, N, T, S]`` float32 for the ``xla`` backend (fused
    kernels take none), from one ``Attention`` ``layer`` (its ``layer_params``), the encoded q
    ``[B, T, N, Hq]``, the keys k ``[B, S, K, Hq]`` (all cache slots with a KV cache), the layer's
    ``mask`` (an ``AttentionMask`` or ``IndexMask``; ``.dense()`` gives ``[B, 1, T, S]``) and the
    score ``scale``; default None (no bias)."""
    del layer, q, k, mask, scale
    return None

  # -- learned position bias ----------------------------------------------------------------

  def shared_bias_params(self, model: nnx.Module) -> Any:
    """Arrays of the ``Decoder`` (``model``, holding the modules made by ``params``) that every
    layer's ``position_bias`` reads (T5's one table); default None."""
    del model
    return None

  def position_bias(
    self, layer: nnx.Module, shared: Any, positions: jax.Array, kv_positions: jax.Array
  ) -> PositionBias | None:
    """A learned bias for the attention backend (``xla`` only), from the ``Attention`` ``layer``
    (its ``layer_params``), ``shared`` (``shared_bias_params``), query ``positions [B, T]`` and key
    ``kv_positions [B, S]`` int32; default None (no bias)."""
    del layer, shared, positions, kv_positions
    return None

  # -- KV cache -----------------------------------------------------------------------------

  def cache_key(self) -> tuple[int, jnp.dtype]:
    """``(Hk, dtype)`` of the keys stored in the KV cache (``encode_qk``'s k); default
    ``(H + qk_extra_dims(), cfg.dtype)``."""
    return self.cfg.head_size + self.qk_extra_dims(), jnp.dtype(self.cfg.dtype)

  # -- call checks --------------------------------------------------------------------------

  def check_call(self, span: int, positions: jax.Array | None, cache: CachedSlots | None) -> None:
    """Refuses inputs the encoding cannot encode, before the decoder runs.

    Args:
      span: T, or the KV cache's S when a cache is given (static).
      positions: the caller's ``[B, T]`` positions, or None when they are derived.
      cache: the ``KVCache`` of the call, or None.

    Raises:
      ValueError: inputs outside the encoding's range; default: nothing refused.
    """
    del span, positions, cache


def emulation_theta(cfg: ModelConfig) -> float:
  """theta of the ``rope_alibi`` pair: max phase over the configured context (``rope_alibi_max_phase``
  over ``rope_alibi_context``, default ``max_len``), in radians per token. Used by ``rope_alibi`` and
  by ``alibi``'s rotated emulation on bias-free kernels."""
  return emulation.emulation_theta(
    max_phase=cfg.rope_alibi_max_phase, max_len=cfg.rope_alibi_context or cfg.max_len
  )


REGISTRY: dict[str, type[PositionalEncoding]] = config.ENCODINGS
"""``pos_encoding`` name -> encoding class, in registration order: ``jaxpe.model.config.ENCODINGS``,
the table ``ModelConfig.pos_encoding`` reads (the built-in names: ``config.POS_ENCODINGS``)."""


def register(name: str):
  """Class decorator: registers a ``PositionalEncoding`` subclass as ``pos_encoding=name``.

  Raises:
    ValueError: ``name`` is already registered.
    TypeError: the class is no ``PositionalEncoding``.
  """

  def add(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
    if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
      raise TypeError(f"@register({name!r}) takes a PositionalEncoding subclass, got {cls!r}")
    if name in REGISTRY:
      raise ValueError(f"pos_encoding {name!r} is already registered ({REGISTRY[name].__qualname__})")
    cls.name = name
    REGISTRY[name] = cls
    return cls

  return add


def for_config(cfg: ModelConfig) -> PositionalEncoding:
  """The encoding ``cfg.pos_encoding`` names, built for ``cfg``."""
  return REGISTRY[cfg.pos_encoding](cfg)
