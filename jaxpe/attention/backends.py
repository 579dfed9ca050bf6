"""The attention backends: their names, what each needs, which run here, and ``AlibiSpec``.

Backends (the ``implementation`` argument of ``jaxpe.attention.attention``; one module each):

- ``xla`` (``jaxpe.attention.xla``): ``jaxpe.attention.dot_product_attention`` (einsum, float32
  logits; the reference). Takes a dense bias, any mask, the KV cache.
- ``cudnn`` (``jaxpe.attention.cudnn``): ``jax.nn.dot_product_attention(implementation="cudnn")``
  (cuDNN flash attention, NVIDIA GPU).
- ``splash`` (``jaxpe.attention.splash``): ``jax.experimental.pallas.ops.tpu.splash_attention``
  (TPU; ``interpret=True`` runs it on CPU for tests).
- ``pallas_gpu`` (``jaxpe.attention.pallas_gpu``): ``jax.experimental.pallas.ops.gpu.attention.mha``
  (Triton, GPU; ``interpret=True`` on CPU).
- ``tokamax`` (``jaxpe.attention.tokamax``): ``tokamax.dot_product_attention`` (openxla/tokamax:
  Pallas Mosaic GPU / Triton on GPU, its XLA implementation elsewhere), ALiBi as a native broadcast
  key-only bias. Listed (in ``BACKENDS`` and ``available_backends``) only where the optional package
  ``tokamax`` is installed; elsewhere ``resolve_backend`` refuses it, naming what is available.
- ``flash`` (``jaxpe.attention.flash``): jaxpe's own Pallas flash attention (Triton on GPU, Mosaic
  on TPU, ``interpret=True`` on CPU) with RoPE (``RopeSpec``) and native ALiBi inside the kernel.
- ``auto``: per lowering platform (``AUTO_PREFERENCE``) the first backend that accepts the call:
  splash, then flash on TPU; cudnn, then flash on NVIDIA GPUs; flash on ROCm; xla on the CPU and
  for what every kernel refuses.

Which backend runs is decided for the platform a program is lowered for (``jaxpe.attention.platforms``):
``PLATFORM_BACKENDS`` says what runs where; ``resolve_backend(..., platform=)`` answers for one platform.

The keyword is ``implementation`` (``jax.nn.dot_product_attention``'s name); ``impl=`` is accepted
for one release with a DeprecationWarning (``accepts_impl``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import platforms
from jaxpe.emulation import bf16_exact, lean
from jaxpe.ops import checks as _checks

Backend = Literal["xla", "cudnn", "splash", "pallas_gpu", "flash"]
BACKENDS: tuple[str, ...] = ("xla", "cudnn", "splash", "pallas_gpu", "flash")
# Optional backends, present when their package is installed (name -> importable module name).
OPTIONAL_BACKENDS: dict[str, str] = {"tokamax": "tokamax"}
BACKENDS += tuple(
  name for name, pkg in OPTIONAL_BACKENDS.items() if importlib.util.find_spec(pkg) is not None
)
IMPLEMENTATIONS: tuple[str, ...] = (*BACKENDS, "auto")
# Head-dim multiple each kernel wants (pallas_gpu and flash: the next power of two, 0 here).
HEAD_DIM_MULTIPLE: dict[str, int] = {"xla": 1, "cudnn": 8, "splash": 128, "pallas_gpu": 0, "flash": 0}
HEAD_DIM_MULTIPLE["tokamax"] = 1  # any head dim (tokamax pads inside its kernels)
ALIBI_FORMS: tuple[str, ...] = ("lean", "exact", "rotated")
"""``AlibiSpec.form`` values (``ModelConfig.alibi_emulation``): the ALiBi emulations on fused kernels."""
# Backends that read v at its own head dim (q/k padded separately); the others pad v to q/k's width
# (cudnn through jax.nn.dot_product_attention, which requires one H; pallas_gpu's mha).
OWN_V_DIM: tuple[str, ...] = ("xla", "splash")
# Largest head dim (after the emulation dims and padding) cuDNN's flash attention accepts from compute
# capability 9.0 (Hopper); 128 before (an A100): gpu_cards.cudnn_max_head_dim, per card.
CUDNN_MAX_HEAD_DIM = 256


def accepts_impl(fn):
  """``fn`` that also takes its backend keyword under the old spelling ``impl=`` (DeprecationWarning).

  One name per idea: the backend keyword is ``implementation`` everywhere (as in
  ``jax.nn.dot_product_attention``); ``impl=`` works for one release. Both at once: TypeError.
  """

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if "impl" in kwargs:
      if "implementation" in kwargs:
        raise TypeError(f"{fn.__name__}() got implementation= and its deprecated spelling impl=; give one")
      warnings.warn(
        f"{fn.__name__}(impl=...) is deprecated: the keyword is implementation= "
        "(as in jax.nn.dot_product_attention)",
        DeprecationWarning,
        stacklevel=2,
      )
      kwargs["implementation"] = kwargs.pop("impl")
    return fn(*args, **kwargs)

  return wrapper


@dataclasses.dataclass(frozen=True)
class AlibiSpec:
  """ALiBi for ``attention``: native bias on ``xla``, bias-free emulation on fused kernels.

  Checked by ``attention`` (every backend) against q and k, not at construction.

  Attributes:
    slopes: ``[N]`` concrete float slopes (numpy or Python), finite, >= 0 (0 = no ALiBi on that
      head); traced slopes raise ValueError.
    q_positions: ``[B, T]`` integer token indices of the queries, >= 0.
    k_positions: ``[B, S]`` integer token indices of the keys, >= 0.
    max_position: static bound on positions: the lean and exact forms use base-256 digits enough
      for positions below it (2 digits up to 65536, 3 up to 2^24); on a fused kernel with either
      form, concrete positions at or above it raise ValueError, traced ones cannot be checked (their high digits would be dropped), so
      give a bound that holds for every position (the decoder uses at least 65536). The rotated
      form's context for theta when ``theta`` is None.
      An int in 1..2^24 on every backend (``xla`` does not use it).
    form: ``"lean"`` (the default: ``+m_h (j - j0)``, ALiBi up to a per-row constant softmax ignores;
      keys carry positions shared by every head, queries the slopes; ``P x D`` bf16-exact dims, P
      1..3 slope parts, D position digits: 2..6 below 65536; ``jaxpe.emulation.lean``), ``"exact"``
      (augmented ``-m_h (i - j)``, bf16-exact, 18 dims below 65536) or ``"rotated"`` (order k).
    order: k of the rotated form, an int 1..8.
    theta: radians per token of the rotated form, a finite number > 0, or None (``max_phase`` 0.1
      over ``max_position``).

  Source: ALiBi, Press et al., arXiv 2108.12409; the emulations in ``jaxpe.bf16_exact`` and
  ``jaxpe.emulation``.
  """

  slopes: np.ndarray
  q_positions: jax.Array
  k_positions: jax.Array
  max_position: int
  form: Literal["lean", "exact", "rotated"] = "lean"
  order: int = 1
  theta: float | None = None


def check_alibi_spec(spec, batch: int, t_len: int, s_len: int, num_heads: int, *, fused: bool) -> AlibiSpec:
  """``spec`` checked against q ``[B, T, N, .]`` and k ``[B, S, ., .]``; positions as arrays.

  ``fused``: the checks only the bias-free emulation needs (lean, exact forms: positions below
  ``max_position``; rotated form: every slope > 0).

  Raises:
    TypeError, ValueError: as ``jaxpe.attention.attention`` for ``alibi_spec``.
  """
  if not isinstance(spec, AlibiSpec):
    raise TypeError(f"alibi_spec must be an AlibiSpec or None, got {type(spec).__name__}")
  if isinstance(spec.slopes, jax.core.Tracer):
    raise ValueError("AlibiSpec.slopes must be concrete (numpy or Python numbers), not traced under jit")
  slopes = spec.slopes  # a numpy array of another dtype is named by the float check below
  slopes = slopes if isinstance(slopes, np.ndarray) else _checks.as_array("AlibiSpec.slopes", slopes)
  if not (jnp.issubdtype(slopes.dtype, jnp.floating) or jnp.issubdtype(slopes.dtype, jnp.integer)):
    raise TypeError(f"AlibiSpec.slopes must be a float array, got dtype {slopes.dtype}")
  slopes = np.asarray(slopes, np.float64)
  if slopes.shape != (num_heads,):
    raise ValueError(
      f"AlibiSpec.slopes must have shape [N] = [{num_heads}] (one per query head), got {slopes.shape}"
    )
  if not np.all(np.isfinite(slopes)) or np.any(slopes < 0):
    raise ValueError(
      f"AlibiSpec.slopes must be finite and >= 0 (0 = no ALiBi on that head), got {slopes.tolist()}"
    )
  max_position = spec.max_position
  if isinstance(max_position, bool) or not isinstance(max_position, int | np.integer):
    raise TypeError(f"AlibiSpec.max_position must be an int in 1..2^24, got {max_position!r}")
  if not 1 <= max_position <= 2**24:
    raise ValueError(f"AlibiSpec.max_position must be in 1..2^24, got {max_position}")
  if spec.form not in ALIBI_FORMS:
    raise ValueError(f"AlibiSpec.form must be 'lean', 'exact' or 'rotated', got {spec.form!r}")
  order = spec.order
  if isinstance(order, bool) or not isinstance(order, int | np.integer):
    raise TypeError(f"AlibiSpec.order must be an int in 1..8, got {order!r}")
  if not 1 <= order <= 8:
    raise ValueError(f"AlibiSpec.order must be in 1..8, got {order}")
  theta = spec.theta
  if theta is not None:
    if isinstance(theta, bool | str | bytes | jax.core.Tracer) or np.ndim(theta) != 0:
      raise TypeError(f"AlibiSpec.theta must be None or a number (radians per token), got {theta!r}")
    theta = _checks.check_positive_float("AlibiSpec.theta", theta)
  positions = []
  for name, pos, shape in (
    ("AlibiSpec.q_positions", spec.q_positions, (batch, t_len)),
    ("AlibiSpec.k_positions", spec.k_positions, (batch, s_len)),
  ):
    pos = _checks.checked_positions(name, pos, shape)
    if fused and spec.form != "rotated":  # base-256 digits hold positions below max_position only
      _checks.check_index_range(name, pos, max_position, "AlibiSpec.max_position")
    positions.append(pos)
  if fused and spec.form == "rotated" and np.any(slopes <= 0):
    raise ValueError("the rotated ALiBi emulation needs every slope > 0 (alibi_heads): use form='exact'")
  return dataclasses.replace(
    spec,
    slopes=slopes,
    q_positions=positions[0],
    k_positions=positions[1],
    max_position=int(max_position),
    order=int(order),
    theta=theta,
  )


PLATFORM_BACKENDS: dict[str, tuple[str, ...]] = {
  "cpu": ("xla",),
  "cuda": ("xla", "cudnn", "pallas_gpu", "flash"),
  "rocm": ("xla", "pallas_gpu", "flash"),
  "tpu": ("xla", "splash", "flash"),
}
"""Lowering platform (``platforms.PLATFORMS``) -> the backends that run there natively (``xla``
everywhere; cuDNN on NVIDIA only; the Pallas kernels through Triton on GPUs and Mosaic on TPUs)."""
AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
  "cpu": ("xla",),
  "cuda": ("cudnn", "flash", "xla"),
  "rocm": ("flash", "xla"),
  "tpu": ("splash", "flash", "xla"),
}
"""What ``implementation="auto"`` tries on each lowering platform, in order: the first backend that
accepts the call (a kernel that refuses its arguments, or cannot be traced here, as cuDNN on a host
without it, passes to the next); ``xla`` takes everything."""


def platform_backends(platform: str | None = None) -> tuple[str, ...]:
  """Backends that run natively on lowering platform ``platform`` (``xla`` always).

  Args:
    platform: one of ``platforms.PLATFORMS``, or None for the host's (JAX's default backend).

  Raises:
    ValueError: an unknown ``platform``.
  """
  if platform is None:
    platform = platforms.host_platform()
    return PLATFORM_BACKENDS.get(platform, ("xla",))
  return PLATFORM_BACKENDS[platforms.check_platform("platform", platform)]


def available_backends(*, interpret: bool = False, platform: str | None = None) -> tuple[str, ...]:
  """Backends usable on ``platform`` (None: the host's): the platform's, plus the Pallas ones in
  interpret mode when asked, plus the installed optional ones (``tokamax``: every platform, its XLA
  implementation off GPU/TPU)."""
  interpret = _checks.check_bool("interpret", interpret)
  names = list(platform_backends(platform))
  if interpret:
    names += [b for b in ("splash", "pallas_gpu", "flash") if b not in names]
  names += [b for b in OPTIONAL_BACKENDS if b in BACKENDS and b not in names]
  return tuple(names)


def check_implementation(implementation) -> str:
  """``implementation`` if it names a backend of this install or ``auto`` (any platform).

  Raises:
    ValueError: an unknown name, or an optional backend whose package is not installed (``tokamax``).
  """
  impl = implementation
  if impl in OPTIONAL_BACKENDS and impl not in IMPLEMENTATIONS:
    raise ValueError(
      f"attention implementation {impl!r} needs the optional package {OPTIONAL_BACKENDS[impl]!r}, which is "
      f"not installed here; available: {available_backends()}"
    )
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {impl!r}")
  return impl


def check_backend(implementation) -> str:
  """``implementation`` if it names one backend (``BACKENDS`` or an optional one, installed or not): the
  check of every helper that answers for one backend (``emulation_dim_count``, ``padded_head_dim``,
  ``padded_v_dim``, ``kernel_length``). ``auto`` names no backend until a platform is known.

  Raises:
    ValueError: any other value, ``auto`` included (the message says how to resolve it).
  """
  names = (*BACKENDS, *(b for b in OPTIONAL_BACKENDS if b not in BACKENDS))
  if isinstance(implementation, str) and implementation in names:
    return implementation
  hint = (
    " ('auto' picks one per platform: resolve_backend('auto', platform=...) names it)"
    if implementation == "auto"
    else ""
  )
  raise ValueError(f"implementation must be one of {names}, got {implementation!r}{hint}")


def _check_size(name: str, value) -> int:
  """``value`` as an int >= 0 (Python or numpy int, not a bool), else ``ArgTypeError`` / ValueError."""
  if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
    raise _checks.ArgTypeError(f"{name} must be an integer >= 0, got {value!r} ({type(value).__name__})")
  if value < 0 or value > _checks.MAX_POSITION:
    raise ValueError(f"{name} must be an integer in [0, 2^31], got {value!r}")
  return int(value)


def unavailable_message(implementation: str, *, interpret: bool, platform: str) -> str:
  """The refusal of backend ``implementation`` on lowering platform ``platform``."""
  available = available_backends(interpret=interpret, platform=platform)
  hint = (
    "" if interpret else "; the Pallas kernels (splash, pallas_gpu, flash) run on CPU with interpret=True"
  )
  return (
    f"attention implementation {implementation!r} is not available on platform {platform!r} "
    f"(interpret={interpret}); available: {available}{hint}"
  )


@accepts_impl
def resolve_backend(implementation: str, *, interpret: bool = False, platform: str | None = None) -> str:
  """The backend ``implementation`` names on lowering platform ``platform`` (None: the host's).

  ``auto``: the first of ``AUTO_PREFERENCE[platform]`` that runs there (splash on TPU, cudnn on
  NVIDIA GPUs, flash on ROCm, xla on CPU); ``jaxpe.attention.attention`` also passes over a kernel
  that refuses the call's arguments. ``attention`` resolves per platform when the program is lowered
  (``jaxpe.attention.platforms``), so one jitted function lowers for every platform.

  Raises:
    ValueError: an unknown name, an optional backend whose package is not installed (``tokamax``), or
      a backend ``platform`` cannot run; the message lists what is available (and that the Pallas
      kernels run on CPU with ``interpret=True``).
  """
  impl = check_implementation(implementation)
  interpret = _checks.check_bool("interpret", interpret)
  platform = platforms.host_platform() if platform is None else platforms.check_platform("platform", platform)
  native = platform_backends(platform) if platform in PLATFORM_BACKENDS else ("xla",)
  if impl == "auto":
    return next(b for b in AUTO_PREFERENCE.get(platform, ("xla",)) if b in native)
  if impl not in available_backends(interpret=interpret, platform=platform):
    raise ValueError(unavailable_message(impl, interpret=interpret, platform=platform))
  return impl


@accepts_impl
def emulation_dim_count(
  implementation: str,
  *,
  alibi_form: str | None = None,
  order: int = 1,
  max_position: int = 1,
  slopes=None,
  scale: float | None = None,
) -> int:
  """Extra q/k dims the emulation costs on backend ``implementation`` (before head-dim padding).

  ``xla``: 0 for native ALiBi, 2k float32 dims for ``rope_alibi``. Fused kernels: the lean form
  ``lean_alibi_dim_count(slopes, kernel scale, max_position)`` (P slope parts x D digits: 2..6
  below 65536; without ``slopes``/``scale`` the most, P = 3), the exact form
  ``exact_alibi_dim_count(max_position)`` (18 below 65536), the rotated form 18k (9 bf16-exact
  products per float32 dim). ``flash`` and ``tokamax``: as ``xla`` (native ALiBi; float32 dims in
  the kernel, or contracted at HIGHEST).

  Raises:
    ValueError: an unknown ``implementation`` (``BACKENDS`` and the optional ones) or ``alibi_form``
      (None or one of ``ALIBI_FORMS``); as ``jaxpe.emulation.lean.lean_alibi_dim_count`` for the lean form.
  """
  implementation = check_backend(implementation)
  if alibi_form is not None and alibi_form not in ALIBI_FORMS:
    raise ValueError(f"alibi_form must be None or one of {ALIBI_FORMS}, got {alibi_form!r}")
  implementation = "xla" if implementation in ("flash", *OPTIONAL_BACKENDS) else implementation
  if alibi_form is None:
    return 0
  if implementation == "xla" and alibi_form in ("lean", "exact"):
    return 0
  if alibi_form == "lean":
    digits = lean.lean_digit_count(max_position)
    if slopes is None or scale is None:
      return lean.MAX_SLOPE_PARTS * digits
    dot_scale = 1.0 if implementation == "splash" else scale
    return lean.lean_alibi_dim_count(slopes, dot_scale, max_position)
  if alibi_form == "exact":
    return bf16_exact.exact_alibi_dim_count(max_position)
  return 2 * order * (1 if implementation == "xla" else 3 * bf16_exact.PARTS)


@accepts_impl
def padded_v_dim(implementation: str, head_dim: int, qk_dim: int) -> int:
  """v head dim backend ``implementation`` reads: H on ``OWN_V_DIM`` backends (xla, splash), else ``qk_dim``.

  cudnn: ``jax.nn.dot_product_attention`` requires one head dim for q, k and v (cuDNN itself takes a
  different v dim, "MLA", on Hopper with cuDNN >= 9.10, but only through jax's private
  ``jax._src.cudnn.fused_attention_stablehlo``, which jaxpe does not call). pallas_gpu: jax's
  ``mha`` requires equal dims.

  Raises:
    ValueError: ``implementation`` not one backend (``check_backend``: ``auto`` too); a dim not an int
      in [0, 2^31] (``ArgTypeError`` for a non-integer).
  """
  implementation = check_backend(implementation)
  head_dim, qk_dim = _check_size("head_dim", head_dim), _check_size("qk_dim", qk_dim)
  return head_dim if implementation in OWN_V_DIM else qk_dim


@accepts_impl
def padded_head_dim(implementation: str, dim: int) -> int:
  """Head dim backend ``implementation`` computes with for ``dim`` q/k/v dims (multiple or next power of two).

  Raises:
    ValueError: ``implementation`` not one backend (``check_backend``: ``auto`` too); ``dim`` not an
      int in [0, 2^31] (``ArgTypeError`` for a non-integer).
  """
  multiple = HEAD_DIM_MULTIPLE[check_backend(implementation)]
  dim = _check_size("dim", dim)
  if multiple == 0:
    return 1 << max(dim - 1, 0).bit_length()
  return -(-dim // multiple) * multiple


@accepts_impl
def kernel_length(implementation: str, length: int) -> int:
  """Sequence length backend ``implementation`` computes with for T = ``length`` (whole blocks).

  splash: a multiple of 128 (its block). pallas_gpu and flash: the next power of two >= 16 up to
  128 (Triton blocks are powers of two), above that a multiple of 128. cudnn, xla: T.

  Raises:
    ValueError: ``implementation`` not one backend (``check_backend``: ``auto`` too); ``length`` not
      an int in [0, 2^31] (``ArgTypeError`` for a non-integer).
  """
  implementation = check_backend(implementation)
  length = _check_size("length", length)
  if implementation == "splash":
    return -(-length // 128) * 128
  if implementation in ("pallas_gpu", "flash"):
    return max(16, 1 << (length - 1).bit_length()) if length <= 128 else -(-length // 128) * 128
  return length
