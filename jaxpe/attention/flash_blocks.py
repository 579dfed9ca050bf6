"""Block reads and writes of the ``flash`` Triton kernels (``flash_kernels``): a block's q/k dims as
lane-range parts (the rotate-half split), and the lane masks of H-wide arrays read in blocks of D =
next_power_of_two(H) lanes (``Config.lanes``: lanes past H load as 0 and are not stored, as jax's
Triton attention reads its ``head_dim_padded`` blocks), so q, k, v and their gradients need no padded
copies. Every load is one indexer (Triton lowers one per load). ``cfg``: ``flash_kernels.Config``
(None or ``lanes`` 0: plain ref indexing, the Mosaic kernels' path).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _lane_mask(cfg, start: int, width: int):
  """Bool ``[1, width]``: the lanes ``start..start + width`` of a block that lie inside the caller's H."""
  return (start + jnp.arange(width) < cfg.lanes)[None, :]


def read(cfg, ref, idx, start: int = 0):
  """``ref[idx]`` (a ``[rows, width]`` block); with ``cfg.lanes`` a masked load: lanes at or past H
  (``start``: the block's first lane) read as 0, nothing read past the caller's array."""
  if not cfg.lanes:
    return ref[idx]
  view = ref.at[idx]
  return plgpu.load(view, mask=_lane_mask(cfg, start, view.shape[-1]), other=0)


def write(cfg, ref, value, idx=None, start: int = 0):
  """``ref[idx] = value`` in ref's dtype (``idx`` None: the whole block); with ``cfg.lanes`` a masked
  store: lanes at or past H are not written (they are not in the caller's array)."""
  value = value.astype(ref.dtype)
  if cfg is None or not cfg.lanes:
    ref[... if idx is None else idx] = value
    return
  plgpu.store(ref if idx is None else ref.at[idx], value, mask=_lane_mask(cfg, start, value.shape[-1]))


def parts(cfg, ref, rows, head=()):
  """A block's q/k dims as a tuple of parts: ``(x [rows, D],)``; split (rotate-half, h = ``cfg.split``):
  ``(x1 [rows, h], x2 [rows, h], rest [rows, D - 2h])`` read by lane ranges (no rest when 2h = D).
  ``head``: the head index of a ``[T, G, D]`` block (dk/dv's q side), after the rows in the same
  indexer (Triton lowers one indexer per load, not ``ref.at[:, g][rows]``)."""
  if not cfg.split:
    return (read(cfg, ref, (rows, *head, slice(None))),)
  h, width = cfg.split, ref.shape[-1]
  parts = [read(cfg, ref, (rows, *head, pl.ds(0, h))), read(cfg, ref, (rows, *head, pl.ds(h, h)), h)]
  if width > 2 * h:
    parts.append(read(cfg, ref, (rows, *head, pl.ds(2 * h, width - 2 * h)), 2 * h))
  return tuple(parts)


def store(ref, parts, cfg=None):
  """Write a tuple of parts (``parts``) to the lane ranges of ``ref`` (``cfg.lanes``: masked)."""
  if len(parts) == 1:
    write(cfg, ref, parts[0])
    return
  start = 0
  for x in parts:
    write(cfg, ref, x, (slice(None), pl.ds(start, x.shape[-1])), start)
    start += x.shape[-1]


def block_width(name: str, x, cfg) -> int:
  """Lanes of operand ``name``'s blocks: its minor dim, or D (the next power of two) for the
  q / k / v-wide operands of an H-wide caller (``cfg.lanes``)."""
  if cfg.lanes and name in ("q", "k", "v", "o", "do", "dq", "dk", "dv"):
    return pl.next_power_of_2(x.shape[-1])
  return x.shape[-1]
