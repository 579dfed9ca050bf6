"""ALiBi attention without a bias tensor: the RoPE-emulated ALiBi of ``jaxpe.emulation`` through
``jaxpe.attention.attention`` (the einsum path with float32 emulation dims, or a fused kernel).

It was ``jaxpe.emulation.emulated_alibi_attention``; it lives here because it runs the attention
backends, a layer above the emulation (the old name still resolves, with a DeprecationWarning).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention.backends import AlibiSpec, accepts_impl, check_implementation
from jaxpe.attention.kernels import attention
from jaxpe.attention.masks import AttentionMask
from jaxpe.emulation.ops import apply_augmented_alibi, apply_rope_alibi
from jaxpe.emulation.solver import default_theta
from jaxpe.ops import checks as _checks


def _context(q_positions, k_positions) -> int:
  """The context the default theta is planned for: the largest concrete position + 1, or for traced
  positions the longer of T and S (positions are then assumed to be slots)."""
  length = max(int(np.shape(q_positions)[-1]), int(np.shape(k_positions)[-1]), 1)
  if isinstance(q_positions, jax.core.Tracer) or isinstance(k_positions, jax.core.Tracer):
    return length
  top = [int(np.max(np.asarray(p), initial=0)) for p in (q_positions, k_positions)]
  return max(max(top) + 1, length)


@accepts_impl
def emulated_alibi_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  slopes,
  theta=None,
  order: int | None = 1,
  mask: jax.Array | None = None,
  is_causal: bool = False,
  implementation: str | None = None,
  interpret: bool = False,
) -> jax.Array:
  """ALiBi attention without a bias tensor: a thin wrapper over ``jaxpe.attention.attention``.

  ``xla`` (``implementation`` None or ``"xla"``): q and k get the float32 emulation dims
  (``apply_rope_alibi``, or ``apply_augmented_alibi`` for ``order=None``) and go through the einsum
  path with those dims contracted at ``precision=HIGHEST`` (``precise_dims``), so TF32 / bf16-pass
  default matmul precision cannot round them. Fused kernels (``"cudnn"``, ``"splash"``,
  ``"pallas_gpu"``): ``kernels.attention`` with an ``AlibiSpec`` (the exact form for ``order=None``,
  else the rotated form of that order), whose emulation dims are bf16-exact (cuDNN reads bf16/fp16
  only; float32 emulation dims rounded to bf16 cost whole logits). The score scale is ``1/sqrt(H)``
  of the original head dim; head-dim padding is the kernel's (``kernels.padded_head_dim``).

  Args:
    q: ``[B, T, N, H]`` float queries.
    k: ``[B, S, K, H]`` float keys.
    v: ``[B, S, K, H]`` float values.
    q_positions: ``[B, T]`` integer token indices.
    k_positions: ``[B, S]`` integer token indices.
    slopes: ``[N]`` ALiBi slopes (> 0), concrete.
    theta: base frequency (radians per token) of the rotated form; unused for ``order=None``.
      Default None: ``jaxpe.emulation.solver.default_theta`` for the context of the positions
      (the largest concrete position + 1; traced positions: ``max(T, S)``), the largest theta whose
      predicted deviation from ALiBi is 1.5x the float32 rounding floor (measured: 1.4e-4 logits
      at N 4, H 16 over 2048 tokens, 8e-6 over 64); ``solve_emulation`` plans others.
    order: k for the rotated form (default 1, the published construction, whose rounding floor
      is the lowest), None for the exact augmented form.
    mask: optional bool mask broadcastable to ``[B, N, T, S]`` (True = may attend); ``xla`` only
      (fused kernels take ``kernels.attention(mask=AttentionMask(...))``).
    is_causal: causal mask (query index >= key index in the arrays).
    implementation: None or ``"xla"``, or a fused backend of ``jaxpe.attention.BACKENDS``
      (``impl=``, the old spelling, is accepted with a DeprecationWarning for one release).
    interpret: run the Pallas kernels in interpret mode (CPU).

  Returns:
    ``[B, T, N, H]`` array of ``v.dtype``.

  Raises:
    ValueError: as ``apply_rope_alibi`` / ``kernels.attention`` (an unavailable backend lists the
      available ones); ``v`` not ``[B, S, K, H]``; a dense ``mask`` on a fused kernel; a context
      whose rounding floor leaves no default theta (``solve_emulation``'s message).
    TypeError: a non-bool ``is_causal`` or ``interpret``; as ``kernels.attention``.
  """
  is_causal = _checks.check_bool("is_causal", is_causal)
  interpret = _checks.check_bool("interpret", interpret)
  q, k, v = (_checks.as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
  _checks.check_rank("v", v, 4, "[B, S, K, H]")
  if v.shape != k.shape:
    raise ValueError(f"v must have the shape of k, [B, S, K, H] = {k.shape}, got {v.shape}")
  impl = check_implementation(implementation or "xla")  # the platform decides when lowering (attention)
  head_dim = q.shape[-1]
  if order is not None and theta is None:
    theta = default_theta(slopes, head_dim=head_dim, max_len=_context(q_positions, k_positions), order=order)
  scale = 1.0 / math.sqrt(head_dim)
  if impl != "xla":
    if mask is not None:
      raise ValueError(
        f"implementation {impl!r} takes no dense mask: use jaxpe.kernels.attention with "
        "mask=AttentionMask(valid=..., segment_ids=..., causal=...), or implementation='xla'"
      )
    bound = 65536
    for pos in (q_positions, k_positions):
      bound = max(bound, pos.shape[1])
      if not isinstance(pos, jax.core.Tracer):
        bound = max(bound, int(np.max(np.asarray(pos), initial=0)) + 1)
    spec = AlibiSpec(
      slopes=np.asarray(slopes, np.float64),
      q_positions=q_positions,
      k_positions=k_positions,
      max_position=bound,
      form="exact" if order is None else "rotated",
      order=1 if order is None else order,
      theta=theta,
    )
    return attention(
      q,
      k,
      v,
      scale=scale,
      mask=AttentionMask(causal=is_causal),
      alibi_spec=spec,
      implementation=impl,
      interpret=interpret,
    )
  if order is None:
    q_aug, k_aug = apply_augmented_alibi(q, k, q_positions, k_positions, slopes=slopes)
  else:
    q_aug, k_aug = apply_rope_alibi(q, k, q_positions, k_positions, slopes=slopes, theta=theta, order=order)
    if k_aug.shape[2] != v.shape[2]:
      v = jnp.repeat(v, k_aug.shape[2] // v.shape[2], axis=2)
  if is_causal:
    t_len, s_len = q.shape[1], k.shape[1]
    causal = jnp.tril(jnp.ones((t_len, s_len), bool))[None, None]
    mask = causal if mask is None else mask & causal
  return attention(
    q_aug, k_aug, v, scale=scale, mask=mask, precise_dims=q_aug.shape[-1] - head_dim, implementation="xla"
  )
