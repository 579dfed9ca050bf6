"""The decoder's layers: LayerNorm, the attention layer, the MLP and the pre-LayerNorm block.

The attention layer asks the configured positional encoding (``jaxpe.model.encodings``) for the
q/k projection width, the q/k transform and the ALiBi bias, and runs on the configured backend
(``jaxpe.attention.kernels``). Parameters carry logical axis names (``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim,
D model dim, F MLP dim, L layers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpe.attention import context, decode, kernels, masks
from jaxpe.model import encodings, initializers, partitioning
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


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> LayerNorm:
  """The model's ``LayerNorm`` over D: ``layernorm_eps``, scale ones and bias zeros ``[D]``
  (logical name ``embed``), float32."""
  return LayerNorm(
    cfg.d_model,
    epsilon=cfg.layernorm_eps,
    dtype=jnp.float32,
    use_fast_variance=False,
    scale_init=initializers.ones(("embed",)),
    bias_init=initializers.zeros(("embed",)),
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
) -> nnx.Einsum:
  """A projection ``nnx.Einsum(eq)`` in ``cfg.dtype``: kernel ``kernel_shape`` initialised
  Normal(0, ``std``) with logical ``names``; bias ``bias_shape`` (zeros, the last names) only with
  ``cfg.use_bias``; its einsum is ``_activation_first_einsum`` (the weight gradient's operand order)."""
  return nnx.Einsum(
    eq,
    kernel_shape,
    bias_shape if cfg.use_bias else None,
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


class Attention(nnx.Module):
  """Causal multi-head (or grouped-query) self-attention with the configured position encoding.

  With ``cfg.attention_sinks`` it holds ``sinks [N]`` float32 (logical name ``heads``; gpt-oss's
  learned sink logits, Normal(0, ``init_std``) as HF's ``GptOssPreTrainedModel._init_weights``),
  passed to the backend (``jaxpe.attention.sinks``); the encoding's per-layer parameters
  (``layer_params``, CoPE's ``cope_pos_emb``) are attributes too.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, kv, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size
    enc = encodings.for_config(cfg)
    hq = h + enc.qk_extra_dims()  # q/k dims per head
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.q = dense(
      cfg, "BTD,DNH->BTNH", (d, n, hq), (n, hq), ("embed", "heads", "head_dim"), cfg.init_std, rngs
    )
    self.k = dense(
      cfg, "BSD,DKH->BSKH", (d, kv, hq), (kv, hq), ("embed", "kv_heads", "head_dim"), cfg.init_std, rngs
    )
    enc.init_qk(self.q, self.k)
    self.v = dense(
      cfg, "BSD,DKH->BSKH", (d, kv, h), (kv, h), ("embed", "kv_heads", "head_dim"), cfg.init_std, rngs
    )
    self.o = dense(cfg, "BTNH,NHD->BTD", (n, h, d), (d,), ("heads", "head_dim", "embed"), out_std, rngs)
    for name, param in enc.layer_params(rngs).items():  # cope, kerple, fire: per-layer parameters
      setattr(self, name, param)
    if cfg.attention_sinks:  # gpt-oss: one learned logit per head, Normal(0, init_std)
      sinks = nnx.initializers.normal(cfg.init_std)(rngs.params(), (n,), jnp.float32)
      self.sinks = nnx.Param(sinks, out_sharding=("heads",))

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    mask: masks.AttentionMask | masks.IndexMask,
    *,
    kv_positions: jax.Array,
    cache_kv: tuple[jax.Array, jax.Array] | None = None,
    cache_end: jax.Array | None = None,
    use_rope: bool | jax.Array | None = None,
    shared_bias=None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """x ``[B, T, D]`` -> ``([B, T, D], updated (k, v) cache or None)``.

    ``mask`` (an ``AttentionMask`` without a cache or for the prefill of an empty one; an
    ``IndexMask`` of the slots otherwise: of the cache, of the tokens when they are reordered or
    split over devices) and ``kv_positions`` ``[B, S]`` describe the keys: the T new tokens under an
    ``AttentionMask`` (the cache, if any, gets their keys at ``cache_end``), all S cache slots under
    a cache's ``IndexMask``. Runs on ``cfg.attn_implementation`` (``jaxpe.attention.kernels``) under
    an ``AttentionMask``; under an ``IndexMask`` on ``xla`` (few queries over a cache in one pass,
    ``jaxpe.attention.decode``); with the sequence split over mesh axes
    (``partitioning.sequence_split``) across them (``jaxpe.attention.context``, strategy
    ``cfg.context_attention``). ``use_rope``: this layer's flag of a per-layer RoPE schedule
    (``cfg.rope_layers()``; false = NoPE layer, ``encode_qk_nope``), None without one.
    ``shared_bias``: the encoding's ``shared_bias_params`` (T5's table).
    """
    q, k, v = self.q(x), self.k(x), self.v(x)  # [B,T,N,H], [B,T,K,H], [B,T,K,H]
    enc = encodings.for_config(self.cfg)
    rope_spec = None
    if (
      self.cfg.attn_implementation == "flash"
      and cache_kv is None
      and isinstance(mask, masks.AttentionMask)
      and (use_rope is None or (isinstance(use_rope, bool) and use_rope))
    ):  # flash rotates q/k blocks inside its kernel (rope, xpos): q and k stay unrotated here
      rope_spec = enc.rope_spec(positions, kv_positions)
    if rope_spec is None:
      q, k = enc.encode_layer_qk(q, k, positions, use_rope)
    new_kv = None
    cfg = self.cfg
    scale = 1.0 / math.sqrt(cfg.head_size)
    sinks = self.sinks[...] if cfg.attention_sinks else None
    if cache_kv is not None:  # the cache lies heads first: [B, K, S, H] (jaxpe.model.cache)
      k_cache, v_cache = cache_kv
      k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
      new_kv = (
        jax.lax.dynamic_update_slice_in_dim(k_cache, jnp.swapaxes(k, 1, 2), cache_end, axis=2),
        jax.lax.dynamic_update_slice_in_dim(v_cache, jnp.swapaxes(v, 1, 2), cache_end, axis=2),
      )
      if not isinstance(mask, masks.AttentionMask):  # attend over every slot (an empty cache's
        # prefill, under an AttentionMask, attends to its own keys alone)
        position_bias = enc.position_bias(self, shared_bias, positions, kv_positions)
        if q.shape[1] <= decode.DECODE_MAX_QUERIES and partitioning.sequence_split() is None:
          # decoding: two batched matmuls over the cache as it lies, in place (no copy of it)
          k_sk = jnp.swapaxes(new_kv[0], 1, 2)  # only a dense bias (cope) reads it; else dropped
          out = decode.decode_attention(
            q,
            *new_kv,
            scale=scale,
            mask=mask,
            bias=enc.attention_bias(self, q, k_sk, mask, scale=scale),
            alibi=enc.alibi_spec(positions, kv_positions),
            position_bias=position_bias,
            precise_dims=q.shape[-1] - cfg.head_size,
            sinks=sinks,
            heads_first=True,
          )
          return self.o(out), new_kv
        k, v = (jnp.swapaxes(c, 1, 2) for c in new_kv)  # a long chunk: blockwise over [B, S, K, H]
    bias = enc.attention_bias(self, q, k, mask, scale=scale)  # cope: a dense [B, N, T, S] bias
    split = partitioning.sequence_split()
    position_bias = enc.position_bias(self, shared_bias, positions, kv_positions)
    if cache_kv is None and isinstance(mask, masks.IndexMask) and split is not None:
      if sinks is not None or bias is not None:
        raise ValueError(
          "context parallelism (a sequence split over mesh axes) runs without attention sinks and "
          f"dense biases; got attention_sinks={cfg.attention_sinks}, pos_encoding={cfg.pos_encoding!r}"
        )
      out = context.context_attention(
        q,
        k,
        v,
        scale=scale,
        mesh=split[0],
        axes=split[1],
        strategy=cfg.context_attention,
        mask=mask,
        alibi=enc.alibi_spec(positions, kv_positions),
        position_bias=position_bias,
        precise_dims=q.shape[-1] - cfg.head_size,
      )
      return self.o(out), None
    fused = isinstance(mask, masks.AttentionMask)  # without a cache, or an empty cache's prefill
    implementation = cfg.attn_implementation if fused else "xla"

    def attend(q, k, v, positions, kv_positions, valid, segment_ids, bias, sinks):
      local_mask = (
        mask if not fused else masks.AttentionMask(valid=valid, segment_ids=segment_ids, causal=mask.causal)
      )
      return kernels.attention(
        q,
        k,
        v,
        scale=scale,
        mask=local_mask,
        bias=bias,
        sinks=sinks,
        alibi_spec=enc.alibi_spec(positions, kv_positions),
        precise_dims=q.shape[-1] - cfg.head_size,  # the rope_alibi emulation dims (float32)
        implementation=implementation,
        interpret=cfg.attention_interpret,
        position_bias=position_bias,
        rope_spec=None if rope_spec is None else enc.rope_spec(positions, kv_positions),
      )

    rows = (q, k, v, positions, kv_positions)
    rows += (mask.valid, mask.segment_ids) if fused else (None, None)
    if fused and implementation != "xla" and position_bias is None:
      # a fused kernel on a mesh runs on each device's batch rows (XLA cannot partition a Mosaic
      # kernel, nor cuDNN's on an abstract mesh); the heads are gathered to each device
      out = partitioning.batch_local(attend, (*rows, bias), (sinks,))
    else:
      out = attend(*rows, bias, sinks)
    return self.o(out), new_kv


class MLP(nnx.Module):
  """``D -> F -> GELU -> D``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.up = dense(
      cfg, "BTD,DF->BTF", (cfg.d_model, cfg.mlp_size), (cfg.mlp_size,), ("embed", "mlp"), cfg.init_std, rngs
    )
    self.down = dense(
      cfg, "BTF,FD->BTD", (cfg.mlp_size, cfg.d_model), (cfg.d_model,), ("mlp", "embed"), out_std, rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.up(x)
    # GELU on the [B*T, F] view (the same values): XLA CPU ran GELU's erfc and its gradient on the
    # [B, T, F] array about 2x slower, which doubled the MLP's forward + backward (B 8, T 512,
    # D 512: 1151 -> 593 ms per layer; benchmarks/train_bench.py's "step part: mlp").
    flat = h.reshape(-1, h.shape[-1])
    flat = jax.nn.gelu(flat, approximate=True) if self.cfg.gelu_approximate else gelu(flat)
    return self.down(flat.reshape(h.shape))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.attn_norm = layer_norm(cfg, rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = layer_norm(cfg, rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, mask, **attn_kwargs):
    h, new_kv = self.attn(self.attn_norm(x).astype(self.cfg.dtype), positions, mask, **attn_kwargs)
    x = x + h.astype(jnp.float32)
    x = x + self.mlp(self.mlp_norm(x).astype(self.cfg.dtype)).astype(jnp.float32)
    return x, new_kv
