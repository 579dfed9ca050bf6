"""xPos: RoPE with an exponential decay that keeps attention scores relative.

Sun et al., "A Length-Extrapolatable Transformer", arXiv 2212.10554; reference code
microsoft/torchscale ``torchscale/component/xpos_relative_position.py`` (``XPOS``).

Pair i of a query at position n is multiplied by ``zeta_i ** (n / scale_base)`` and pair i of a key
at position m by ``zeta_i ** (-m / scale_base)``, with ``zeta_i = (2i / R + gamma) / (1 + gamma)``
(torchscale: ``(arange(0, R, 2) + 0.4 R) / (1.4 R)``). The score of the pair then carries
``zeta_i ** ((n - m) / scale_base)``: it depends only on the distance, and decays with it.
The rotation is RoPE (``jaxpe.ops.rope.apply_rope``) with the same inv_freq and pair layout.

Far positions. The scales are computed relative to a reference position, ``offset``:
``zeta_i ** ((n - offset) / scale_base)`` and ``zeta_i ** (-(m - offset) / scale_base)``. Their
product is ``zeta_i ** ((n - m) / scale_base)`` whatever the offset, so the score is unchanged, but
each scale alone is a float32 number only while ``|p - offset| * |log zeta_0| / scale_base <= 87``
(``xpos_window``; 35,556 positions at gamma 0.4, scale_base 512). ``p - offset`` is an exact int32
difference, so the scales (and, with RoPE's exact phases, the outputs) at positions near 10^9 with
an offset near them are bit-identical to those at the same positions shifted towards 0 with the
shifted offset: the result depends only on ``p - offset``.

The reference code does the same: torchscale's ``XPOS.forward`` centres the positions of each call
at ``min_pos = -(length + offset) // 2`` and decodes incrementally by giving queries and keys the
same centre. jaxpe does not pick a per-call centre by default, because a query call and a key call
with different position arrays (a KV cache, the decay test of two single positions) would then get
different centres and a wrong product without any sign of it. Instead ``offset`` is one explicit
integer shared by queries and keys (default 0), and positions outside its window are refused:

* concrete positions (eager calls): ``ValueError`` naming the window and the offset to pass (the
  centre ``(min + max) // 2`` of all query and key positions);
* traced positions (under ``jax.jit``): the pairs whose scale would leave float32's normal range
  become NaN (instead of a silent 0 or inf), so a bad offset shows in the scores.

``jaxpe.Decoder`` uses ``offset = max_len // 2`` with ``max_len <= 65536``, inside the window.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.layouts import REQUIRED, Layout, check_layout
from jaxpe.ops.rope import _batch_positions, apply_rope, rope_inv_freq


def xpos_zeta(rotary_dim: int, *, gamma: float = 0.4) -> np.ndarray:
  """Per-pair decay bases ``zeta_i = (2i / R + gamma) / (1 + gamma)``, i < R/2, in float64.

  Args:
    rotary_dim: R, even and positive.
    gamma: > 0; 0.4 in the paper and torchscale.

  Returns:
    ``[R/2]`` float64 numbers in ``(0, 1)``.

  Raises:
    ValueError: odd or non-positive ``rotary_dim``; ``gamma`` not a finite number > 0.
  """
  rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True, maximum=_checks.MAX_DIM)
  gamma = _checks.check_positive_float("gamma", gamma)
  return (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim + gamma) / (1.0 + gamma)


# The largest |exponent| of a scale: float32's normal range is [e^-87.3, e^88.7].
_MAX_EXPONENT = 87.0


def xpos_window(*, rotary_dim: int, scale_base: float = 512.0, gamma: float = 0.4) -> int:
  """The largest ``|p - offset|`` (token positions) whose xPos scales are normal float32 numbers.

  ``floor(87 * scale_base / |log zeta_0|)``, ``zeta_0 = gamma / (1 + gamma)`` the smallest decay base:
  35,556 for the paper's gamma 0.4 and scale_base 512 (any R). Queries and keys whose positions all lie
  within ``offset +- xpos_window(...)`` get finite scales whose product is the exact distance decay.

  Raises:
    ValueError: as ``xpos_zeta`` and ``xpos_scale`` (``scale_base``).
  """
  scale_base = _checks.check_positive_float("scale_base", scale_base)
  log_zeta = np.log(xpos_zeta(rotary_dim, gamma=gamma))
  return int(math.floor(_MAX_EXPONENT * scale_base / float(np.max(np.abs(log_zeta)))))


def xpos_scale(
  positions: jax.Array,
  *,
  rotary_dim: int,
  kind: Literal["query", "key"],
  scale_base: float = 512.0,
  gamma: float = 0.4,
  offset: int = 0,
) -> jax.Array:
  """xPos scale per pair: ``zeta ** ((p - offset) / scale_base)`` for queries, its inverse for keys.

  Args:
    positions: ``[B, T]`` integer token indices (>= 0).
    rotary_dim: R, even, positive.
    kind: ``"query"`` (scale up) or ``"key"`` (scale down, the inverse).
    scale_base: > 0, positions per e-fold of the exponent; 512 in the paper.
    gamma: > 0, see ``xpos_zeta``.
    offset: the reference position, an integer in ``[0, 2^31)`` subtracted (exactly, in int32)
      from every position before exponentiation. Give queries and keys the same offset: it cancels
      in the score. Every ``|p - offset|`` must be ``<= xpos_window(...)`` (35,556 at the defaults);
      for far positions pass one near them, e.g. the centre of all query and key positions.

  Returns:
    ``[B, T, 1, R/2]`` float32, broadcastable against ``[B, T, N, R/2]`` (``apply_rope``'s ``attention_factor``).
    Under ``jax.jit`` (traced positions, not checked), entries whose ``|p - offset|`` is outside the
    window are NaN.

  Raises:
    ValueError: ``positions`` not ``[B, T]``, negative or >= 2^31 (concrete); concrete positions
      outside ``offset +- xpos_window`` (the message names the offset to pass); ``kind`` not
      ``"query"``/``"key"``; ``scale_base``/``gamma`` not finite and > 0; ``rotary_dim`` odd or <= 0.
    TypeError: non-integer ``positions`` (bool, float, complex); ``offset`` not an int.

  Source: arXiv 2212.10554 eq. (5)-(6); torchscale ``XPOS`` (its ``offset`` and per-call centre).
  """
  positions = _checks.as_array("positions", positions)
  _checks.check_rank("positions", positions, 2, "[B, T]")
  _checks.check_positions("positions", positions)
  if kind not in ("query", "key"):
    raise ValueError(f"kind must be 'query' or 'key', got {kind!r}")
  scale_base = _checks.check_positive_float("scale_base", scale_base)
  if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
    raise TypeError(f"offset must be an integer token index in [0, 2^31), got {offset!r}")
  if not 0 <= offset < _checks.MAX_POSITION:
    raise ValueError(f"offset must be in [0, 2^31) (a token index), got {offset}")
  zeta_f64 = xpos_zeta(rotary_dim, gamma=gamma)
  window = xpos_window(rotary_dim=rotary_dim, scale_base=scale_base, gamma=gamma)
  if not isinstance(positions, jax.core.Tracer):
    arr = np.asarray(positions, np.int64)
    if arr.size and max(arr.max() - offset, offset - arr.min()) > window:
      raise ValueError(
        f"positions in [{arr.min()}, {arr.max()}] are too far from offset={offset}: xPos scales "
        f"zeta ** ((p - offset) / scale_base) leave float32 beyond |p - offset| = {window} (scale_base "
        f"{scale_base}, gamma {gamma}); give queries and keys the same offset near their positions, e.g. "
        f"offset=(min + max) // 2 of all query and key positions"
      )
    positions = jnp.asarray(positions).astype(jnp.int32)
  log_zeta = jnp.asarray(np.log(zeta_f64), jnp.float32)  # [R/2]
  sign = 1.0 if kind == "query" else -1.0
  # p - offset exactly in int32 (both in [0, 2^31)): the scales depend only on the difference.
  delta = positions.astype(jnp.int32) - jnp.int32(offset)
  exponent = delta.astype(jnp.float32) * jnp.float32(sign / scale_base)
  exponent = exponent[:, :, None, None] * log_zeta[None, None, None, :]
  inside = jnp.abs(delta)[:, :, None, None] <= window
  if jnp.iinfo(positions.dtype).bits > 32 or positions.dtype == jnp.uint32:
    # Traced int64 (x64) / uint32 positions past int32 would wrap in the int32 difference: NaN too.
    fits = positions < _checks.MAX_POSITION
    if jnp.issubdtype(positions.dtype, jnp.signedinteger):
      fits = fits & (positions >= -_checks.MAX_POSITION)
    inside = inside & fits[:, :, None, None]
  return jnp.where(inside, jnp.exp(exponent), jnp.float32(jnp.nan))


def apply_xpos(
  x: jax.Array,
  positions: jax.Array,
  *,
  kind: Literal["query", "key"],
  inv_freq: jax.Array | None = None,
  base: float | None = None,
  layout: Layout = REQUIRED,
  scale_base: float = 512.0,
  gamma: float = 0.4,
  offset: int = 0,
  attention_factor: float = 1.0,
) -> jax.Array:
  """Rotates ``x`` like RoPE and scales each pair by the xPos factor.

  Args:
    x: ``[B, T, N, H]`` float queries (``kind="query"``) or keys ``[B, S, K, H]`` (``kind="key"``).
    positions: integer token indices in ``[0, 2^31)``: ``[B, T]``, or ``[1, T]`` / ``[T]`` shared
      by the batch. Phases are exact (``apply_rope``'s default).
    kind: ``"query"`` or ``"key"``.
    inv_freq: ``[R/2]`` float radians per token (``R <= H``, dims R..H-1 pass through unscaled);
      default ``rope_inv_freq(H, base=base)`` in float64 (base None = 10000; giving both is a ValueError).
    base: rope_theta when ``inv_freq`` is None.
    layout: required, ``"interleaved"`` (torchscale's ``rotate_every_two``) or ``"half"``
      (rotate-half); no default, as ``apply_rope`` (``jaxpe.ops.layouts`` says why).
    scale_base, gamma, offset: see ``xpos_scale``. ``offset`` is the reference position, shared by
      the query and the key call; positions must lie within ``offset +- xpos_window(...)`` (35,556
      at the defaults): far positions need an offset near them (refused otherwise, NaN under jit).
    attention_factor: extra constant on the rotated pairs (HF's ``attention_scaling`` of YaRN /
      LongRoPE frequencies, see ``jaxpe.ops.rope_scaling``); > 0, default 1.

  Returns:
    ``[B, T, N, H]`` array of ``x.dtype``.

  Raises:
    TypeError: ``layout`` not given (the message names both values).
    ValueError / TypeError: as ``apply_rope`` and ``xpos_scale`` (positions must be integers here).

  Source: arXiv 2212.10554; torchscale ``XPOS`` with ``rotate_every_two``.
  """
  check_layout(layout, "apply_xpos")
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 4, "[B, T, N, H]")
  _checks.check_float("x", x)
  if inv_freq is None:
    head_dim = _checks.check_positive_int("x.shape[-1] (head_dim)", x.shape[-1], even=True)
    inv_freq = rope_inv_freq(head_dim, base=10000.0 if base is None else base, dtype=np.float64)
  elif base is not None:
    raise ValueError(
      f"apply_xpos: give base= or inv_freq=, not both (got base={base!r}): inv_freq fixes the frequencies "
      "and base would be ignored; pass inv_freq=rope_inv_freq(H, base=...) only"
    )
  elif not isinstance(inv_freq, jax.Array | np.ndarray):
    inv_freq = np.asarray(inv_freq, np.float64)
  _checks.check_rank("inv_freq", inv_freq, 1, "[R/2]")
  attention_factor = _checks.check_positive_float("attention_factor", attention_factor)
  positions = _batch_positions(positions, x.shape[:2], multi_axis=False)  # [B or 1, T]
  scale = xpos_scale(
    positions,
    rotary_dim=2 * inv_freq.shape[0],
    kind=kind,
    scale_base=scale_base,
    gamma=gamma,
    offset=offset,
  )
  return apply_rope(
    x, positions, inv_freq=inv_freq, layout=layout, attention_factor=scale * jnp.float32(attention_factor)
  )
