"""``RopeSpec``: RoPE (every HF scaling, xPos) described by arrays, for ``attention(rope_spec=...)``.

Every backend takes it: ``xla``, ``cudnn``, ``splash`` and ``pallas_gpu`` rotate q and k with
jaxpe's own ops (``jaxpe.ops.apply_rope``, with xPos's ``xpos_scale``) before attention, the same
numbers as a user rotating first; ``flash`` (``jaxpe.attention.flash``) rotates q/k blocks inside its
Pallas kernel from the positions and ``inv_freq`` (no rotated q/k in memory).

Every HF ``rope_scaling`` type reduces to an ``inv_freq`` array and an ``attention_factor``
(``jaxpe.ops.rope_scaling`` / ``rope_from_hf_config``: linear, dynamic NTK for a given length, YaRN,
llama3, LongRoPE); multi-axis positions (Qwen2-VL mrope) are refused.

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
R rotary dims.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.ops import checks as _checks
from jaxpe.ops.exact_phases import _turn_words
from jaxpe.ops.layouts import LAYOUTS
from jaxpe.ops.rope import apply_rope, check_frequency_dtype
from jaxpe.ops.xpos import xpos_scale, xpos_zeta


@dataclasses.dataclass(frozen=True)
class RopeSpec:
  """RoPE for ``jaxpe.attention.attention``: rotates the first R content dims of q and k.

  Checked by ``attention`` (every backend) against q and k, not at construction.

  Attributes:
    inv_freq: ``[R/2]`` float radians per token (``R <= H``; the other dims pass through), finite;
      any scaling's frequencies (``rope_inv_freq``, ``jaxpe.ops.rope_scaling``). Not differentiated.
    q_positions: ``[B, T]`` integer token indices of the queries, >= 0 (multi-axis mrope positions
      ``[A, B, T]`` are refused).
    k_positions: ``[B, S]`` integer token indices of the keys, >= 0.
    layout: ``"half"`` (HF rotate-half) or ``"interleaved"`` (Meta, EasyLM); required, as in
      ``apply_rope``.
    attention_factor: multiplies cos and sin of every rotated pair (YaRN / LongRoPE mscale, HF
      ``attention_scaling``); a finite number > 0, default 1.
    phase_precision: ``"exact"`` (default, as ``apply_rope``: exact phases; on ``flash`` the same
      fixed-point turns reduced in the kernel with exact float32 products, positions below 2^24)
      or ``"float32"`` (``float32(p) * float32(inv_freq)``, bit-matching HF / Meta / vLLM phases).
    xpos_scale_base: None (plain RoPE) or xPos's ``scale_base`` (> 0; 512 in the paper): pairs are
      also scaled by ``zeta_i ** (+-(p - xpos_offset) / scale_base)`` (``jaxpe.ops.xpos_scale``).
    xpos_gamma: xPos's gamma (> 0, default 0.4).
    xpos_offset: xPos's reference position (an int in ``[0, 2^31)``, default 0).

  Source: RoFormer arXiv 2104.09864; xPos arXiv 2212.10554; HF ``apply_rotary_pos_emb``.
  """

  inv_freq: jax.Array | np.ndarray
  q_positions: jax.Array
  k_positions: jax.Array
  layout: Literal["interleaved", "half"]
  attention_factor: float = 1.0
  phase_precision: Literal["exact", "float32"] = "exact"
  xpos_scale_base: float | None = None
  xpos_gamma: float = 0.4
  xpos_offset: int = 0


def check_rope_spec(spec, batch: int, t_len: int, s_len: int, head_dim: int) -> RopeSpec:
  """``spec`` checked against q ``[B, T, ., H + E]`` / k ``[B, S, ., H + E]`` (H content dims).

  Raises:
    TypeError: not a RopeSpec; non-float ``inv_freq``, or one narrower than float32 (bfloat16, float16); non-integer positions; non-number scalars.
    ValueError: ``inv_freq`` not ``[R/2]`` with ``1 <= R/2``, ``R <= H``, or not finite; positions
      not ``[B, T]`` / ``[B, S]`` (mrope's ``[A, B, T]`` named) or (concrete) negative; bad
      ``layout`` / ``phase_precision``; ``attention_factor`` / xPos scalars not finite > 0.
  """
  if not isinstance(spec, RopeSpec):
    raise TypeError(f"rope_spec must be a RopeSpec or None, got {type(spec).__name__}")
  inv_freq = _checks.as_array("RopeSpec.inv_freq", spec.inv_freq)
  _checks.check_float("RopeSpec.inv_freq", inv_freq)
  check_frequency_dtype("RopeSpec.inv_freq", inv_freq.dtype)  # bfloat16 / float16: phases lose precision
  if jnp.ndim(inv_freq) != 1 or inv_freq.shape[0] == 0:
    raise ValueError(f"RopeSpec.inv_freq must have shape [R/2] with R/2 >= 1, got {jnp.shape(inv_freq)}")
  if 2 * inv_freq.shape[0] > head_dim:
    raise ValueError(
      f"RopeSpec.inv_freq has {inv_freq.shape[0]} frequencies (R = {2 * inv_freq.shape[0]}) but q/k have "
      f"H = {head_dim} content dims; R must be <= H"
    )
  if not isinstance(inv_freq, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(inv_freq, np.float64))):
    raise ValueError("RopeSpec.inv_freq must be finite (radians per token)")
  positions = []
  for name, pos, shape in (
    ("RopeSpec.q_positions", spec.q_positions, (batch, t_len)),
    ("RopeSpec.k_positions", spec.k_positions, (batch, s_len)),
  ):
    if jnp.ndim(pos) == 3:
      raise ValueError(
        f"{name} has shape {jnp.shape(pos)}: multi-axis (mrope) positions are not supported by RopeSpec; "
        "rotate q and k with jaxpe.ops.apply_rope(..., mrope_section=...) first"
      )
    positions.append(_checks.checked_positions(name, pos, shape))
  if spec.layout not in LAYOUTS:
    raise ValueError(f"RopeSpec.layout must be one of {LAYOUTS}, got {spec.layout!r}")
  if spec.phase_precision not in ("exact", "float32"):
    raise ValueError(f"RopeSpec.phase_precision must be 'exact' or 'float32', got {spec.phase_precision!r}")
  factor = _checks.check_positive_float("RopeSpec.attention_factor", spec.attention_factor)
  scale_base = spec.xpos_scale_base
  if scale_base is not None:
    scale_base = _checks.check_positive_float("RopeSpec.xpos_scale_base", scale_base)
  gamma = _checks.check_positive_float("RopeSpec.xpos_gamma", spec.xpos_gamma)
  offset = spec.xpos_offset
  if isinstance(offset, bool) or not isinstance(offset, int | np.integer) or not 0 <= offset < 2**31:
    raise ValueError(f"RopeSpec.xpos_offset must be an int in [0, 2^31), got {offset!r}")
  return dataclasses.replace(
    spec,
    inv_freq=inv_freq,
    q_positions=positions[0],
    k_positions=positions[1],
    attention_factor=factor,
    xpos_scale_base=scale_base,
    xpos_gamma=gamma,
    xpos_offset=int(offset),
  )


def apply_rope_spec(spec: RopeSpec, q: jax.Array, k: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
  """q ``[B, T, N, H + E]`` and k with their first H (content) dims rotated by ``spec`` (checked).

  jaxpe's ops (``apply_rope``, ``xpos_scale``): the numbers a user rotating first would get.
  """
  rotary = 2 * spec.inv_freq.shape[0]
  out = []
  for x, pos, kind in ((q, spec.q_positions, "query"), (k, spec.k_positions, "key")):
    scale: float | jax.Array = spec.attention_factor
    if spec.xpos_scale_base is not None:
      xs = xpos_scale(
        pos,
        rotary_dim=rotary,
        kind=kind,
        scale_base=spec.xpos_scale_base,
        gamma=spec.xpos_gamma,
        offset=spec.xpos_offset,
      )
      scale = xs * jnp.float32(spec.attention_factor)
    rotated = apply_rope(
      x[..., :head_dim],
      pos,
      inv_freq=spec.inv_freq,
      layout=spec.layout,
      attention_factor=scale,
      phase_precision=spec.phase_precision,
    )
    out.append(rotated if x.shape[-1] == head_dim else jnp.concatenate([rotated, x[..., head_dim:]], -1))
  return out[0], out[1]


def kernel_tables(spec: RopeSpec, dim: int) -> dict[str, jax.Array]:
  """The per-dim tables the ``flash`` kernel rotates with, for q/k of ``dim`` (padded) dims.

  ``freq [1, dim]``: each dim's pair frequency (0 past R: cos 1, sin 0); ``perm [dim, dim]``: the
  signed permutation with ``(x @ perm)[j] = -x[partner]`` for the first dim of a pair and
  ``+x[partner]`` for the second (rotated = ``x cos + (x @ perm) sin``); ``logz [1, dim]``: xPos's
  ``log zeta`` per dim (0 past R; zeros without xPos); ``amp [1, dim]``: ``attention_factor`` on the R rotated dims, 1 past them.
  """
  half = spec.inv_freq.shape[0]
  inv_freq = jnp.asarray(spec.inv_freq, jnp.float32)
  if spec.layout == "half":
    pair = np.concatenate([np.arange(half), np.arange(half)])
    first = np.arange(2 * half) < half
    partner = np.concatenate([np.arange(half, 2 * half), np.arange(half)])
  else:
    pair = np.repeat(np.arange(half), 2)
    first = np.arange(2 * half) % 2 == 0
    partner = np.arange(2 * half) ^ 1
  freq = jnp.zeros((dim,), jnp.float32).at[: 2 * half].set(inv_freq[pair])
  perm = np.zeros((dim, dim), np.float32)
  cols = np.arange(2 * half)
  perm[partner, cols] = np.where(first, -1.0, 1.0)
  logz = np.zeros((dim,), np.float32)
  if spec.xpos_scale_base is not None:
    log_zeta = np.log(xpos_zeta(2 * half, gamma=spec.xpos_gamma)).astype(np.float32)
    logz[: 2 * half] = log_zeta[pair]
  rotated = (np.arange(dim) < 2 * half)[None, :]
  amp = jnp.where(rotated, jnp.float32(spec.attention_factor), jnp.float32(1.0))
  return {
    "freq": freq[None, :],
    "perm": jnp.asarray(perm),
    "logz": jnp.asarray(logz)[None, :],
    "amp": amp,
    "turns": _turn_chunks(spec.inv_freq, pair, dim),
  }


def _turn_chunks(inv_freq, pair: np.ndarray, dim: int) -> jax.Array:
  """``[8, dim]`` float32: rows 0..4 the 12-bit chunks, from the top, of each dim's frequency in
  fixed-point turns ``U = round(2^64 frac(theta / 2 pi))`` (``jaxpe.ops.exact_phases``; rows 5..7
  and dims past R zero). ``frac(p U / 2^64)`` is then a sum of exact float32 products for p < 2^24."""
  hi, lo, _ = _turn_words(inv_freq)
  hi, lo = jnp.asarray(hi, jnp.uint32), jnp.asarray(lo, jnp.uint32)
  mask = jnp.uint32(0xFFF)
  chunks = [
    hi >> 20,
    (hi >> 8) & mask,
    ((hi & jnp.uint32(0xFF)) << 4) | (lo >> 28),
    (lo >> 16) & mask,
    (lo >> 4) & mask,
  ]
  table = jnp.stack([c.astype(jnp.float32)[pair] for c in chunks])  # [5, R]
  return jnp.zeros((8, dim), jnp.float32).at[:5, : pair.shape[0]].set(table)
