"""``pos_encoding='rope_alibi'``: ALiBi emulated by rotation (``jaxpe.emulation``): each head gets
k extra dims rotated at theta..k theta whose scores follow the ALiBi bias within
``rope_alibi_context``; bias-free attention kernels then run ALiBi models. The in-projection form
(``rope_alibi_in_projection``, for converted checkpoints) realises the two fixed dims of order 1 in
the q/k projection biases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpe import emulation
from jaxpe.model.encodings.base import CachedSlots, PositionalEncoding, emulation_theta, register
from jaxpe.ops import alibi, rope


@register("rope_alibi")
class RopeAlibi(PositionalEncoding):
  """q, k ``[.., H]`` -> ``[.., H + 2k]`` float32 (``apply_rope_alibi``, slopes of N heads, order
  ``rope_alibi_order``, theta ``emulation_theta(cfg)``); keys are cached augmented, in float32. With
  ``rope_alibi_content_rope`` the content dims rotate at ``cfg.rope_frequencies()`` (the hybrid)."""

  def qk_extra_dims(self) -> int:
    return 2 if self.cfg.rope_alibi_in_projection else 0

  def init_qk(self, q: nnx.Einsum, k: nnx.Einsum) -> None:
    """In-projection form: the two extra dims get zero kernel columns; the biases carry
    ``q_fixed = (-N_h, 0)`` (the emulation amplitude of head h) and ``k_fixed = (0, 1)``."""
    cfg = self.cfg
    if not cfg.rope_alibi_in_projection:
      return
    n, h = cfg.num_heads, cfg.head_size
    amp = emulation.emulation_amplitudes(alibi.alibi_slopes_f64(n), head_dim=h, theta=emulation_theta(cfg))
    q_fixed = jnp.stack([-jnp.asarray(amp, jnp.float32), jnp.zeros((n,), jnp.float32)], axis=-1)
    q.kernel[...] = q.kernel[...].at[:, :, h:].set(0.0)
    k.kernel[...] = k.kernel[...].at[:, :, h:].set(0.0)
    q.bias[...] = q.bias[...].at[:, h:].set(q_fixed)
    k.bias[...] = k.bias[...].at[:, h:].set(jnp.asarray([0.0, 1.0], jnp.float32)[None, :])

  def encode_qk(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = self.cfg
    if cfg.rope_alibi_in_projection:
      # q, k already carry the two fixed dims (from the projection biases): rotate the last pair only.
      inv_freq = jnp.asarray([0.0] * (cfg.head_size // 2) + [emulation_theta(cfg)], jnp.float32)
      return (
        rope.apply_rope(q.astype(jnp.float32), positions, inv_freq=inv_freq, layout="interleaved"),
        rope.apply_rope(k.astype(jnp.float32), positions, inv_freq=inv_freq, layout="interleaved"),
      )
    content = {}
    if cfg.rope_alibi_content_rope:  # the hybrid: content dims at the RoPE config's frequencies
      inv_freq, factor = cfg.rope_frequencies()
      content = dict(
        content_inv_freq=inv_freq, content_layout=cfg.rope_layout, content_attention_factor=factor
      )
    return self._emulate(q, k, positions, **content)

  def encode_qk_nope(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A NoPE layer of the hybrid keeps the emulated ALiBi, its content at frequency 0."""
    return self._emulate(q, k, positions)

  def _emulate(self, q, k, positions, **content):
    cfg = self.cfg
    slopes = alibi.alibi_slopes_f64(cfg.num_heads)
    return emulation.apply_rope_alibi(
      q,
      k,
      positions,
      positions,
      slopes=slopes,
      theta=emulation_theta(cfg),
      order=cfg.rope_alibi_order,
      **content,
    )

  def cache_key(self) -> tuple[int, jnp.dtype]:
    """``(H + 2 k, float32)``: the augmented keys."""
    return self.cfg.head_size + 2 * self.cfg.rope_alibi_order, jnp.dtype(jnp.float32)

  def check_call(self, span: int, positions: jax.Array | None, cache: CachedSlots | None) -> None:
    """Refuses a sequence (or KV cache) longer than the context the emulation is tuned for: beyond
    it the emulated bias leaves ALiBi (it turns positive past the phase's quarter turn). Concrete
    positions must also keep every query-key distance (within the call, and against the cached
    positions) below ``rope_alibi_context``; traced ones cannot be checked (documented: keep
    distances within the context).

    Raises:
      ValueError: naming the span or the positions and ``rope_alibi_context``.
    """
    cfg = self.cfg
    context = cfg.rope_alibi_context or cfg.max_len
    if span > context:
      raise ValueError(
        f"pos_encoding='rope_alibi' follows ALiBi only within rope_alibi_context = {context} tokens, got a "
        f"sequence or KV cache of {span} tokens; build the model with a larger rope_alibi_context (or max_len)"
      )
    if positions is None or isinstance(positions, jax.core.Tracer):
      return
    p = np.asarray(positions)
    if p.size == 0:
      return
    lo, hi = int(p.min()), int(p.max())
    if cache is not None and not any(
      isinstance(x, jax.core.Tracer) for x in (cache.positions, cache.valid, cache.end)
    ):
      live = np.asarray(cache.valid, bool) & (np.arange(np.shape(cache.valid)[-1]) < int(cache.end))[None]
      cached = np.asarray(cache.positions)[live]  # the slots below end (a rolled-back cache's rest is dead)
      if cached.size:
        lo, hi = min(lo, int(cached.min())), max(hi, int(cached.max()))
    if hi - lo >= context:
      raise ValueError(
        f"positions span {lo}..{hi} ({hi - lo + 1} positions, with the KV cache's): pos_encoding='rope_alibi' "
        f"follows ALiBi only for distances below rope_alibi_context = {context}; build the model with a larger "
        "rope_alibi_context (or max_len)"
      )
