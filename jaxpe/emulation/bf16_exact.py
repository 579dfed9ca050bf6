"""ALiBi's emulation term written so that every product is exact in a float32 accumulator.

Fused attention kernels (cuDNN flash attention, TPU splash, Pallas/Triton) read q and k in bf16
(or round float32 to TF32 / one bf16 pass) and accumulate ``q . k`` in float32. The emulation dims
of ``jaxpe.emulation`` carry values of size ``m sqrt(H) i`` (~1e5-1e6) whose products cancel down to
the ALiBi bias, so rounding them to bf16 costs whole logits. Here each such value is split into
bf16-exact parts over a few extra dims:

- ``split_bf16(x)``: a float32 value is the exact sum of three bf16 values (24 significant bits =
  3 x 8), ``x = x_1 + x_2 + x_3``.
- ``split_product_dims(q_extra, k_extra)``: for float32 dims with ``q_extra . k_extra = term``,
  the 9 cross products ``q_a k_b`` (a, b = 1..3) become 9 dims per original dim. A bf16 x bf16
  product has at most 16 significant bits, so it is exact in float32 (and TF32 / bf16 inputs read
  them unchanged); the sum equals the float32 product ``q k`` exactly before accumulation. Used for
  the rotated form (order k: 2k dims -> 18k dims).
- ``exact_alibi_dims(...)``: the augmented form ``-c (i - j)``, ``c = m / dot_scale``, with the
  slope split into three bf16 parts ``c_a`` and positions into base-256 digits ``I_b`` (exact bf16
  integers times a power of two). Per (a, b) three dims: q ``(c_a, -hi(c_a I_b), -lo(c_a I_b))``,
  k ``(J_b, 1, 1)`` (``c_a I_b`` has 16 bits, two bf16 parts). Summed in this order each group
  gives ``c_a (J_b - I_b)`` exactly; the groups go from the largest ``c_1 256^b`` down, so the
  running float32 sum stays near ``c (j - i)``: its rounding scales with the distance, as float32
  ALiBi's own ``-m d`` does, not with the absolute position. 9 dims per position digit: 18 dims for
  positions below 65536, 27 below 2^24.

Either layout is read by every kernel at its native precision without loss in the products; the
fused-kernel path of ``jaxpe.attention`` (``jaxpe.attention.fused``) places these dims after the
content dims, so the float32 accumulator sums the content at its own size before it meets them (an
accumulation-order assumption stated in the precision table of docs/results.md; measured with content in
``benchmarks/kernel_precision.py``: summed the other way the augmented form misses 1e-2 logits at
65536 positions). The lean form (``jaxpe.emulation.lean``, the kernels' default) needs 2..6 dims.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
E extra dims.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.emulation import lean
from jaxpe.emulation.ops import apply_augmented_alibi, apply_rope_alibi
from jaxpe.emulation.solver import emulation_theta
from jaxpe.ops import checks as _checks

# bf16 parts of one float32 value (8 significant bits each).
PARTS = 3
# Positions are split into base-2^8 digits, each an integer < 256, exact in bf16.
DIGIT_BITS = 8


def split_bf16(x: jax.Array, parts: int = PARTS) -> list[jax.Array]:
  """``x`` as a sum of ``parts`` bf16 values, each returned as a float32 array.

  Greedy round-to-nearest: ``x_1 = bf16(x)``, ``x_2 = bf16(x - x_1)``, ... Three parts represent
  every float32 exactly (the remainders are exact float32 subtractions).

  Args:
    x: float array of any shape.
    parts: number of parts, >= 1.

  Returns:
    ``parts`` float32 arrays shaped like ``x`` whose values are bf16-exact.

  Raises:
    ValueError: ``parts`` not a positive integer.
    TypeError: non-float ``x``.
  """
  parts = _checks.check_positive_int("parts", parts)
  _checks.check_float("x", x)
  rest = x.astype(jnp.float32)
  out = []
  for _ in range(parts):
    part = rest.astype(jnp.bfloat16).astype(jnp.float32)
    out.append(part)
    rest = rest - part
  return out


def split_product_dims(q_extra: jax.Array, k_extra: jax.Array) -> tuple[jax.Array, jax.Array]:
  """bf16-exact dims whose dot product is the float32 ``q_extra . k_extra``, product by product.

  Each of the E dims becomes 9 (parts ``q_a``, ``k_b``, a, b = 1..3), ordered by ``a + b`` (the
  large products first, the two components of a rotation pair next to each other).

  Args:
    q_extra: ``[B, T, N, E]`` float (float32 values; the emulation dims).
    k_extra: ``[B, S, K, E]`` float.

  Returns:
    ``(q_split [B, T, N, 9E], k_split [B, S, K, 9E])`` float32, every value bf16-exact.

  Raises:
    ValueError: E differs between q and k.
  """
  if q_extra.shape[-1] != k_extra.shape[-1]:
    raise ValueError(f"q_extra and k_extra need the same last dim E, got {q_extra.shape} and {k_extra.shape}")
  qs, ks = split_bf16(q_extra), split_bf16(k_extra)
  order = sorted(((a, b) for a in range(PARTS) for b in range(PARTS)), key=lambda ab: (sum(ab), ab))
  return (
    jnp.concatenate([qs[a] for a, _ in order], axis=-1),
    jnp.concatenate([ks[b] for _, b in order], axis=-1),
  )


def position_digits(max_position: int) -> int:
  """Number of base-256 digits of positions ``< max_position`` (1 up to 256, 2 up to 65536, 3 up to 2^24).

  Raises:
    ValueError: ``max_position`` not in 1..2^24.
  """
  max_position = _checks.check_positive_int("max_position", max_position)
  if max_position > 2**24:
    raise ValueError(f"max_position must be <= 2^24, got {max_position}")
  return max(1, math.ceil(math.log2(max_position) / DIGIT_BITS)) if max_position > 1 else 1


def exact_alibi_dim_count(max_position: int) -> int:
  """E of ``exact_alibi_dims``: ``9 x position_digits(max_position)`` (18 below 65536)."""
  return 3 * PARTS * position_digits(max_position)


def _slope_parts(slopes: np.ndarray) -> np.ndarray:
  """``[3, N]`` bf16-exact float64 parts whose sum is the slope to ~2^-26 relative."""
  rest = np.asarray(slopes, np.float64)
  parts = []
  for _ in range(PARTS):
    part = rest.astype(jnp.bfloat16).astype(np.float64)
    parts.append(part)
    rest = rest - part
  return np.stack(parts)


def exact_alibi_dims(
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  dot_scale: float,
  max_position: int,
  num_kv_heads: int,
) -> tuple[jax.Array, jax.Array]:
  """Extra q/k dims with ``q_extra . k_extra * dot_scale = -m_h (i - j)``, every product exact.

  Layout in the module docstring (``c = m / dot_scale`` in three bf16 parts, positions in
  base-256 digits, three dims per (part, digit), largest groups first).

  Args:
    q_positions: ``[B, T]`` integer token indices, ``< max_position``.
    k_positions: ``[B, S]`` integer token indices, ``< max_position``.
    slopes: ``[N]`` ALiBi slopes, concrete, finite, >= 0 (0 = no ALiBi on that head).
    dot_scale: the factor the kernel applies to ``q . k`` (``1/sqrt(H)``, or 1 when q is
      pre-scaled); finite, > 0.
    max_position: static bound on positions (sets the digit count); 1..2^24.
    num_kv_heads: K; the key dims are the same for every kv head.

  Returns:
    ``(q_extra [B, T, N, E], k_extra [B, S, K, E])`` float32, bf16-exact values,
    ``E = exact_alibi_dim_count(max_position)``.

  Raises:
    ValueError: bad slopes, dot_scale, max_position or num_kv_heads; concrete positions out of
      range.
    TypeError: non-integer positions.

  Source: ALiBi's bias (Press et al., arXiv 2108.12409) as a dot product (the augmented form of
  ``jaxpe.emulation.apply_augmented_alibi``), split into error-free bf16 products.
  """
  if isinstance(slopes, jax.core.Tracer):
    raise ValueError(_checks.traced_message("slopes"))
  slopes = np.asarray(slopes, np.float64)
  _checks.check_slopes("slopes", slopes, allow_zero=True)
  dot_scale = _checks.check_positive_float("dot_scale", dot_scale)
  num_kv_heads = _checks.check_positive_int("num_kv_heads", num_kv_heads)
  digits = position_digits(max_position)
  for name, pos in (("q_positions", q_positions), ("k_positions", k_positions)):
    _checks.check_rank(name, pos, 2, "[B, T]" if name[0] == "q" else "[B, S]")
    _checks.check_positions(name, pos)
    _checks.check_index_range(name, pos, max_position, "max_position")
  c_parts = jnp.asarray(_slope_parts(slopes / dot_scale), jnp.float32)  # [3, N]

  def digit_values(pos):  # [B, T] -> list of [B, T] float32 I_b = d_b 256^b, coarsest first
    pos = pos.astype(jnp.int32)
    return [
      ((pos >> (DIGIT_BITS * b)) & (2**DIGIT_BITS - 1)).astype(jnp.float32) * float(2 ** (DIGIT_BITS * b))
      for b in reversed(range(digits))
    ]

  qi, kj = digit_values(q_positions), digit_values(k_positions)
  batch, t_len, s_len = q_positions.shape[0], q_positions.shape[1], k_positions.shape[1]
  num_heads = slopes.shape[0]
  q_dims, k_dims = [], []
  one = jnp.ones((batch, s_len), jnp.float32)
  for a in range(PARTS):
    c = c_parts[a][None, None, :]  # [1, 1, N]
    for i_b, j_b in zip(qi, kj):
      prod = c * i_b[:, :, None]  # [B, T, N], 16 significant bits: exact in float32
      hi = prod.astype(jnp.bfloat16).astype(jnp.float32)
      q_dims += [jnp.broadcast_to(c, (batch, t_len, num_heads)), -hi, -(prod - hi)]
      k_dims += [j_b, one, one]
  q_extra = jnp.stack(q_dims, axis=-1)
  k_extra = jnp.broadcast_to(
    jnp.stack(k_dims, axis=-1)[:, :, None, :], (batch, s_len, num_kv_heads, len(k_dims))
  )
  return q_extra, k_extra


# ------------------------------------------------------------------------------------ hardware model

# Explicit mantissa bits of the input formats a matmul unit reads.
MANTISSA_BITS: dict[str, int] = {"bfloat16": 7, "tf32": 10, "float32": 23}


def round_mantissa(x, fmt: str) -> np.ndarray:
  """``x`` rounded (to nearest, ties to even) to the mantissa of ``fmt``, as float64 (host, numpy).

  Models how a matmul unit reads float32 inputs: bf16 (TPU default precision, bf16 kernels), TF32
  (NVIDIA default for float32 matmuls) or float32. Exponent range is not modelled (no overflow or
  subnormals at these magnitudes).

  Args:
    x: array-like of floats.
    fmt: ``"bfloat16"``, ``"tf32"`` or ``"float32"``.

  Returns:
    float64 array shaped like ``x``.

  Raises:
    ValueError: unknown ``fmt``.
  """
  if fmt not in MANTISSA_BITS:
    raise ValueError(f"fmt must be one of {tuple(MANTISSA_BITS)}, got {fmt!r}")
  bits = MANTISSA_BITS[fmt]
  mant, exp = np.frexp(np.asarray(x, np.float64))  # x = mant 2^exp, 0.5 <= |mant| < 1
  return np.ldexp(np.rint(np.ldexp(mant, bits + 1)), exp - bits - 1)


def float32_accumulated_dot(q_dims, k_dims, fmt: str) -> np.ndarray:
  """``sum_e q_e k_e`` as a matmul unit computes it: inputs read as ``fmt``, each product rounded to
  float32, summed in a float32 accumulator in dim order (host model, numpy).

  Args:
    q_dims: ``[T, N, E]`` float array-like (one query row per position, per head).
    k_dims: ``[S, E]`` (the same for every head) or ``[S, N, E]``.
    fmt: input format, see ``round_mantissa``.

  Returns:
    ``[T, S, N]`` float32 dot products.

  Raises:
    ValueError: E differs, or an unknown ``fmt``.
  """
  q = round_mantissa(q_dims, fmt)
  k = round_mantissa(k_dims, fmt)
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q_dims and k_dims need the same last dim E, got {q.shape} and {k.shape}")
  k = k[:, None, :] if k.ndim == 2 else k
  acc = np.zeros((q.shape[0], k.shape[0], q.shape[1]), np.float32)
  for e in range(q.shape[-1]):
    acc = acc + (q[:, None, :, e] * k[None, :, :, e]).astype(np.float32)
  return acc


def alibi_term_dims(
  form: str,
  q_positions,
  k_positions,
  *,
  slopes,
  head_dim: int,
  max_len: int,
  order: int = 1,
  max_phase: float = 0.1,
  representation: str = "bf16_exact",
) -> tuple[np.ndarray, np.ndarray]:
  """The extra q/k dims that carry ALiBi's term, as the backends build them (host copy, float64).

  ``q . k / sqrt(H)`` over these dims is the emulated bias (``form="lean"``: ``m (j - j0)``, ALiBi
  plus the per-row constant ``m (i - j0)``, ``j0 = (min(k_positions) + max(k_positions)) // 2``;
  ``"float32"``: one dim ``c``, ``j - j0``; ``"bf16_exact"``: ``lean_alibi_dims``). ``form="exact"``: the augmented form
  (``representation="float32"``: ``apply_augmented_alibi``'s two float32 dims, what ``xla`` used
  before; ``"bf16_exact"``: ``exact_alibi_dims``). ``form="rotated"``: ``apply_rope_alibi`` of
  ``order`` with ``theta = max_phase / max_len`` (``"float32"``: its 2k dims, what ``xla``
  contracts at HIGHEST; ``"bf16_exact"``: ``split_product_dims`` of them, what fused kernels read).

  Args:
    form: ``"lean"``, ``"exact"`` or ``"rotated"``.
    q_positions: ``[T]`` integer token indices.
    k_positions: ``[S]`` integer token indices.
    slopes: ``[N]`` ALiBi slopes, > 0.
    head_dim: H (score scale ``1/sqrt(H)``).
    max_len: context (digit count of the exact form; theta of the rotated form).
    order: k of the rotated form.
    max_phase: largest phase of the rotated form (radians).
    representation: ``"float32"`` or ``"bf16_exact"``.

  Returns:
    ``(q [T, N, E], k [S, E])`` float64.

  Raises:
    ValueError: unknown form or representation; head_dim not a positive int; positions not rank 1,
      negative or >= 2^31; as the builders.
    TypeError: non-integer positions.
  """
  if representation not in ("float32", "bf16_exact"):
    raise ValueError(f"representation must be 'float32' or 'bf16_exact', got {representation!r}")
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  slopes = np.asarray(slopes, np.float64)
  positions = []
  for name, pos in (("q_positions", q_positions), ("k_positions", k_positions)):
    pos = np.asarray(pos)
    _checks.check_rank(name, pos, 1, "[T]" if name[0] == "q" else "[S]")
    _checks.check_positions(name, pos)
    positions.append(jnp.asarray(pos, jnp.int32)[None])
  qp, kp = positions
  num_heads = slopes.shape[0]
  if form == "lean":
    if representation == "bf16_exact":
      q_e, k_e = lean.lean_alibi_dims(
        qp, kp, slopes=slopes, dot_scale=1 / math.sqrt(head_dim), max_position=max_len, num_kv_heads=1
      )
    else:
      c = jnp.asarray(slopes * math.sqrt(head_dim), jnp.float32)
      q_e = jnp.broadcast_to(c[None, None, :, None], (1, qp.shape[1], num_heads, 1))
      k_e = (kp - (jnp.min(kp) + jnp.max(kp)) // 2).astype(jnp.float32)[:, :, None, None]
  elif form == "exact" and representation == "bf16_exact":
    q_e, k_e = exact_alibi_dims(
      qp, kp, slopes=slopes, dot_scale=1 / math.sqrt(head_dim), max_position=max_len, num_kv_heads=1
    )
  elif form in ("exact", "rotated"):
    zq = jnp.zeros((1, qp.shape[1], num_heads, head_dim), jnp.float32)
    zk = jnp.zeros((1, kp.shape[1], 1, head_dim), jnp.float32)
    if form == "exact":
      q_aug, k_aug = apply_augmented_alibi(zq, zk, qp, kp, slopes=slopes)
    else:
      theta = emulation_theta(max_phase=max_phase, max_len=max_len)
      q_aug, k_aug = apply_rope_alibi(zq, zk, qp, kp, slopes=slopes, theta=theta, order=order)
    q_e, k_e = q_aug[..., head_dim:], k_aug[..., head_dim:]
    if representation == "bf16_exact":
      q_e, k_e = split_product_dims(q_e, k_e)
  else:
    raise ValueError(f"form must be 'lean', 'exact' or 'rotated', got {form!r}")
  return np.asarray(q_e[0], np.float64), np.asarray(k_e[0, :, 0], np.float64)
