"""Autoregressive generation with the KV cache: greedy or sampled, batched with any padding.

The sampling rule (``generate``'s ``temperature``, ``top_k``, ``rng``):

- ``temperature == 0``: greedy, the argmax of the logits (the lowest token id among exact ties).
- ``0 < temperature < inf``: a sample from ``softmax(logits / temperature)`` restricted to the
  ``top_k`` largest logits (all V when ``top_k`` is None). The scaled logits are computed in float32
  as ``(logits - max) / temperature``, so they never overflow: a tiny temperature (down to the
  smallest float32, 1.4e-45; smaller ones are clamped to it) gives the greedy token, or one of the
  exactly tied maxima.
- ``temperature == inf``: uniform over the allowed set (the ``top_k`` largest logits, or all V).
- ``top_k`` picks exactly k ids (ties at the k-th logit broken towards the lower id, as
  ``jax.lax.top_k``) from the unscaled logits, so the set does not depend on the temperature.
- ``top_p`` (nucleus sampling, Holtzman et al., arXiv 1904.09751) then keeps the smallest set of the
  most probable allowed ids whose probability under the temperature-scaled softmax reaches
  ``top_p``, as transformers' ``TopPLogitsWarper`` (applied after ``TemperatureLogitsWarper`` and
  ``TopKLogitsWarper``, in that order): ids sorted by ascending probability (ties towards the lower
  id first), those whose cumulative probability is ``<= 1 - top_p`` removed, the most probable id
  always kept. ``top_p = 1`` keeps every allowed id.
- The same ``rng`` (and prompt, model, arguments) gives the same tokens; each decoding step splits
  the key once and every row draws its own sample from that split.

Stopping (``stop_tokens``, ``pad_token_id``): a row that generates one of ``stop_tokens`` (HF's
``eos_token_id``: an id or several) keeps that token and has ``pad_token_id`` (default: the first
stop token, as transformers when ``pad_token_id`` is None) in every later slot; decoding ends when
every row has stopped (no step runs for nothing), and the output keeps its ``[B, max_new_tokens]``
shape.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpe.model.cache import check_cache_fits, init_cache
from jaxpe.model.decoder import Decoder
from jaxpe.model.streaming import check_streaming, init_streaming_cache
from jaxpe.ops import checks as _checks

_MIN_TEMPERATURE = float(np.finfo(np.float32).smallest_subnormal)  # 1.4e-45


def _check_max_new_tokens(max_new_tokens) -> int:
  if not _checks.is_int(max_new_tokens):
    raise TypeError(f"max_new_tokens must be a Python int >= 1, got {max_new_tokens!r}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  return int(max_new_tokens)


def _check_temperature(temperature) -> float:
  if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
    raise TypeError(
      f"temperature must be a Python number in [0, inf] (0 = greedy), got {type(temperature).__name__} "
      f"{temperature!r}"
    )
  t = float(temperature)
  if math.isnan(t) or t < 0:
    raise ValueError(f"temperature must be in [0, inf] (0 = greedy, inf = uniform over top_k), got {t}")
  return t


def _check_top_k(top_k, vocab_size: int) -> int | None:
  if top_k is None:
    return None
  if not _checks.is_int(top_k):
    raise TypeError(f"top_k must be None or a Python int in [1, vocab_size={vocab_size}], got {top_k!r}")
  if not 1 <= top_k <= vocab_size:
    raise ValueError(f"top_k must be in [1, vocab_size={vocab_size}], got {top_k}")
  return int(top_k)


def _check_top_p(top_p) -> float | None:
  if top_p is None:
    return None
  if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
    raise TypeError(f"top_p must be None or a Python number in (0, 1], got {type(top_p).__name__} {top_p!r}")
  p = float(top_p)
  if not 0.0 < p <= 1.0:  # NaN fails too
    raise ValueError(f"top_p must be in (0, 1] (the probability mass kept; 1 = all ids), got {p}")
  return p


def _check_token_ids(name: str, ids, vocab_size: int) -> tuple[int, ...]:
  """``ids`` (a Python or numpy int, or a sequence of them) as a tuple of ints in ``[0, V)``."""
  many = ids if isinstance(ids, list | tuple | np.ndarray) else [ids]
  if isinstance(ids, np.ndarray) and ids.ndim > 1:
    raise ValueError(f"{name} must be a token id or a 1-D sequence of them, got shape {ids.shape}")
  out = []
  for i in many:
    if not _checks.is_int(i):
      raise TypeError(f"{name} must be token ids (ints in [0, vocab_size={vocab_size})), got {ids!r}")
    if not 0 <= i < vocab_size:
      raise ValueError(f"{name} must be token ids in [0, vocab_size={vocab_size}), got {int(i)}")
    out.append(int(i))
  if not out:
    raise ValueError(f"{name} must name at least one token id (None: no stopping), got {ids!r}")
  return tuple(out)


def _check_rng(rng) -> jax.Array:
  """A scalar typed PRNG key (``jax.random.key``) or a legacy ``uint32[2]`` key (``PRNGKey``)."""
  if not isinstance(rng, jax.Array | np.ndarray):
    raise TypeError(f"rng must be a PRNG key from jax.random.key(seed), got {type(rng).__name__}")
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.shape != ():
      raise ValueError(f"rng must be one PRNG key (shape ()), got a key array of shape {rng.shape}")
    return rng
  if rng.dtype == np.uint32 and rng.shape == (2,):
    return jax.random.wrap_key_data(jnp.asarray(rng))
  raise TypeError(
    f"rng must be a PRNG key from jax.random.key(seed) (or a legacy uint32[2] PRNGKey), got "
    f"{rng.dtype}{list(rng.shape)}"
  )


def _check_prompt_mask(prompt, attention_mask, vocab_size: int):
  """Returns ``(prompt int32 [B, T], mask bool [B, T])``."""
  prompt = _checks.as_array("prompt", prompt)  # a ragged list or strings: a TypeError naming prompt
  _checks.check_rank("prompt", prompt, 2, "[B, T]")
  dtype = jnp.result_type(prompt)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"prompt must hold integer token ids, got dtype {dtype}")
  if prompt.shape[0] == 0 or prompt.shape[1] == 0:
    raise ValueError(
      f"prompt must hold at least one token in at least one row (B, T >= 1), got shape {prompt.shape}"
    )
  _checks.check_index_range("prompt", prompt, vocab_size, "vocab_size")
  prompt = jnp.asarray(prompt).astype(jnp.int32)
  if attention_mask is None:
    return prompt, jnp.ones(prompt.shape, bool)
  if not isinstance(attention_mask, jax.Array | np.ndarray):
    attention_mask = np.asarray(attention_mask)
  mdtype = jnp.result_type(attention_mask)
  if not (mdtype == jnp.bool_ or jnp.issubdtype(mdtype, jnp.integer)):
    raise TypeError(
      f"attention_mask must be bool or integer (1 = real token, 0 = padding), got dtype {mdtype}"
    )
  if tuple(attention_mask.shape) != tuple(prompt.shape):
    raise ValueError(
      f"attention_mask must have the prompt's shape [B, T] = {tuple(prompt.shape)}, got "
      f"{tuple(attention_mask.shape)}"
    )
  if not isinstance(attention_mask, jax.core.Tracer):
    arr = np.asarray(attention_mask)
    if mdtype != jnp.bool_ and not np.all((arr == 0) | (arr == 1)):
      raise ValueError(f"attention_mask must hold 0 (padding) or 1 (real token), got values {np.unique(arr)}")
    empty = np.flatnonzero(~arr.astype(bool).any(axis=1))
    if empty.size:
      raise ValueError(
        f"attention_mask rows {empty.tolist()} hold no real token; every row needs at least one"
      )
  return prompt, jnp.asarray(attention_mask).astype(bool)


def generate(
  model: Decoder,
  prompt: jax.Array,
  *,
  max_new_tokens: int,
  attention_mask: jax.Array | None = None,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  stop_tokens: int | tuple[int, ...] | list[int] | None = None,
  pad_token_id: int | None = None,
  rng: jax.Array | None = None,
  streaming: tuple[int, int] | None = None,
) -> jax.Array:
  """Prefills a KV cache with the prompt, then decodes one token at a time (sampling rule: the
  module docstring).

  Works for every ``Decoder`` configuration (loop or ``scan_layers``, any ``remat``, every
  ``pos_encoding``, grouped-query attention): a scanned model gives the tokens of the loop model
  with the same weights.

  Args:
    model: a ``Decoder``.
    prompt: ``[B, T]`` integer token ids in ``[0, V)``, B, T >= 1.
    max_new_tokens: Python int >= 1, the number of tokens to generate.
    attention_mask: ``[B, T]`` bool, or integer 0/1: 0 marks padding. Left, right or inner padding
      all give the tokens of the unpadded row (positions count real tokens only; the first new token
      follows the row's last real token). Every row needs a real token. Default: all ones.
      Sliding-window and chunked layers (``layer_types``) count slots, padding included (as
      transformers' ``cache_position``): there left padding still gives the unpadded row's tokens
      under a sliding window, but right or inner padding within a window of the new tokens, and any
      padding under chunks, changes them.
    temperature: Python number in ``[0, inf]``: 0 = greedy, inf = uniform over the ``top_k`` set.
    top_k: None (all V ids) or a Python int in ``[1, V]``.
    top_p: None or a Python number in ``(0, 1]``: nucleus sampling's probability mass (after
      ``top_k``; the module docstring); ignored (but checked) for greedy decoding.
    stop_tokens: None, or a token id or a sequence of them in ``[0, V)`` (HF ``eos_token_id``): a
      row stops after generating one (the module docstring).
    pad_token_id: an id in ``[0, V)`` written after a row's stop token; default the first of
      ``stop_tokens``. Only with ``stop_tokens``.
    rng: a scalar PRNG key (``jax.random.key(seed)``, or a legacy ``uint32[2]`` key); required when
      ``temperature > 0``, ignored (but checked) for greedy decoding.
    streaming: None, or ``(start_size, recent_size)``: StreamingLLM (Xiao et al., arXiv 2309.17453;
      mit-han-lab/streaming-llm's ``StartRecentKVCache``): the cache keeps the first ``start_size``
      tokens (attention sinks) and the last ``recent_size`` (this step's included), positions
      assigned inside the cache (``jaxpe.model.streaming``), memory O(start_size + recent_size) per
      layer whatever ``max_new_tokens``. The prompt's first ``start_size + recent_size`` tokens are
      prefilled in one chunk, the rest fed one at a time. ``pos_encoding='rope'`` models with global
      layers only; no padding (``attention_mask`` all ones).

  Returns:
    ``[B, max_new_tokens]`` int32 generated tokens (after a row's stop token: ``pad_token_id``).

  Raises:
    TypeError: ``model`` not a ``Decoder``; a non-integer prompt; a float attention mask; a
      non-int ``max_new_tokens`` or ``top_k``; a non-number ``temperature``; an ``rng`` that is no
      PRNG key.
    ValueError: prompt not ``[B, T]`` with B, T >= 1; prompt ids outside ``[0, V)`` or a mask with
      values other than 0/1 or a row without real tokens (checked when concrete; under ``jax.jit``
      an id outside ``[0, V)`` embeds as NaN and makes the row's logits NaN; a traced all-padding row decodes from no context: its prompt's attention
      output is zeros); a mask not of the prompt's shape; ``max_new_tokens < 1``;
      ``T + max_new_tokens`` beyond ``max_len`` for learned positions, beyond ``rope_alibi_context``
      for ``rope_alibi``, or beyond 2^31 - 1 (int32 positions); a KV cache of ``T +
      max_new_tokens`` slots larger than the device's memory (checked before anything is
      allocated: ``jaxpe.model.cache.cache_bytes``); a NaN or negative temperature;
      ``top_k`` outside ``[1, V]``; ``top_p`` outside ``(0, 1]``; ``stop_tokens`` /
      ``pad_token_id`` outside ``[0, V)`` (TypeError: not ints), ``stop_tokens`` empty,
      ``pad_token_id`` without ``stop_tokens``; sampling without ``rng``; an ``rng`` holding several
      keys; ``streaming`` not two ints with ``start_size >= 0``, ``recent_size >= 1``, on a model it
      does not run (``jaxpe.model.streaming.check_streaming``: named), or with padding in
      ``attention_mask`` (or a traced one).

  Source: the sampling warpers and stopping of HF transformers' ``generate``
  (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``eos_token_id`` /
  ``pad_token_id``), tested against them.
  """
  if not isinstance(model, Decoder):
    raise TypeError(f"model must be a jaxpe.model.Decoder, got {type(model).__name__}")
  cfg = model.cfg
  max_new_tokens = _check_max_new_tokens(max_new_tokens)
  temperature = _check_temperature(temperature)
  top_k = _check_top_k(top_k, cfg.vocab_size)
  top_p = _check_top_p(top_p)
  stops = None if stop_tokens is None else _check_token_ids("stop_tokens", stop_tokens, cfg.vocab_size)
  if pad_token_id is not None:
    if stops is None:
      raise ValueError("pad_token_id is written after a stop token: pass stop_tokens too (or leave it None)")
    pad_token_id = _check_token_ids("pad_token_id", pad_token_id, cfg.vocab_size)[0]
  stopping = None if stops is None else (stops, stops[0] if pad_token_id is None else pad_token_id)
  prompt, mask = _check_prompt_mask(prompt, attention_mask, cfg.vocab_size)
  if streaming is not None:
    streaming = check_streaming(cfg, streaming)
    if attention_mask is not None and (isinstance(mask, jax.core.Tracer) or not bool(jnp.all(mask))):
      raise ValueError(
        "streaming runs rows without padding (positions are assigned inside the cache): give an "
        "attention_mask of all ones, or none (a traced attention_mask is refused too)"
      )
  limits = {
    "learned": ("max_len", cfg.max_len),
    "rope_alibi": ("rope_alibi_context", cfg.rope_alibi_context or cfg.max_len),
  }
  name, limit = limits.get(cfg.pos_encoding, ("int32 positions", 2**31 - 1))
  if streaming is not None:
    name = "2^31 - 1 (the int32 count of tokens fed to the streaming cache)"

  if prompt.shape[1] + max_new_tokens > limit:
    raise ValueError(
      f"prompt length T + max_new_tokens must be <= {name} ({limit}) for pos_encoding={cfg.pos_encoding!r}, "
      f"got T={prompt.shape[1]} + max_new_tokens={max_new_tokens}"
    )
  slots = prompt.shape[1] + max_new_tokens
  if streaming is not None:  # C slots of unrotated keys and values per layer, whatever the length
    check_cache_fits(
      cfg, prompt.shape[0], sum(streaming), "streaming", "give a smaller start_size + recent_size"
    )
  else:
    check_cache_fits(
      cfg, prompt.shape[0], slots, "max_new_tokens",
      f"T + max_new_tokens = {prompt.shape[1]} + {max_new_tokens} slots per row: generate fewer tokens "
      f"(or fewer rows)",
    )  # fmt: skip
  if rng is not None:
    rng = _check_rng(rng)
  elif temperature > 0:
    raise ValueError("rng is required when temperature > 0 (pass jax.random.key(seed))")
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  sampling = (temperature, top_k, top_p)
  if streaming is not None:
    return _generate_streaming(graphdef, state, prompt, rng, max_new_tokens, sampling, stopping, streaming)
  return _generate(graphdef, state, prompt, mask, rng, max_new_tokens, sampling, stopping)


def _nucleus(scaled: jax.Array, top_p: float) -> jax.Array:
  """``[B, V]`` bool: the ids ``TopPLogitsWarper`` keeps of the scaled logits (``-inf`` = not
  allowed): sorted ascending (stable: ties lower id first), cumulative softmax ``<= 1 - top_p``
  removed, the most probable kept."""
  order = jnp.argsort(scaled, axis=-1, stable=True)  # ascending
  probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
  remove = jnp.cumsum(probs, axis=-1) <= jnp.float32(1.0 - top_p)
  remove = remove.at[:, -1].set(False)
  rows = jnp.arange(scaled.shape[0])[:, None]
  return jnp.ones(scaled.shape, bool).at[rows, order].set(~remove)


def warp_logits(
  logits: jax.Array, temperature: float, top_k: int | None, top_p: float | None = None
) -> jax.Array:
  """``logits [B, V]`` as the sampling rule of this module draws from them: ``[B, V]`` float32,
  ``-inf`` at the ids ``top_k`` / ``top_p`` remove, the softmax of the rest the sampling
  distribution (transformers' ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` ->
  ``TopPLogitsWarper``, shifted by the row maximum). For ``0 < temperature <= inf``."""
  logits = logits.astype(jnp.float32)
  allowed = None
  if top_k is not None and top_k < logits.shape[-1]:
    idx = jax.lax.top_k(logits, top_k)[1]  # [B, k], from the unscaled logits
    allowed = jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None], idx].set(True)
  if math.isinf(temperature):
    scaled = jnp.zeros_like(logits)
  else:
    # <= 0 everywhere, 0 at the maxima: no overflow for any temperature, tiny ones give greedy
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    scaled = shifted / jnp.float32(max(temperature, _MIN_TEMPERATURE))
  if allowed is not None:
    scaled = jnp.where(allowed, scaled, -jnp.inf)
  if top_p is not None and top_p < 1.0:
    scaled = jnp.where(_nucleus(scaled, top_p), scaled, -jnp.inf)
  return scaled


def pick(
  logits: jax.Array, rng: jax.Array, temperature: float, top_k: int | None, top_p: float | None = None
) -> jax.Array:
  """One token per row of ``logits [B, V]`` by the sampling rule of this module: ``[B]`` int32."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, warp_logits(logits, temperature, top_k, top_p), axis=-1).astype(
    jnp.int32
  )


@jax.jit(static_argnums=(5, 6, 7))
def _generate(graphdef, state, prompt, mask, rng, max_new_tokens, sampling, stopping):
  """The whole generation as one compiled program per (shapes, sampling and stopping arguments): the
  prefill, then a ``lax.while_loop`` of decode steps that carries the cache (made here, so it is
  updated in place) and ends when ``max_new_tokens`` are out or every row has stopped."""
  model = nnx.merge(graphdef, state)
  batch, t_len = prompt.shape
  # end as a concrete 0: the decoder knows the cache is empty and prefills with self-attention on the
  # fast path (the CPU kernel, a fused kernel) instead of attending over every slot
  cache = init_cache(model.cfg, batch, t_len + max_new_tokens)._replace(end=np.zeros((), np.int32))
  # the first new token follows the last real token of each row (right padding: not slot T - 1);
  # only that token's logits are computed
  last = t_len - 1 - jnp.argmax(mask[:, ::-1], axis=1)
  logits, cache = model(prompt, attention_mask=mask, cache=cache, logits_index=last)
  return _decode(graphdef, state, logits, cache, rng, max_new_tokens, sampling, stopping)


@jax.jit(static_argnums=(4, 5, 6, 7))
def _generate_streaming(graphdef, state, prompt, rng, max_new_tokens, sampling, stopping, sizes):
  """``_generate`` on a ``StreamingCache`` of ``sizes = (start_size, recent_size)``: the prompt's
  first ``min(T, C)`` tokens as one chunk, the rest one token at a time (a ``fori_loop``)."""
  model = nnx.merge(graphdef, state)
  batch, t_len = prompt.shape
  cache = init_streaming_cache(model.cfg, batch, *sizes)
  cache = dataclasses.replace(cache, end=np.zeros((), np.int32))  # concrete: the chunk fits (check_chunk)
  first = min(t_len, sum(sizes))
  logits, cache = model(prompt[:, :first], cache=cache, logits_index=jnp.full((batch,), first - 1))

  def feed(i, carry):
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # as _decode's step
    return model(jax.lax.dynamic_slice_in_dim(prompt, i, 1, axis=1), cache=carry[1])

  if t_len > first:
    logits, cache = jax.lax.fori_loop(first, t_len, feed, (logits, cache))
  return _decode(graphdef, state, logits, cache, rng, max_new_tokens, sampling, stopping)


def _decode(graphdef, state, logits, cache, rng, max_new_tokens, sampling, stopping):
  """The decode loop after the prefill's ``logits [B, 1, V]``: ``[B, max_new_tokens]`` tokens."""
  batch = logits.shape[0]
  rng, sub = jax.random.split(rng)
  first = pick(logits[:, 0], sub, *sampling)
  stops, pad = stopping if stopping is not None else ((), 0)

  def stopped(token):  # [B] bool: the row generated a stop token
    return jnp.isin(token, jnp.asarray(stops, jnp.int32)) if stops else jnp.zeros(token.shape, bool)

  out = jnp.full((batch, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)

  def cond(carry):
    i, _, _, _, done, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def step(carry):
    i, token, cache, rng, done, out = carry
    # A model whose Variables are made at this trace level: nnx.scan / nnx.remat (scan_layers, remat)
    # refuse Variables of the enclosing jit's level ("different trace level").
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    logits, cache = model(token[:, None], cache=cache)
    rng, sub = jax.random.split(rng)
    nxt = jnp.where(done, jnp.int32(pad), pick(logits[:, -1], sub, *sampling))
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (jnp.int32(0), i))
    return i + 1, nxt, cache, rng, done | stopped(nxt), out

  carry = (jnp.int32(1), first, cache, rng, stopped(first), out)
  return jax.lax.while_loop(cond, step, carry)[-1]
