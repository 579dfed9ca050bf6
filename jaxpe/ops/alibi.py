"""ALiBi: attention with linear biases.

Source: Press, Smith and Lewis, "Train Short, Test Long: Attention with Linear Biases Enables Input
Length Extrapolation", arXiv 2108.12409; slopes as in the paper's code (ofirpress/attention_with_
linear_biases, ``get_slopes``), which BLOOM (HF ``build_alibi_tensor``) also follows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.positions import positions_from_mask


def alibi_slopes_f64(num_heads: int) -> np.ndarray:
  """ALiBi slopes in float64 on the host: ``alibi_slopes(num_heads, dtype=np.float64)``."""
  num_heads = _checks.check_positive_int("num_heads", num_heads, maximum=_checks.MAX_DIM)

  def power_of_2(n: int) -> list[float]:
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]

  closest = 2 ** math.floor(math.log2(num_heads))
  slopes = power_of_2(closest)
  if closest != num_heads:
    slopes += power_of_2(2 * closest)[0::2][: num_heads - closest]
  return np.asarray(slopes, dtype=np.float64)


def alibi_slopes(num_heads: int, *, dtype=jnp.float32) -> jax.Array | np.ndarray:
  """Per-head ALiBi slopes m_h.

  For ``n`` a power of two: ``m_h = 2 ** (-8 h / n)``, h = 1..n. Otherwise the paper's rule: the
  slopes for the largest power of two ``c < n``, then every other slope of ``2c`` heads.

  Args:
    num_heads: N, positive.
    dtype: ``jnp.float32`` (default): a float32 JAX array, what attention adds. ``np.float64``: a
      float64 numpy array (host; JAX without x64 cannot hold float64), e.g. for the emulation
      solvers (``jaxpe.solve_emulation``, ``jaxpe.emulation_amplitudes``), which take float64.

  Returns:
    ``[N]`` slopes (per token) of ``dtype``.

  Raises:
    ValueError: ``num_heads`` not in ``[1, 2^20]``.
    TypeError: ``num_heads`` not an int; ``dtype`` not float32 or float64 (also a ValueError).

  Source: Press et al. arXiv 2108.12409; ofirpress/attention_with_linear_biases ``get_slopes``.
  """
  slopes = alibi_slopes_f64(num_heads)
  if _checks.check_float_dtype("dtype", dtype, allowed=(np.float32, np.float64)) == np.float64:
    return slopes
  return jnp.asarray(slopes, jnp.float32)


def alibi_bias(slopes: jax.Array, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
  """ALiBi score bias ``-m_h * (i - j)`` for query position i and key position j.

  Keys after the query (j > i) get a positive bias; the causal mask removes them. Adding a per-row
  constant does not change softmax, so this equals BLOOM's ``+m_h * j`` form under a causal mask.

  Args:
    slopes: ``[N]`` float slopes, >= 0 (0 = no ALiBi on that head, see ``alibi_slopes_for_heads``).
    q_positions: ``[B, T]`` integer token indices of the queries.
    k_positions: ``[B, S]`` integer token indices of the keys.

  Returns:
    ``[B, N, T, S]`` float32 bias, added to ``q.k / sqrt(H)``.

  Raises:
    ValueError: wrong ranks, mismatched batch sizes, slopes negative or not finite, concrete
      positions negative or >= 2^31.
    TypeError: non-integer positions, non-real slopes, inputs that are not arrays of numbers.

  Under jit (traced positions, not checked) any int32 positions, negative ones included, give the
  bias of their difference, exact to float32 (one rounding of the integer distance).
  """
  slopes = _checks.check_slopes("slopes", slopes, allow_zero=True)
  q_positions, k_positions = _checks.check_position_pair(q_positions, k_positions, heads=slopes.shape[0])
  # Distances are exact integers; convert once to float32 (exact below 2**24).
  distance = (q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)  # [B, T, S]
  return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * distance[:, None, :, :]


def alibi_slopes_for_heads(num_heads: int, *, alibi_heads) -> jax.Array:
  """Slopes for ALiBi on a subset of heads; the other heads get slope 0 (no bias).

  The ALiBi heads take the slopes of an ``len(alibi_heads)``-head model, in the order given.

  Args:
    num_heads: N, positive.
    alibi_heads: the head indices (distinct, in ``[0, N)``) that use ALiBi, or an int ``k`` for the
      first k heads.

  Returns:
    ``[N]`` float32 slopes, 0 for heads without ALiBi. Use with ``alibi_bias_causal``,
    ``alibi_bias_symmetric`` or ``alibi_bias_bloom`` (which accept zero slopes).

  Raises:
    ValueError: ``num_heads`` not in ``[1, 2^20]``; ``alibi_heads`` empty, out of range or repeated.
    TypeError: ``alibi_heads`` neither an int nor a sequence of ints (a string, floats, a bool).

  Source: slopes from Press et al. arXiv 2108.12409; ALiBi on a subset of heads is jaxpe's own
  option (the paper applies it to every head).
  """
  num_heads = _checks.check_positive_int("num_heads", num_heads, maximum=_checks.MAX_DIM)

  def is_int(h):
    return isinstance(h, (int, np.integer)) and not isinstance(h, (bool, np.bool_))

  if is_int(alibi_heads):
    if not 0 < alibi_heads <= num_heads:
      raise ValueError(f"alibi_heads must be in [1, num_heads = {num_heads}], got {alibi_heads}")
    heads = list(range(int(alibi_heads)))
  else:
    seq = alibi_heads.tolist() if isinstance(alibi_heads, np.ndarray | jax.Array) else alibi_heads
    if not isinstance(seq, (list, tuple, range)) or not all(is_int(h) for h in seq):
      raise _checks.ArgTypeError(
        f"alibi_heads must be an int k (the first k heads) or a sequence of int head indices, got {alibi_heads!r}"
      )
    heads = [int(h) for h in seq]
    if not heads or len(set(heads)) != len(heads) or min(heads) < 0 or max(heads) >= num_heads:
      raise ValueError(
        f"alibi_heads must be distinct head indices in [0, {num_heads}), at least one, got {list(alibi_heads)}"
      )
  slopes = np.zeros(num_heads, np.float64)
  slopes[heads] = alibi_slopes_f64(len(heads))
  return jnp.asarray(slopes, jnp.float32)


def alibi_bias_causal(slopes: jax.Array, *, q_len: int, k_len: int, q_offset=None) -> jax.Array:
  """ALiBi bias ``-m_h (i - j)`` for T queries that sit at key slots ``q_offset .. q_offset + T - 1``.

  For KV-cache decoding and chunked prefill: query t is at position ``q_offset + t`` of an S-key
  sequence (keys at positions ``0..S-1``). Keys after a query get a positive bias; mask them.

  Args:
    slopes: ``[N]`` float slopes, finite, >= 0 (0: no bias for that head).
    q_len: T, in ``[1, 2^31]``.
    k_len: S, in ``[1, 2^31]``, ``>= T``.
    q_offset: position of the first query; a Python int in ``[0, S - T]`` or a traced int scalar
      (e.g. the cache fill level). Default ``S - T`` (queries are the last T keys).

  Returns:
    ``[1, N, T, S]`` float32 bias, broadcastable to ``[B, N, T, S]``.

  Raises:
    ValueError: bad slopes, ``q_len``/``k_len`` not in ``[1, 2^31]``, ``k_len < q_len``, ``q_offset``
      out of range (a traced ``q_offset`` is not checked: the bias is that of its positions).
    TypeError: ``q_len``/``k_len`` not ints; ``q_offset`` not an int or integer scalar array.

  Source: Press et al. arXiv 2108.12409 (bias ``-m_h (i - j)``); the offset is the KV-cache
  position of the first query.
  """
  slopes = _checks.check_slopes("slopes", slopes, allow_zero=True)
  q_len = _checks.check_positive_int("q_len", q_len, maximum=_checks.MAX_POSITION)
  k_len = _checks.check_positive_int("k_len", k_len, maximum=_checks.MAX_POSITION)
  if k_len < q_len:
    raise ValueError(f"k_len ({k_len}) must be >= q_len ({q_len})")
  if q_offset is None:
    q_offset = k_len - q_len
  if isinstance(q_offset, (int, np.integer)) and not isinstance(q_offset, bool):
    if not 0 <= q_offset <= k_len - q_len:
      raise ValueError(f"q_offset must be in [0, k_len - q_len = {k_len - q_len}], got {q_offset}")
  elif not isinstance(q_offset, jax.Array | np.ndarray) or not jnp.issubdtype(q_offset.dtype, jnp.integer):
    raise _checks.ArgTypeError(f"q_offset must be an integer scalar (int or int array), got {q_offset!r}")
  elif jnp.ndim(q_offset) != 0:
    raise ValueError(f"q_offset must be an integer scalar, got shape {jnp.shape(q_offset)}")
  fix = "the bias is dense [1, N, T, S]: give smaller q_len / k_len, or attention with an AlibiSpec"
  _checks.check_dense_fits("q_len / k_len", (1, slopes.shape[0], q_len, k_len), np.float32, fix)
  q_pos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(q_len, dtype=jnp.int32)
  distance = (q_pos[:, None] - jnp.arange(k_len, dtype=jnp.int32)[None, :]).astype(jnp.float32)
  return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * distance[None, None, :, :]


def alibi_bias_bloom(slopes: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """BLOOM's ALiBi: a key-position bias ``+m_h * pos_j`` from the padding mask.

  ``pos_j = (cumsum(mask) - 1) * mask`` counts real tokens only, so left padding does not shift
  positions. Under a causal mask this equals ``-m_h (i - j)`` up to a per-row constant, which
  softmax ignores.

  Args:
    slopes: ``[N]`` float slopes, finite, >= 0.
    attention_mask: ``[B, S]`` bool/integer, 1 for real tokens.

  Returns:
    ``[B, N, 1, S]`` float32 bias, broadcastable to ``[B, N, T, S]`` (added unscaled to q.k/sqrt(H)).

  Raises:
    ValueError: wrong ranks or bad slopes.
    TypeError: ``attention_mask`` not bool/integer.

  Source: HF transformers ``models/bloom/modeling_bloom.py`` ``build_alibi_tensor``
  (arXiv 2211.05100).
  """
  slopes = _checks.check_slopes("slopes", slopes, allow_zero=True)
  pos = positions_from_mask(attention_mask).astype(jnp.float32)  # [B, S], BLOOM's rule
  return jnp.asarray(slopes, jnp.float32)[None, :, None, None] * pos[:, None, None, :]


def alibi_bias_symmetric(slopes: jax.Array, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
  """Bidirectional ALiBi ``-m_h |i - j|`` (encoders, e.g. MosaicBERT's ALiBi).

  Args:
    slopes: ``[N]`` float slopes, finite, >= 0.
    q_positions: ``[B, T]`` integer token indices (>= 0).
    k_positions: ``[B, S]`` integer token indices (>= 0).

  Returns:
    ``[B, N, T, S]`` float32 bias.

  Raises:
    ValueError: wrong ranks, mismatched batch sizes, bad slopes, negative positions.
    TypeError: non-integer positions.

  Source: Press et al. arXiv 2108.12409 (the distance form), symmetric as in MosaicBERT
  (Portes et al., arXiv 2312.17482).
  """
  slopes = _checks.check_slopes("slopes", slopes, allow_zero=True)
  q_positions, k_positions = _checks.check_position_pair(q_positions, k_positions, heads=slopes.shape[0])
  distance = jnp.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
  return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * distance[:, None, :, :]
