"""Flax NNX decoder-only transformer that composes the jaxpe ops.

Pre-LayerNorm blocks (LayerNorm -> causal multi-head attention -> residual, LayerNorm -> GELU MLP
-> residual), final LayerNorm, output head tied to the token embedding by default. The positional
encoding is chosen by ``ModelConfig.pos_encoding``: ``none``, ``learned`` (absolute table),
``sinusoidal``, ``rope`` (with ``rope_scaling`` and ``rotary_dim``), ``xpos``, ``alibi`` or
``rope_alibi`` (RoPE-emulated ALiBi). BLOOM-compatible options:
``use_bias``, ``embed_layernorm``, ``gelu_approximate`` (tanh GELU), ``layernorm_eps``.

Parameters carry logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``pos``); ``jaxpe.model.partitioning`` maps them onto mesh axes.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
D model dim, F MLP dim, V vocab, L layers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpe.attention import kernels
from jaxpe.attention import reference as attention
from jaxpe.emulation import core as emulation
from jaxpe.model import partitioning
from jaxpe.model.config import ModelConfig
from jaxpe.ops import alibi, rope, sinusoidal, xpos
from jaxpe.ops import checks as _checks
from jaxpe.ops import positions as positions_lib


class KVCache(NamedTuple):
  """Keys and values of earlier tokens, for decoding one chunk at a time.

  Slots ``0..end-1`` are filled. Keys are stored after the positional encoding (rotated keys for
  ``rope``; the augmented float32 keys for ``rope_alibi``).

  Attributes:
    k: L arrays ``[B, S, K, Hk]`` (Hk = H, or H + 2k for ``rope_alibi`` of order k).
    v: L arrays ``[B, S, K, H]``.
    positions: ``[B, S]`` int32 token positions of the slots.
    valid: ``[B, S]`` bool, True for slots holding a real (non-padding) token.
    end: ``[]`` int32 number of filled slots.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  positions: jax.Array
  valid: jax.Array
  end: jax.Array


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> KVCache:
  """Empty cache for ``batch_size`` sequences of up to ``max_len`` tokens (prompt + generated).

  Args:
    cfg: the ``ModelConfig`` of the ``Decoder`` that will use the cache.
    batch_size: B, a positive Python int.
    max_len: S, the number of slots, a positive Python int.

  Returns:
    a ``KVCache`` with ``end = 0``: k ``L x [B, S, K, Hk]`` (float32 for ``rope_alibi``, else
    ``cfg.dtype``), v ``L x [B, S, K, H]`` ``cfg.dtype``, positions ``[B, S]`` int32, valid
    ``[B, S]`` bool.

  Raises:
    TypeError: ``cfg`` not a ``ModelConfig``.
    ValueError: ``batch_size`` or ``max_len`` not a positive integer.
  """
  if not isinstance(cfg, ModelConfig):
    raise TypeError(f"cfg must be a jaxpe.config.ModelConfig, got {type(cfg).__name__}")
  batch_size = _checks.check_positive_int("batch_size", batch_size)
  max_len = _checks.check_positive_int("max_len", max_len)
  key_dim = cfg.head_size + (2 * cfg.rope_alibi_order if cfg.pos_encoding == "rope_alibi" else 0)
  k_dtype = jnp.float32 if cfg.pos_encoding == "rope_alibi" else jnp.dtype(cfg.dtype)
  shape = (batch_size, max_len, cfg.kv_heads)
  return KVCache(
    k=tuple(jnp.zeros((*shape, key_dim), k_dtype) for _ in range(cfg.num_layers)),
    v=tuple(jnp.zeros((*shape, cfg.head_size), cfg.dtype) for _ in range(cfg.num_layers)),
    positions=jnp.zeros((batch_size, max_len), jnp.int32),
    valid=jnp.zeros((batch_size, max_len), bool),
    end=jnp.zeros((), jnp.int32),
  )


def _init(std: float, names: tuple[str | None, ...]):
  return nnx.with_partitioning(nnx.initializers.normal(std), names)


def _zeros(names: tuple[str | None, ...]):
  return nnx.with_partitioning(nnx.initializers.zeros_init(), names)


def _ones(names: tuple[str | None, ...]):
  return nnx.with_partitioning(nnx.initializers.ones_init(), names)


def _token_embed_std(cfg: ModelConfig) -> float:
  """Init std of the token embedding: ``D ** -0.5`` for ``sinusoidal`` (scaled by ``sqrt(D)`` in
  ``Decoder.embed_inputs``, as Vaswani et al. and fairseq), else ``init_std``."""
  return cfg.d_model**-0.5 if cfg.pos_encoding == "sinusoidal" else cfg.init_std


class LayerNorm(nnx.LayerNorm):
  """``nnx.LayerNorm`` over the last axis with an exact, corrected two-pass variance, in float32.

  ``mu = mean(x)``, ``d = x - mu``, then ``d -= mean(d)`` (the corrected two-pass algorithm, Chan,
  Golub & LeVeque 1983: it removes the rounding error of ``mu``), ``var = mean(d^2)``,
  ``y = d / sqrt(var + eps) * scale + bias``. flax's default ``E[x^2] - E[x]^2`` cancels in float32
  when a row's mean is large next to its spread (rows of 100 + 1e-3 k normalised to -0.17 instead of
  -1.34), and the plain two-pass form still carries the mean's rounding error (3e-3 at an offset of
  1e4 with unit spread); this one stays at float32 rounding of the result at any offset whose
  values float32 holds. Same parameters (``scale``, ``bias`` ``[D]``) and the same result as
  Ba et al. 2016 (arXiv 1607.06450) / HF ``torch.nn.LayerNorm`` up to rounding.

  x ``[..., D]`` -> ``[..., D]`` float32.
  """

  def __call__(self, x, *, mask=None):
    if mask is not None:
      raise ValueError("jaxpe's LayerNorm takes no mask")
    scale = self.scale[...] if self.scale else None
    bias = self.bias[...] if self.bias else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=jnp.float32)
    x = x.astype(jnp.float32)
    d = x - jnp.mean(x, axis=-1, keepdims=True)
    d = d - jnp.mean(d, axis=-1, keepdims=True)
    mul = jax.lax.rsqrt(jnp.mean(jnp.square(d), axis=-1, keepdims=True) + jnp.float32(self.epsilon))
    feature = (1,) * (x.ndim - 1) + (x.shape[-1],)
    if scale is not None:
      mul = mul * scale.astype(jnp.float32).reshape(feature)
    y = d * mul
    if bias is not None:
      y = y + bias.astype(jnp.float32).reshape(feature)
    return y


def _layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> LayerNorm:
  return LayerNorm(
    cfg.d_model,
    epsilon=cfg.layernorm_eps,
    dtype=jnp.float32,
    use_fast_variance=False,
    scale_init=_ones(("embed",)),
    bias_init=_zeros(("embed",)),
    rngs=rngs,
  )


def _dense(cfg, eq, kernel_shape, bias_shape, names, std, rngs) -> nnx.Einsum:
  return nnx.Einsum(
    eq,
    kernel_shape,
    bias_shape if cfg.use_bias else None,
    dtype=cfg.dtype,
    kernel_init=_init(std, names),
    bias_init=_zeros(names[-len(bias_shape) :]),
    rngs=rngs,
  )


class Attention(nnx.Module):
  """Causal multi-head (or grouped-query) self-attention with the configured position encoding."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, kv, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size
    hq = h + 2 if cfg.rope_alibi_in_projection else h  # q/k dims per head
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.q = _dense(
      cfg, "BTD,DNH->BTNH", (d, n, hq), (n, hq), ("embed", "heads", "head_dim"), cfg.init_std, rngs
    )
    self.k = _dense(
      cfg, "BSD,DKH->BSKH", (d, kv, hq), (kv, hq), ("embed", "kv_heads", "head_dim"), cfg.init_std, rngs
    )
    if cfg.rope_alibi_in_projection:
      # The two extra dims: zero kernel columns; biases carry q_fixed = (-N_h, 0), k_fixed = (0, 1).
      amp = emulation.emulation_amplitudes(alibi.alibi_slopes_f64(n), head_dim=h, theta=emulation_theta(cfg))
      q_fixed = jnp.stack([-jnp.asarray(amp, jnp.float32), jnp.zeros((n,), jnp.float32)], axis=-1)
      self.q.kernel[...] = self.q.kernel[...].at[:, :, h:].set(0.0)
      self.k.kernel[...] = self.k.kernel[...].at[:, :, h:].set(0.0)
      self.q.bias[...] = self.q.bias[...].at[:, h:].set(q_fixed)
      self.k.bias[...] = self.k.bias[...].at[:, h:].set(jnp.asarray([0.0, 1.0], jnp.float32)[None, :])
    self.v = _dense(
      cfg, "BSD,DKH->BSKH", (d, kv, h), (kv, h), ("embed", "kv_heads", "head_dim"), cfg.init_std, rngs
    )
    self.o = _dense(cfg, "BTNH,NHD->BTD", (n, h, d), (d,), ("heads", "head_dim", "embed"), out_std, rngs)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    *,
    kv_positions: jax.Array,
    cache_kv: tuple[jax.Array, jax.Array] | None = None,
    cache_end: jax.Array | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """x ``[B, T, D]`` -> ``([B, T, D], updated (k, v) cache or None)``.

    ``mask`` (an ``AttentionMask`` without a cache, a dense ``[B, 1, T, S]`` bool mask with one) and
    ``kv_positions`` ``[B, S]`` describe the keys: the T new tokens without a cache, or all S cache
    slots with one. Runs on ``cfg.attn_implementation`` (``jaxpe.kernels``); with a cache on ``xla``.
    """
    q, k, v = self.q(x), self.k(x), self.v(x)  # [B,T,N,H], [B,T,K,H], [B,T,K,H]
    q, k = self._encode_qk(q, k, positions)
    if cache_kv is not None:
      k_cache, v_cache = cache_kv
      k = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), cache_end, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), cache_end, axis=1)
    cfg = self.cfg
    fused = cache_kv is None and isinstance(mask, attention.AttentionMask)
    out = kernels.attention(
      q,
      k,
      v,
      scale=1.0 / math.sqrt(cfg.head_size),
      mask=mask,
      alibi_spec=self._alibi_spec(positions, kv_positions),
      precise_dims=q.shape[-1] - cfg.head_size,  # the rope_alibi emulation dims (float32)
      impl=cfg.attn_implementation if fused else "xla",
      interpret=cfg.attention_interpret,
    )
    return self.o(out), (k, v) if cache_kv is not None else None

  def _encode_qk(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rotary encodings: q ``[B, T, N, Hq]``, k ``[B, T, K, Hq]`` at ``positions [B, T]``."""
    cfg = self.cfg
    if cfg.pos_encoding == "rope":
      inv_freq, factor = cfg.rope_frequencies()  # rope_scaling + rotary_dim
      kw = dict(inv_freq=inv_freq, layout=cfg.rope_layout, scale=factor)
      return rope.apply_rope(q, positions, **kw), rope.apply_rope(k, positions, **kw)
    if cfg.pos_encoding == "xpos":
      inv_freq, factor = cfg.rope_frequencies()
      # The same offset for queries and keys cancels in q.k and keeps zeta ** (p / scale_base) finite
      # in float32 for |p - offset| up to ~35,000 (config: max_len <= 65536).
      kw = dict(inv_freq=inv_freq, layout=cfg.rope_layout, attention_factor=factor, offset=cfg.max_len // 2)
      return xpos.apply_xpos(q, positions, kind="query", **kw), xpos.apply_xpos(
        k, positions, kind="key", **kw
      )
    if cfg.pos_encoding == "rope_alibi" and cfg.rope_alibi_in_projection:
      # q, k already carry the two fixed dims (from the projection biases): rotate the last pair only.
      inv_freq = jnp.asarray([0.0] * (cfg.head_size // 2) + [emulation_theta(cfg)], jnp.float32)
      return (
        rope.apply_rope(q.astype(jnp.float32), positions, inv_freq=inv_freq),
        rope.apply_rope(k.astype(jnp.float32), positions, inv_freq=inv_freq),
      )
    if cfg.pos_encoding == "rope_alibi":
      slopes = alibi.alibi_slopes_f64(cfg.num_heads)
      theta = emulation_theta(cfg)
      return emulation.apply_rope_alibi(
        q, k, positions, positions, slopes=slopes, theta=theta, order=cfg.rope_alibi_order
      )
    return q, k

  def _alibi_spec(self, positions: jax.Array, kv_positions: jax.Array) -> kernels.AlibiSpec | None:
    """ALiBi for the backend (``alibi_heads``: the first heads only, slope 0 on the rest), else None."""
    cfg = self.cfg
    if cfg.pos_encoding != "alibi":
      return None
    n_alibi = cfg.alibi_heads or cfg.num_heads
    slopes = alibi.alibi_slopes_f64(n_alibi)
    return kernels.AlibiSpec(
      slopes=np.pad(slopes, (0, cfg.num_heads - n_alibi)),
      q_positions=positions,
      k_positions=kv_positions,
      # positions are < max(T, max_len) unless given explicitly; the exact form's two base-256
      # digits (18 dims) cover every position below 65536 whatever the model's lengths
      max_position=max(
        65536, cfg.max_len, cfg.rope_alibi_context or 0, positions.shape[1], kv_positions.shape[1]
      ),
      form=cfg.alibi_emulation,
      order=cfg.rope_alibi_order,
      theta=emulation_theta(cfg),
    )


def _check_call(cfg: ModelConfig, tokens, positions, attention_mask, segment_ids, cache):
  """The static checks of ``Decoder.__call__``; returns the arguments as JAX arrays."""

  # _checks.as_array keeps numpy as numpy until checked (jnp.asarray would wrap int64 values to int32)
  # and names the argument for a ragged list or strings.
  tokens = _checks.as_array("tokens", tokens)
  _checks.check_rank("tokens", tokens, 2, "[B, T]")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
  if 0 in tokens.shape:
    raise ValueError(
      f"tokens must hold at least one token in at least one row (B, T >= 1), got shape {tokens.shape}"
    )
  _checks.check_index_range("tokens", tokens, cfg.vocab_size, "vocab_size")
  shape = tokens.shape

  def same_shape(name, x):
    if tuple(x.shape) != tuple(shape):
      raise ValueError(f"{name} must have the shape of tokens [B, T] = {tuple(shape)}, got {tuple(x.shape)}")

  if positions is not None:
    positions = _checks.as_array("positions", positions)
    same_shape("positions", positions)
    _checks.check_positions("positions", positions)
  if attention_mask is not None:
    attention_mask = _checks.as_array("attention_mask", attention_mask)
    same_shape("attention_mask", attention_mask)
    if not (attention_mask.dtype == jnp.bool_ or jnp.issubdtype(attention_mask.dtype, jnp.integer)):
      raise TypeError(
        f"attention_mask must be bool or integer (nonzero = real token), got dtype {attention_mask.dtype}"
      )
  if segment_ids is not None:
    if cache is not None:
      raise ValueError("segment_ids (packed sequences) cannot be combined with a KV cache")
    segment_ids = _checks.as_array("segment_ids", segment_ids)
    same_shape("segment_ids", segment_ids)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise TypeError(f"segment_ids must be an integer array of document ids, got dtype {segment_ids.dtype}")

  def to_jax(x):
    return None if x is None else jnp.asarray(x)

  return to_jax(tokens), to_jax(positions), to_jax(attention_mask), to_jax(segment_ids)


def _raise_overflow(end, t_len: int, slots: int) -> None:
  raise ValueError(
    f"the KV cache has {slots} slots; {t_len} new tokens after {int(end)} filled ones do not fit "
    "(init_cache with a larger max_len)"
  )


def _check_cache(cfg: ModelConfig, cache, batch: int, t_len: int) -> None:
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
    # traced: checked when the call runs (a host callback, run only on overflow)
    jax.lax.cond(
      (cache.end < 0) | (cache.end > slots - t_len),
      lambda: jax.debug.callback(_raise_overflow, cache.end, t_len, slots),
      lambda: None,
    )
    return
  end = int(cache.end)
  if end < 0 or end + t_len > slots:
    _raise_overflow(end, t_len, slots)


def _check_rope_alibi_span(cfg: ModelConfig, span: int) -> None:
  """Refuses a ``rope_alibi`` model a sequence (or KV cache) longer than the context its emulation
  is tuned for: beyond it the emulated bias leaves ALiBi (it turns positive past the phase's
  quarter turn)."""
  context = cfg.rope_alibi_context or cfg.max_len
  if cfg.pos_encoding == "rope_alibi" and span > context:
    raise ValueError(
      f"pos_encoding='rope_alibi' follows ALiBi only within rope_alibi_context = {context} tokens, got a "
      f"sequence or KV cache of {span} tokens; build the model with a larger rope_alibi_context (or max_len)"
    )


def _check_rope_alibi_positions(cfg: ModelConfig, positions, cache) -> None:
  """Concrete positions of a ``rope_alibi`` call: every query-key distance (within the call, and
  against the cached positions) must stay within ``rope_alibi_context``, where the emulation follows
  ALiBi; a short call with far-apart positions would otherwise leave it without a word. Traced
  positions cannot be checked (documented: keep distances within the context)."""
  p = np.asarray(positions)
  if p.size == 0:
    return
  lo, hi = int(p.min()), int(p.max())
  if cache is not None and not isinstance(cache.positions, jax.core.Tracer):
    cached = np.asarray(cache.positions)[np.asarray(cache.valid, bool)]
    if cached.size:
      lo, hi = min(lo, int(cached.min())), max(hi, int(cached.max()))
  context = cfg.rope_alibi_context or cfg.max_len
  if hi - lo >= context:
    raise ValueError(
      f"positions span {lo}..{hi} ({hi - lo + 1} positions, with the KV cache's): pos_encoding='rope_alibi' "
      f"follows ALiBi only for distances below rope_alibi_context = {context}; build the model with a larger "
      "rope_alibi_context (or max_len)"
    )


def emulation_theta(cfg: ModelConfig) -> float:
  """theta of the ``rope_alibi`` pair: max phase over the configured context."""
  return emulation.emulation_theta(
    max_phase=cfg.rope_alibi_max_phase, max_len=cfg.rope_alibi_context or cfg.max_len
  )


class MLP(nnx.Module):
  """``D -> F -> GELU -> D``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.up = _dense(
      cfg, "BTD,DF->BTF", (cfg.d_model, cfg.mlp_size), (cfg.mlp_size,), ("embed", "mlp"), cfg.init_std, rngs
    )
    self.down = _dense(
      cfg, "BTF,FD->BTD", (cfg.mlp_size, cfg.d_model), (cfg.d_model,), ("mlp", "embed"), out_std, rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.up(x)
    # GELU on the [B*T, F] view (the same values): XLA CPU ran GELU's erfc and its gradient on the
    # [B, T, F] array about 2x slower, which doubled the MLP's forward + backward (B 8, T 512,
    # D 512: 1151 -> 593 ms per layer; benchmarks/ops_bench.py's "step part: mlp").
    flat = jax.nn.gelu(h.reshape(-1, h.shape[-1]), approximate=self.cfg.gelu_approximate)
    return self.down(flat.reshape(h.shape))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.attn_norm = _layer_norm(cfg, rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = _layer_norm(cfg, rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, mask, **attn_kwargs):
    h, new_kv = self.attn(self.attn_norm(x).astype(self.cfg.dtype), positions, mask, **attn_kwargs)
    x = x + h.astype(jnp.float32)
    x = x + self.mlp(self.mlp_norm(x).astype(self.cfg.dtype)).astype(jnp.float32)
    return x, new_kv


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

  def _build(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    self.cfg = cfg
    self.embed = nnx.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=cfg.dtype,
      embedding_init=_init(_token_embed_std(cfg), ("vocab", "embed")),
      rngs=rngs,
    )
    if cfg.pos_encoding == "learned":
      self.pos_embed = nnx.Embed(
        cfg.max_len,
        cfg.d_model,
        dtype=cfg.dtype,
        embedding_init=_init(cfg.init_std, ("pos", "embed")),
        rngs=rngs,
      )
    if cfg.embed_layernorm:
      self.embed_norm = _layer_norm(cfg, rngs)
    blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)]
    self.blocks = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.final_norm = _layer_norm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.lm_head = _dense(
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

    ``sinusoidal`` follows Vaswani et al. (arXiv 1706.03762, section 3.4) and fairseq's
    ``TransformerEncoder``: token embeddings initialised with std ``D ** -0.5`` and multiplied by
    ``sqrt(D)`` (unit scale, like the sinusoids), so neither drowns the other; ``learned`` adds its
    table; the relative encodings add nothing here.

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
    t_len = tokens.shape[1]
    # A traced id outside [0, V) embeds as NaN (jnp.take's fill mode), never as another token: negative
    # ids would otherwise wrap to V + id. The same for learned positions outside [0, max_len).
    x = self.embed(jnp.where(tokens < 0, cfg.vocab_size, tokens))
    if cfg.pos_encoding == "learned":
      if t_len > cfg.max_len:
        raise ValueError(
          f"sequence length {t_len} exceeds max_len={cfg.max_len} of the learned position table"
        )
      _checks.check_index_range("positions", positions, cfg.max_len, "max_len (learned position table)")
      x = x + self.pos_embed(jnp.where(positions < 0, cfg.max_len, positions))
    elif cfg.pos_encoding == "sinusoidal":
      x = x * math.sqrt(cfg.d_model) + sinusoidal.sinusoidal_embedding(
        positions, d_model=cfg.d_model, dtype=x.dtype
      )
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
    cache: KVCache | None = None,
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
      cache: a ``KVCache`` of this model's config (``init_cache(cfg, B, S)``) to append this chunk
        to (prefill or decode); it must have room for the T new tokens.

    Returns:
      ``[B, T, V]`` float32 logits, or ``(logits, new_cache)`` when ``cache`` is given.

    Raises:
      TypeError: non-integer tokens, positions or segment ids; a float mask; a cache that is no
        ``KVCache`` or holds arrays of the wrong dtype.
      ValueError: an argument not ``[B, T]`` (tokens; positions, mask, segment ids of the tokens'
        shape); B or T = 0; ids or positions out of range (when concrete); T beyond ``max_len`` for
        learned positions; T (or the cache's slots) beyond ``rope_alibi_context`` for
        ``rope_alibi``; segment ids together with a cache; a cache of another config, batch or
        layer count; a cache without room for T more tokens: checked at trace time from the
        static shapes (T > S) and, when ``cache.end`` is concrete, from it. Under ``jax.jit`` /
        ``nnx.jit`` a traced ``cache.end + T > S`` cannot raise at trace time: the call then fails
        when it runs (a ``JaxRuntimeError`` carrying this ValueError's message, from a host
        callback run only on overflow), never silently.
    """
    cfg = self.cfg
    tokens, positions, attention_mask, segment_ids = _check_call(
      cfg, tokens, positions, attention_mask, segment_ids, cache
    )
    batch, t_len = tokens.shape
    if cache is not None:
      _check_cache(cfg, cache, batch, t_len)
    _check_rope_alibi_span(cfg, t_len if cache is None else cache.positions.shape[1])
    if (
      cfg.pos_encoding == "rope_alibi"
      and positions is not None
      and not isinstance(positions, jax.core.Tracer)
    ):
      _check_rope_alibi_positions(cfg, positions, cache)
    valid = jnp.ones((batch, t_len), bool) if attention_mask is None else attention_mask.astype(bool)
    if positions is None:
      if segment_ids is not None:
        positions = positions_lib.positions_from_segment_ids(segment_ids)
      elif cache is not None:  # continue after the real tokens already cached
        prior = jnp.max(jnp.where(cache.valid, cache.positions + 1, 0), axis=1)
        positions = positions_lib.positions_from_mask(valid, start=prior)
      elif attention_mask is not None:
        positions = positions_lib.positions_from_mask(attention_mask)
      else:
        positions = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
    positions = positions.astype(jnp.int32)

    x = self.embed_inputs(tokens, positions)

    if cache is None:
      mask = attention.AttentionMask(
        valid=None if attention_mask is None else valid, segment_ids=segment_ids, causal=True
      )
      kv_positions, layer_caches = positions, None
    else:
      slots = cache.positions.shape[1]
      k_positions = jax.lax.dynamic_update_slice_in_dim(cache.positions, positions, cache.end, axis=1)
      k_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid, cache.end, axis=1)
      q_index = cache.end + jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (batch, t_len))
      k_index = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
      mask = attention.make_attention_mask(q_index, k_index, k_valid=k_valid)
      kv_positions, layer_caches = k_positions, (cache.k, cache.v)

    x, new_kv = self._blocks(
      x, positions, mask, kv_positions, layer_caches, cache_end=None if cache is None else cache.end
    )
    x = self.final_norm(x)
    if cfg.tie_embeddings:
      logits = jnp.einsum("BTD,VD->BTV", x, self.embed.embedding[...].astype(jnp.float32))
    else:
      logits = self.lm_head(x.astype(cfg.dtype)).astype(jnp.float32)
    if cache is None:
      return logits
    new_cache = KVCache(
      k=new_kv[0],
      v=new_kv[1],
      positions=kv_positions,
      valid=k_valid,
      end=cache.end + t_len,
    )
    return logits, new_cache

  def _blocks(self, x, positions, mask, kv_positions, layer_caches, *, cache_end):
    """The L blocks on the residual stream ``x [B, T, D]`` float32, pinned to the ``(batch,
    length, embed)`` sharding at every block boundary (``jaxpe.model.partitioning.constrain``).

    ``layer_caches``: None, or ``(k, v)`` tuples of L cache arrays. Returns ``(x, None or (k, v))``
    with the updated caches. ``scan_layers`` runs one block under ``nnx.scan`` over the stacked
    parameters (caches stacked to ``[L, ...]`` for it and split back); ``remat`` wraps each block
    in ``nnx.remat`` with the configured policy.
    """
    cfg = self.cfg

    def run(block, x, kv):
      x, new_kv = block(x, positions, mask, kv_positions=kv_positions, cache_kv=kv, cache_end=cache_end)
      return partitioning.constrain(x, partitioning.ACTIVATION), new_kv

    if cfg.remat != "none":
      policy = jax.checkpoint_policies.dots_saveable if cfg.remat == "dots_saveable" else None
      run = nnx.remat(run, policy=policy, prevent_cse=not cfg.scan_layers)
    x = partitioning.constrain(x, partitioning.ACTIVATION)
    if cfg.scan_layers:
      stacked = None if layer_caches is None else tuple(jnp.stack(c) for c in layer_caches)
      scan = nnx.scan(
        run,
        in_axes=(0, nnx.Carry, 0),
        out_axes=(nnx.Carry, 0),
        transform_metadata={nnx.PARTITION_NAME: "layers"},
      )
      x, new_kv = scan(self.blocks, x, stacked)
      if new_kv is None:
        return x, None
      return x, tuple(tuple(c[i] for i in range(cfg.num_layers)) for c in new_kv)
    new_k, new_v = [], []
    for i, block in enumerate(self.blocks):
      kv = None if layer_caches is None else (layer_caches[0][i], layer_caches[1][i])
      x, kv = run(block, x, kv)
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
