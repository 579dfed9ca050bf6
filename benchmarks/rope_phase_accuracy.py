"""Accuracy of RoPE cos/sin at positions below 2^31: exact phases vs float32-product phases.

  python benchmarks/rope_phase_accuracy.py [--positions 2000] [--head-dim 128]

For random integer positions in [0, 2^31) (plus 0, 2^31 - 1, 17780, 131072) and every frequency of
``rope_inv_freq(H, base)`` in float64, prints the max |error| of cos and sin from
``jaxpe.rope_cos_sin`` (under jit, positions traced) against

  * the exact value: the phase ``p * theta`` (theta's exact binary value) reduced modulo 2 pi in
    rational arithmetic with pi to 75 digits, then ``math.cos`` / ``math.sin``;
  * the plain float64 value ``cos(float64(p) * theta)`` (itself off by up to ~1.2e-7 there),

for ``phase_precision="exact"`` (default) and ``"float32"`` (the phases of HF / Meta / vLLM).
"""

from __future__ import annotations

import argparse
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

import jaxpe

_TWO_PI = 2 * Fraction("3.141592653589793238462643383279502884197169399375105820974944592307816406286")


def exact_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  cos = np.empty((positions.size, inv_freq.size))
  sin = np.empty_like(cos)
  for j, theta in enumerate(inv_freq.tolist()):
    t = Fraction(theta)
    for i, p in enumerate(positions.tolist()):
      phase = p * t
      r = float(phase - round(phase / _TWO_PI) * _TWO_PI)
      cos[i, j], sin[i, j] = math.cos(r), math.sin(r)
  return cos, sin


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--positions", type=int, default=2000)
  parser.add_argument("--head-dim", type=int, default=128)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  pos = np.concatenate([[0, 2**31 - 1, 17780, 131072], rng.integers(0, 2**31, args.positions)])
  print(f"{pos.size} positions in [0, 2^31) x all {args.head_dim // 2} frequencies, H = {args.head_dim}")
  print("base        precision  max|cos err| max|sin err|  (vs exact)   max|err| vs plain float64")
  for base in (1e4, 5e5, 1e6):
    inv = jaxpe.rope_inv_freq(args.head_dim, base=base, dtype=np.float64)
    want_cos, want_sin = exact_cos_sin(pos, inv)
    naive = pos.astype(np.float64)[:, None] * inv
    for precision in ("exact", "float32"):
      fn = jax.jit(
        lambda p, precision=precision, inv=inv: jaxpe.rope_cos_sin(p, inv, phase_precision=precision)
      )
      cos, sin = (np.asarray(a, np.float64) for a in fn(jnp.asarray(pos, jnp.int32)))
      err_c, err_s = np.abs(cos - want_cos).max(), np.abs(sin - want_sin).max()
      err_n = max(np.abs(cos - np.cos(naive)).max(), np.abs(sin - np.sin(naive)).max())
      print(f"{base:<11g} {precision:<10} {err_c:12.3g} {err_s:12.3g}  {err_n:26.3g}")
  t = 10000.0 ** (-2 / 128)
  for precision in ("exact", "float32"):
    cos, sin = jaxpe.rope_cos_sin(
      jnp.asarray([17780]), jaxpe.rope_inv_freq(128, dtype=np.float64), phase_precision=precision
    )
    print(
      f"17780, H 128, base 1e4, pair 1, {precision}: cos {float(cos[0, 1]):.7f} sin {float(sin[0, 1]):.7f} "
      f"(float64: cos {math.cos(17780 * t):.7f} sin {math.sin(17780 * t):.7f})"
    )


if __name__ == "__main__":
  main()
