"""The decoder's primitive layers: ``LayerNorm`` (``layer_norm``), the exact GELU (``gelu``) and the
projections (``dense``, an ``nnx.Einsum`` whose weight gradient contracts the smaller operand first).
``jaxpe.model.layers`` re-exports them.

Shape alphabet: B batch, T query positions, D model dim, F MLP dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.model import initializers
from jaxpe.model.config import ModelConfig


def _normalize(x, scale, bias, eps: float):
  """``(y, (d, r))``: the corrected two-pass normalisation of ``x [..., D]`` float32 (``scale``,
  ``bias`` ``[D]``) and its residuals (the centred ``d`` and ``r = 1 / sqrt(var + eps)``,
  ``[..., 1]``)."""
  d = x - jnp.mean(x, axis=-1, keepdims=True)
  d = d - jnp.mean(d, axis=-1, keepdims=True)
  r = jax.lax.rsqrt(jnp.mean(jnp.square(d), axis=-1, keepdims=True) + jnp.float32(eps))
  return d * (r * _rows(scale, x)) + _rows(bias, x), (d, r)


def _rows(p, x):
  """``p [D]`` shaped ``[1, ..., 1, D]`` like ``x``."""
  return p.reshape((1,) * (x.ndim - 1) + p.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, eps: float):
  return _normalize(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
  y, (d, r) = _normalize(x, scale, bias, eps)
  return y, (d, r, scale)


def _layer_norm_bwd(eps, residuals, dy):
  """The closed-form LayerNorm gradient (Ba et al. 2016; as PyTorch's and apex's LayerNorm
  backward): with ``xh = d r`` and ``g = dy * scale``, ``dx = r (g - mean(g) - xh mean(g xh))``,
  ``dscale = sum(dy xh)``, ``dbias = sum(dy)`` over the leading axes."""
  del eps
  d, r, scale = residuals
  xh = d * r
  g = dy * _rows(scale, dy)
  dx = r * (g - jnp.mean(g, axis=-1, keepdims=True) - xh * jnp.mean(g * xh, axis=-1, keepdims=True))
  lead = tuple(range(dy.ndim - 1))
  return dx, jnp.sum(dy * xh, axis=lead), jnp.sum(dy, axis=lead)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
  """Exact GELU, ``x * Phi(x) = x (1 + erf(x / sqrt 2)) / 2`` (Hendrycks & Gimpel 2016, arXiv
  1606.08415), in the erf form of ``torch.nn.functional.gelu``; elementwise, any float dtype, any
  shape; forward and reverse mode (a ``custom_jvp``: the derivative ``Phi(x) + x phi(x)`` in closed
  form).

  ``jax.nn.gelu(approximate=False)`` computes the same function through ``erfc``, which XLA CPU ran
  as four passes over the MLP's ``[B*T, F]`` array forward and backward; this is one pass each way
  (``benchmarks/step_profile.py``: GELU was a quarter of the D 128 MLP's time). Where they differ:
  the negative tail, where ``1 + erf`` cancels as in PyTorch: absolute error up to ~1e-6 |x|
  (relative error grows below x = -3; from x = -6, where GELU is under 6e-9, the result is 0).
  ``inf`` gives ``inf``, ``-inf`` NaN (as ``jax.nn.gelu``).
  """
  return x * _gelu_cdf(x)


def _gelu_cdf(x):
  return 0.5 + 0.5 * jax.lax.erf(x * jnp.asarray(math.sqrt(0.5), x.dtype))


@gelu.defjvp
def _gelu_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  cdf = _gelu_cdf(x)
  pdf = jnp.exp(-0.5 * jnp.square(x)) * jnp.asarray(1.0 / math.sqrt(2.0 * math.pi), x.dtype)
  return x * cdf, (cdf + x * pdf) * dx


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

  The gradient is LayerNorm's closed form (a custom VJP, as PyTorch's backward): two row means
  instead of the four that differentiating the corrected two-pass form takes, and one array per
  LayerNorm for the residual stream's gradient (XLA on CPU otherwise fused the whole stream's
  gradient into every layer's backward, L^2 reads; ``benchmarks/step_profile.py``).

  x ``[..., D]`` -> ``[..., D]`` float32.
  """

  def __call__(self, x, *, mask=None):
    if mask is not None:
      raise ValueError("jaxpe's LayerNorm takes no mask")
    scale = self.scale[...] if self.scale else None
    bias = self.bias[...] if self.bias else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=jnp.float32)
    x = x.astype(jnp.float32)
    feature = x.shape[-1:]
    scale = jnp.ones(feature, jnp.float32) if scale is None else scale.astype(jnp.float32).reshape(feature)
    bias = jnp.zeros(feature, jnp.float32) if bias is None else bias.astype(jnp.float32).reshape(feature)
    return _layer_norm(x, scale, bias, float(self.epsilon))


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs, dim: int | None = None, names=("embed",)) -> LayerNorm:
  """The model's ``LayerNorm`` over ``dim`` (default D; H for ``qk_norm``): ``layernorm_eps``, scale
  ones and bias zeros ``[dim]`` (logical names ``names``), float32."""
  return LayerNorm(
    cfg.d_model if dim is None else dim,
    epsilon=cfg.layernorm_eps,
    dtype=jnp.float32,
    use_fast_variance=False,
    scale_init=initializers.ones(names),
    bias_init=initializers.zeros(names),
    rngs=rngs,
  )


def dense(
  cfg: ModelConfig,
  eq: str,
  kernel_shape: tuple[int, ...],
  bias_shape: tuple[int, ...],
  names: tuple[str | None, ...],
  std: float,
  rngs: nnx.Rngs,
  *,
  bias: bool = False,
) -> nnx.Einsum:
  """A projection ``nnx.Einsum(eq)`` in ``cfg.dtype``: kernel ``kernel_shape`` initialised
  Normal(0, ``std``) with logical ``names``; bias ``bias_shape`` (zeros, the last names) with
  ``cfg.use_bias`` or ``bias`` (the layer's own key: ``attention_bias``, ``mlp_bias``); its einsum is
  ``_activation_first_einsum`` (the weight gradient's operand order)."""
  return nnx.Einsum(
    eq,
    kernel_shape,
    bias_shape if cfg.use_bias or bias else None,
    dtype=cfg.dtype,
    kernel_init=initializers.normal(std, names),
    bias_init=initializers.zeros(names[-len(bias_shape) :]),
    rngs=rngs,
    einsum_op=_activation_first_einsum,
  )


def _activation_first_einsum(eq: str, x, w, *, precision=None, preferred_element_type=None, **kwargs):
  """``jnp.einsum(eq, x, w)`` (``nnx.Einsum``'s ``einsum_op``) whose weight gradient contracts the
  smaller of the activation x and the cotangent g as the dot's first operand: XLA:CPU transposes
  that operand (the token axes must become minor), so it transposes the smaller one (x into q/k/v
  and the MLP's up-projection, g out of its down-projection), where autodiff's order transposed
  each projection's cotangent, fused with its producer (RoPE's or attention's backward, GELU) into
  a slow strided copy. Values and gradients are the same einsums as autodiff's. Train step D 512 /
  L 8, B 8 x T 512 on 2 CPU devices: 4.41 -> 4.05 s."""
  if any(v is not None for v in kwargs.values()):  # e.g. out_sharding: jax's own einsum and vjp
    return jnp.einsum(eq, x, w, precision=precision, preferred_element_type=preferred_element_type, **kwargs)
  return _act_einsum(eq, precision, preferred_element_type, x, w)


def _flat_einsum(eq, x, w, precision, pet):
  """``jnp.einsum(eq, x, w)``; when x's contracted labels trail it and lead w in the same order
  (the output projection ``BTNH,NHD->BTD``), as one matmul over them flattened (free reshapes):
  ``jnp.einsum`` emits such a dot with its contracting dims reversed ([3, 2] x [1, 0]), and
  XLA:CPU then transposed both operands, the weight included, at every call (a [N*H, D] copy per
  layer and decode step)."""
  ins, out = eq.split("->")
  a, b = ins.split(",")
  shared = [c for c in a if c in b and c not in out]
  n = len(shared)
  if n > 1 and a[-n:] == b[:n] == "".join(shared) and "Z" not in eq:
    flat = eq.replace(a, a[:-n] + "Z", 1).replace("," + b, ",Z" + b[n:], 1)
    x2 = x.reshape(*x.shape[:-n], -1)
    w2 = w.reshape(-1, *w.shape[n:])
    return jnp.einsum(flat, x2, w2, precision=precision, preferred_element_type=pet)
  return jnp.einsum(eq, x, w, precision=precision, preferred_element_type=pet)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _act_einsum(eq, precision, pet, x, w):
  return _flat_einsum(eq, x, w, precision, pet)


def _act_einsum_fwd(eq, precision, pet, x, w):
  # plain einsum (not _act_einsum): forward over reverse (jax.hessian) differentiates this rule
  return _flat_einsum(eq, x, w, precision, pet), (x, w)


def _act_einsum_bwd(eq, precision, pet, res, g):
  del pet
  x, w = res
  ins, out = eq.split("->")
  a, b = ins.split(",")
  dx = jnp.einsum(f"{out},{b}->{a}", g, w, precision=precision)
  if x.size <= g.size:  # the smaller of the two is the dot's first operand (the one laid out)
    dw = jnp.einsum(f"{a},{out}->{b}", x, g, precision=precision)
  else:
    dw = jnp.einsum(f"{out},{a}->{b}", g, x, precision=precision)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_act_einsum.defvjp(_act_einsum_fwd, _act_einsum_bwd)
