"""Choices made for the platform a program is lowered for, not the platform of the host.

``jax.jit(f).lower(...)`` and ``jax.export.export(jax.jit(f), platforms=(...))`` trace ``f`` once,
for no platform in particular, and lower the trace for one or several platforms (a CPU host can
export a program for ``cuda`` or ``tpu``). So a kernel choice in traced code cannot read
``jax.default_backend()``: it would pick the CPU kernel in a program exported for a GPU, and refuse
a GPU kernel on a CPU host that only exports. ``per_platform`` traces one branch per platform and
``jax.lax.platform_dependent`` keeps, when lowering, only the branches of the platforms being
lowered (a single-platform lowering holds no other branch: no CPU FFI call reaches a GPU program).
A branch that a platform cannot run is ``refused``: it traces (shapes only) and raises its
``ValueError`` when, and only when, it is lowered for that platform.

Platforms: ``PLATFORMS`` (``jax.lax.platform_dependent``'s names: ``cpu``, ``cuda``, ``rocm``,
``tpu``); ``host_platform()`` names the default backend's (``gpu`` as ``cuda`` or ``rocm``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")
"""The lowering platforms jaxpe chooses kernels for (``jax.lax.platform_dependent``'s keywords)."""


def host_platform() -> str:
  """The lowering platform of JAX's default backend: ``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``
  (another plugin's name as it is)."""
  platform = jax.default_backend()
  if platform != "gpu":
    return platform
  version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
  return "rocm" if "rocm" in version or "hip" in version else "cuda"


def context_platform() -> str | None:
  """The platform of the devices of the abstract mesh this is traced under
  (``jax.sharding.use_abstract_mesh`` with an ``AbstractDevice`` of another platform than the
  host's: a program meant for those devices only), or None (any platform). A mesh of the host's own
  devices (``jax.set_mesh``) says nothing: such a program may still be lowered for another platform."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None)
  platform = "cuda" if platform == "gpu" else platform
  return None if platform is None or platform == host_platform() else platform


def check_platform(name: str, platform) -> str:
  """``platform`` if it is one of ``PLATFORMS``.

  Raises:
    ValueError: naming ``name`` and the accepted platforms.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"{name} must be one of {PLATFORMS}, got {platform!r}")
  return platform


_refused_p = jex_core.Primitive("jaxpe_refused")
"""A value a platform cannot compute from its operands: traces to its shape, raises its message when
lowered. Its derivative and batching rules refuse in turn, so the refusal survives ``jax.grad``
(a gradient program for that platform is refused too, not lowered to zeros) and ``jax.vmap``."""


def _refused_abstract(*operands, shape, dtype, message):
  del operands, message
  return jax.core.ShapedArray(shape, dtype)


def _refused_impl(*operands, shape, dtype, message):
  raise ValueError(message)


def _refused_lowering(ctx, *operands, shape, dtype, message):
  raise ValueError(message)


def _refused_jvp(primals, tangents, *, shape, dtype, message):
  out = _refused_p.bind(*primals, shape=shape, dtype=dtype, message=message)
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return out, _refused_p.bind(*tangents, shape=shape, dtype=dtype, message=message)


def _refused_transpose(ct, *operands, shape, dtype, message):
  ct = ad.instantiate_zeros(ct)
  return [
    _refused_p.bind(ct, shape=x.aval.shape, dtype=x.aval.dtype, message=message)
    if ad.is_undefined_primal(x)
    else None
    for x in operands
  ]


def _refused_batch(operands, dims, *, shape, dtype, message):
  size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
  moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims, strict=True)]
  return _refused_p.bind(*moved, shape=(size, *shape), dtype=dtype, message=message), 0


_refused_p.def_abstract_eval(_refused_abstract)
_refused_p.def_impl(_refused_impl)
mlir.register_lowering(_refused_p, _refused_lowering)
ad.primitive_jvps[_refused_p] = _refused_jvp
ad.primitive_transposes[_refused_p] = _refused_transpose
batching.primitive_batchers[_refused_p] = _refused_batch


def refused(message: str, like: Any, *operands: jax.Array) -> Any:
  """Arrays of ``like``'s shapes and dtypes (a pytree of arrays or ``jax.ShapeDtypeStruct``) that
  depend on ``operands`` (the inputs the refused computation would have read: their derivatives
  and batches are refused too) and whose lowering, on any platform, raises ``ValueError(message)``;
  run eagerly it raises at once."""
  leaves, tree = jax.tree.flatten(like)
  operands = [x for x in jax.tree.leaves(operands) if isinstance(x, jax.Array | np.ndarray)]
  out = [
    _refused_p.bind(*operands, shape=tuple(x.shape), dtype=np.dtype(x.dtype), message=str(message))
    for x in leaves
  ]
  return jax.tree.unflatten(tree, out)


_one_platform_p = jex_core.Primitive("jaxpe_one_platform")
"""Its operands unchanged; lowering a program for several platforms at once raises its message."""
_one_platform_p.multiple_results = True
_one_platform_p.def_abstract_eval(lambda *xs, message: [jax.core.ShapedArray(x.shape, x.dtype) for x in xs])
_one_platform_p.def_impl(lambda *xs, message: list(xs))


def _one_platform_lowering(ctx, *xs, message):
  if len(ctx.module_context.platforms) > 1:
    raise ValueError(message)
  return list(xs)


mlir.register_lowering(_one_platform_p, _one_platform_lowering)
ad.deflinear(
  _one_platform_p,
  lambda cts, *, message: _one_platform_p.bind(*map(ad.instantiate_zeros, cts), message=message),
)
batching.primitive_batchers[_one_platform_p] = lambda xs, dims, *, message: (
  _one_platform_p.bind(*xs, message=message),
  dims,
)


def one_platform(*arrays: jax.Array, message: str) -> list[jax.Array]:
  """``arrays`` unchanged, in a program that must be lowered for one platform at a time: lowering it
  for several (``jax.export(..., platforms=("cpu", "cuda"))``) raises ``ValueError(message)``. jax
  lowers every kept branch of a multi-platform ``platform_dependent`` for every platform in the
  list, which a Pallas or cuDNN kernel cannot survive; put it on a kernel branch's inputs so the
  clear error comes first."""
  return _one_platform_p.bind(*arrays, message=str(message))


def once_differentiable(fn: Callable[..., Any], message: str) -> Callable[..., Any]:
  """``fn`` (arrays in, a pytree of arrays out) with its own first derivative, whose derivative in
  turn (a second derivative: ``jax.grad`` of ``jax.grad``, ``jax.hessian``) is ``refused(message)``:
  the program traces, and only lowering it for a platform that runs ``fn`` raises ``message``.

  For a kernel that one platform's branch of ``per_platform`` runs (a Pallas or cuDNN kernel, whose
  backward pass cannot be differentiated): jax differentiates every branch of ``platform_dependent``
  at trace time, so without it a second derivative failed inside jax (a raw linearization error or
  assertion) even on a platform whose own branch (``xla``) differentiates twice. The first derivative
  is the kernel's own (``jax.vjp`` of ``fn``: no recomputation). Pass every array ``fn`` is
  differentiated with respect to as an argument (closed-over values are constants to it)."""
  message = str(message)

  def inexact(x) -> bool:
    dtype = np.dtype(getattr(x, "dtype", np.float32))
    return dtype != jax.dtypes.float0 and jnp.issubdtype(dtype, jnp.inexact)

  def refused_tangents(primal_out, tangents):
    """Tangents of ``primal_out`` that refuse to lower (float0 zeros for its integer leaves)."""
    operands = [t for t in jax.tree.leaves(tangents) if inexact(t)]
    leaves, tree = jax.tree.flatten(primal_out)
    out = [
      refused(message, x, *operands) if inexact(x) else np.zeros(jnp.shape(x), jax.dtypes.float0)
      for x in leaves
    ]
    return jax.tree.unflatten(tree, out)

  # Once differentiated, the kernel's forward pass (inside fwd) and its backward pass (pullback) are
  # plain operations of the derivative's program: a second derivative would differentiate the kernels.
  # The kernel's residuals travel as arrays (a pullback's treedef differs between traces of fwd).
  pullback_tree = {}

  @jax.custom_jvp
  def forward(*args):
    out, vjp_fn = jax.vjp(fn, *args)
    residuals, pullback_tree["tree"] = jax.tree.flatten(vjp_fn)
    return out, residuals

  @forward.defjvp
  def forward_jvp(primals, tangents):
    out = forward(*primals)
    return out, refused_tangents(out, tangents)

  @jax.custom_jvp
  def pullback(residuals, ct):
    return jax.tree.unflatten(pullback_tree["tree"], residuals)(ct)

  @pullback.defjvp
  def pullback_jvp(primals, tangents):
    out = pullback(*primals)
    return out, refused_tangents(out, tangents)

  @jax.custom_vjp
  def call(*args):
    return fn(*args)

  call.defvjp(forward, pullback)
  return call


def per_platform(branches: Mapping[str, Callable[[], Any]], default: Callable[[], Any] | None = None) -> Any:
  """The value of ``branches[p]()`` for the platform ``p`` the program is lowered for.

  Args:
    branches: lowering platform (``PLATFORMS``) -> a function of no arguments (closing over its
      operands) returning a pytree of arrays; every branch returns the same shapes and dtypes.
    default: the branch of any other platform, or None (lowering for another platform is an error).

  Branches that are the same function object are traced once (``default`` too, when it is one of
  them: another platform then has no branch); when every platform shares one branch it is called
  directly (no ``platform_dependent``). Called eagerly, only the host's branch runs; traced under an
  abstract mesh of one platform's devices (``context_platform``), only that platform's branch is traced.
  """
  if not branches:
    raise ValueError("per_platform needs at least one branch")
  known = context_platform()
  if known is not None:  # tracing for one platform (an abstract mesh of its devices): that branch only
    branch = branches.get(known, default)
    if branch is None:
      raise ValueError(
        f"no branch for platform {known!r} (the abstract mesh's devices); got {sorted(branches)}"
      )
    return branch()
  distinct = {id(fn): fn for fn in branches.values()}
  if default is not None and id(default) in distinct:
    default = None
  if len(distinct) == 1 and default is None:
    return next(iter(distinct.values()))()
  return jax.lax.platform_dependent(default=default, **dict(branches))


__all__ = [
  "PLATFORMS",
  "check_platform",
  "context_platform",
  "host_platform",
  "once_differentiable",
  "one_platform",
  "per_platform",
  "refused",
]
