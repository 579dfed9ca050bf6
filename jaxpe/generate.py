"""Autoregressive generation with the KV cache: greedy or sampled, batched with left padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe import _checks
from jaxpe.model import Decoder, init_cache


def generate(
  model: Decoder,
  prompt: jax.Array,
  *,
  max_new_tokens: int,
  attention_mask: jax.Array | None = None,
  temperature: float = 0.0,
  top_k: int | None = None,
  rng: jax.Array | None = None,
) -> jax.Array:
  """Prefills the cache with the prompt, then decodes one token at a time.

  Args:
    model: a ``Decoder``.
    prompt: ``[B, T]`` integer token ids; rows shorter than T are *left*-padded.
    max_new_tokens: number of tokens to generate (> 0).
    attention_mask: ``[B, T]`` bool/int, 0 for the left padding. Default: all ones.
    temperature: 0 for greedy (argmax) decoding, else the softmax temperature (> 0).
    top_k: sample only among the k most likely tokens (None = all).
    rng: PRNG key, required when ``temperature > 0``.

  Returns:
    ``[B, max_new_tokens]`` int32 generated tokens.

  Raises:
    ValueError: bad shapes (including an empty prompt, T = 0), ``max_new_tokens <= 0``, prompt
      token ids outside ``[0, V)`` (checked when ``prompt`` is concrete), ``T + max_new_tokens >
      max_len`` for learned positions (the table has ``max_len`` rows) or ``> rope_alibi_context``
      for ``rope_alibi`` (the emulation follows ALiBi only within it), negative temperature,
      sampling without rng.
    TypeError: a non-integer prompt.
  """
  _checks.check_rank("prompt", prompt, 2, "[B, T]")
  if not jnp.issubdtype(jnp.result_type(prompt), jnp.integer):
    raise TypeError(f"prompt must hold integer token ids, got dtype {jnp.result_type(prompt)}")
  if prompt.shape[1] == 0:
    raise ValueError(f"prompt must hold at least one token (T >= 1), got shape {prompt.shape}")
  _checks.check_index_range("prompt", prompt, model.cfg.vocab_size, "vocab_size")
  if max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
  cfg = model.cfg
  limits = {
    "learned": ("max_len", cfg.max_len),
    "rope_alibi": ("rope_alibi_context", cfg.rope_alibi_context or cfg.max_len),
  }
  if cfg.pos_encoding in limits and prompt.shape[1] + max_new_tokens > limits[cfg.pos_encoding][1]:
    name, limit = limits[cfg.pos_encoding]
    raise ValueError(
      f"prompt length T + max_new_tokens must be <= {name} ({limit}) for pos_encoding={cfg.pos_encoding!r}, "
      f"got T={prompt.shape[1]} + max_new_tokens={max_new_tokens}"
    )
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if temperature > 0 and rng is None:
    raise ValueError("rng is required when temperature > 0")
  if top_k is not None and not 0 < top_k <= model.cfg.vocab_size:
    raise ValueError(f"top_k must be in [1, vocab_size={model.cfg.vocab_size}], got {top_k}")
  batch, t_len = prompt.shape
  mask = jnp.ones_like(prompt, bool) if attention_mask is None else jnp.asarray(attention_mask, bool)
  rng = jax.random.key(0) if rng is None else rng
  cache = init_cache(model.cfg, batch, t_len + max_new_tokens)
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt, mask, cache, rng, max_new_tokens, float(temperature), top_k)


def _pick(logits, rng, temperature, top_k):
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@jax.jit(static_argnums=(6, 7, 8))
def _generate(graphdef, state, prompt, mask, cache, rng, max_new_tokens, temperature, top_k):
  model = nnx.merge(graphdef, state)
  logits, cache = model(prompt, attention_mask=mask, cache=cache)
  rng, sub = jax.random.split(rng)
  first = _pick(logits[:, -1], sub, temperature, top_k)

  def step(carry, _):
    token, cache, rng = carry
    logits, cache = model(token[:, None], cache=cache)
    rng, sub = jax.random.split(rng)
    nxt = _pick(logits[:, -1], sub, temperature, top_k)
    return (nxt, cache, rng), token

  (last, _, _), tokens = jax.lax.scan(step, (first, cache, rng), None, length=max_new_tokens - 1)
  return jnp.concatenate([tokens.T, last[:, None]], axis=1) if max_new_tokens > 1 else last[:, None]
