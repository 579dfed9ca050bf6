"""Ceilings measured where they are used: at the shapes they are compared with, in the same process
and threads, timed alternately with what they bound, the best of several rounds.

A ratio against a ceiling is ``ceiling time / measured time`` for the same work, so it cannot exceed 1
unless the measured code beats the ceiling's own program at the same shapes (then the ceiling is
wrong and the ratio says so). Two kinds:

* **matmul**: the float32 matmuls a decoder's step needs, each timed alone as ``[b, m, k] @ [b, k,
  n]`` at its own shape (``decoder_matmuls``); the ceiling time of a step is the sum over its
  matmuls of count x the best time of that shape. A train step's matmuls are the forward products
  (q, k, v, o, MLP up and down, logits; attention's ``q k^T`` and ``p v`` per head) and for each
  the two backward products (``dX = dY W^T``, ``dW = X^T dY``). Causal attention needs only the
  ``T (T + 1) / 2`` query-key pairs of each head, so its products count that fraction of their full
  shape's FLOPs and time (an implementation may compute the masked half too, but it is not work
  the model needs). Model FLOPs (``useful_flops``) are the same sum of FLOPs; the ratio of the
  achieved model FLOP/s to the ceiling's is then ``ceiling seconds / step seconds``.
* **elementwise**: ``x * 2 + 1`` on the op's own input arrays, zero-padded to the op's output shapes
  (one fused read and write of the same bytes, ``bandwidth_fn``).

Source: the ``model FLOPs utilisation`` of PaLM (Chowdhery et al., arXiv 2204.02311, appendix B)
with causal attention counted as in FlashAttention-2 (Dao, arXiv 2307.08691, section 4.1).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpe.model import encodings


def alternate(fns: dict[str, Callable[[], Any]], *, rounds: int, warmup: int = 1) -> dict[str, list[float]]:
  """Wall seconds of each ``fn()`` (which must block until its result is ready), measured in
  ``rounds`` rounds that call every function once in turn, after ``warmup`` untimed calls each
  (compilation). Alternating spreads a shared machine's load over all of them alike."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return times


def median(times: Sequence[float]) -> float:
  return statistics.median(times)


def best(times: Sequence[float]) -> float:
  """The ceiling's estimate: its fastest round (a ceiling is an upper bound on speed)."""
  return min(times)


def blocking(fn: Callable, *args) -> Callable[[], Any]:
  """``fn`` jitted, as a no-argument call that waits for its result."""
  jitted = jax.jit(fn)
  return lambda: jax.block_until_ready(jitted(*args))


@dataclass(frozen=True)
class Matmul:
  """``count`` float32 products ``[batch, m, k] @ [batch, k, n]``, of which the model needs the
  fraction ``useful`` (causal attention: ``(T + 1) / 2T``)."""

  batch: int
  m: int
  k: int
  n: int
  count: int = 1
  useful: float = 1.0

  @property
  def shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.m, self.k, self.n)

  @property
  def flops(self) -> float:
    """Model FLOPs of all ``count`` products: ``2 batch m k n x useful`` each."""
    return 2.0 * self.batch * self.m * self.k * self.n * self.count * self.useful


def _with_backward(fwd: list[Matmul], backward: bool) -> list[Matmul]:
  out = list(fwd)
  if backward:
    for mm in fwd:  # Y = X W: dX = dY W^T [m, n] @ [n, k]; dW = X^T dY [k, m] @ [m, n]
      out.append(Matmul(mm.batch, mm.m, mm.n, mm.k, mm.count, mm.useful))
      out.append(Matmul(mm.batch, mm.k, mm.m, mm.n, mm.count, mm.useful))
  return out


def decoder_matmuls(cfg, batch: int, seq: int, *, backward: bool = True) -> list[Matmul]:
  """The matmuls of a ``jaxpe.model.config.ModelConfig`` decoder on ``[batch, seq]`` tokens: the
  forward pass, and with ``backward`` the two products of each in the backward pass.

  Per layer, with M = B T rows: q ``[M, D] @ [D, N Hq]``, k ``[M, D] @ [D, K Hq]``, v
  ``[M, D] @ [D, K H]``, o ``[M, N H] @ [N H, D]``, MLP ``[M, D] @ [D, F]`` and ``[M, F] @ [F, D]``;
  attention ``[B N, T, Hq] @ [B N, Hq, T]`` and ``[B N, T, T] @ [B N, T, H]`` (causal: useful
  ``(T + 1) / 2T``); the logits ``[M, D] @ [D, V]`` once (tied or not). Hq is H plus the
  encoding's extra q/k projection outputs (``rope_alibi_in_projection``: 2); q.k in attention has
  rope_alibi's H + 2k dims. FIRE adds its MLP on the causal pairs (``[B, T T, 1] @ [1, F]``,
  ``[B, T T, F] @ [F, N]``, useful ``(T + 1) / 2T``), CoPE ``q @ pos_emb`` (``[B N, T, H] @ [H, P]``).
  Embedding lookups and LayerNorms are no matmuls.
  """
  d, n, kv, h, f, v = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.mlp_size, cfg.vocab_size
  hq = h + encodings.for_config(cfg).qk_extra_dims()
  hk = h + 2 * cfg.rope_alibi_order if cfg.pos_encoding == "rope_alibi" else hq  # q.k in attention
  rows, layers = batch * seq, cfg.num_layers
  causal = (seq + 1) / (2 * seq)
  fwd = [
    Matmul(1, rows, d, n * hq, layers),
    Matmul(1, rows, d, kv * hq, layers),
    Matmul(1, rows, d, kv * h, layers),
    Matmul(1, rows, n * h, d, layers),
    Matmul(1, rows, d, f, layers),
    Matmul(1, rows, f, d, layers),
    Matmul(batch * n, seq, hk, seq, layers, causal),
    Matmul(batch * n, seq, seq, h, layers, causal),
    Matmul(1, rows, d, v, 1),
  ]
  if cfg.pos_encoding == "fire":  # the MLP 1 -> F -> N on every causal (query, key) pair
    width = cfg.fire_mlp_width
    fwd += [
      Matmul(batch, seq * seq, 1, width, layers, causal),
      Matmul(batch, seq * seq, width, n, layers, causal),
    ]
  if cfg.pos_encoding == "cope":  # q @ pos_emb: [T, H] @ [H, P] per head (P = cope_npos_max or max_len)
    fwd.append(Matmul(batch * n, seq, h, cfg.cope_npos_max or cfg.max_len, layers))
  return _with_backward(fwd, backward)


def useful_flops(matmuls: Sequence[Matmul]) -> float:
  """The model FLOPs of ``matmuls`` (``Matmul.flops`` summed)."""
  return sum(mm.flops for mm in matmuls)


ORIENTATIONS = ("NN", "TN", "NT")
"""Operand layouts timed for each shape: ``a @ b``, ``a^T @ b`` (a stored ``[k, m]``) and ``a @ b^T``
(b stored ``[n, k]``): a step's backward products take them all, and XLA's speed differs by layout."""


def matmul_fns(
  matmuls: Sequence[Matmul], orientations: Sequence[str] = ORIENTATIONS
) -> dict[tuple[tuple[int, int, int, int], str], Callable[[], Any]]:
  """One blocking jitted product per distinct shape ``(batch, m, k, n)`` of ``matmuls`` and
  orientation (``ORIENTATIONS``), on float32 normal operands (no batch axis when batch is 1)."""
  fns = {}
  shapes = list(dict.fromkeys(mm.shape for mm in matmuls))
  for i, (batch, m, k, n) in enumerate(shapes):
    lead = () if batch == 1 else (batch,)

    def normal(j, *shape, i=i, lead=lead):
      return jax.random.normal(jax.random.key(3 * i + j), (*lead, *shape), jnp.float32)

    for o in orientations:
      if o == "NN":
        fns[(batch, m, k, n), o] = blocking(jnp.matmul, normal(0, m, k), normal(1, k, n))
      elif o == "TN":
        fns[(batch, m, k, n), o] = blocking(
          lambda a, b: jnp.matmul(a.mT, b), normal(0, k, m), normal(1, k, n)
        )
      elif o == "NT":
        fns[(batch, m, k, n), o] = blocking(
          lambda a, b: jnp.matmul(a, b.mT), normal(0, m, k), normal(1, n, k)
        )
      else:
        raise ValueError(f"orientations must be among {ORIENTATIONS}, got {o!r}")
  return fns


def best_by_shape(times: dict[Any, list[float]]) -> dict[tuple[int, int, int, int], float]:
  """The best seconds of each shape over its orientations, from ``alternate``'s times of
  ``matmul_fns`` (other keys are ignored)."""
  out: dict[tuple[int, int, int, int], float] = {}
  for key, ts in times.items():
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], tuple):
      out[key[0]] = min(out.get(key[0], float("inf")), best(ts))
  return out


def ceiling_seconds(matmuls: Sequence[Matmul], best_seconds: dict[tuple[int, int, int, int], float]) -> float:
  """Seconds of ``matmuls`` at the best measured time of each shape, times count and ``useful``."""
  return sum(mm.count * mm.useful * best_seconds[mm.shape] for mm in matmuls)


def bandwidth_fn(inputs: Sequence[jax.Array], out_shapes: Sequence[tuple[int, ...]]) -> Callable[[], Any]:
  """The elementwise ceiling of an op reading ``inputs`` and writing arrays of ``out_shapes``: a
  blocking jitted ``x * 2 + 1`` of each input zero-padded at the end of each axis to its output's
  shape (one fused loop per output; pairs input i with output i)."""
  if len(inputs) != len(out_shapes):
    raise ValueError(f"bandwidth_fn pairs inputs with outputs, got {len(inputs)} and {len(out_shapes)}")

  def fn(*xs):
    return tuple(
      jnp.pad(x * 2.0 + 1.0, [(0, o - s) for s, o in zip(x.shape, shape, strict=True)])
      for x, shape in zip(xs, out_shapes, strict=True)
    )

  return blocking(fn, *inputs)
