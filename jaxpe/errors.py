"""The exceptions jaxpe defines (one per idea; everything else raises ValueError / TypeError)."""

from __future__ import annotations


class CheckpointError(OSError, ValueError):
  """A checkpoint that cannot be written or read: a training checkpoint (``jaxpe.train``) with no
  intact step, or a BLOOM checkpoint (``jaxpe.bloom``) with missing/unexpected keys, wrong shapes or
  a file that cannot be read. The message names the key or the file; nothing is loaded when it is
  raised. Both an ``OSError`` (what training checkpoints raised) and a ``ValueError`` (what BLOOM
  imports raised), so existing ``except`` clauses keep working."""
