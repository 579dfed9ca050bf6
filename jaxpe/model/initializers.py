"""Parameter initialisers of the decoder, each annotated with the parameter's logical axis names
(``jaxpe.model.partitioning`` maps the names onto mesh axes)."""

from __future__ import annotations

from flax import nnx


def normal(std: float, names: tuple[str | None, ...]):
  """Normal(0, ``std``) initialiser of a parameter whose dimensions are named ``names``."""
  return nnx.with_partitioning(nnx.initializers.normal(std), names)


def zeros(names: tuple[str | None, ...]):
  """Zeros initialiser of a parameter whose dimensions are named ``names``."""
  return nnx.with_partitioning(nnx.initializers.zeros_init(), names)


def ones(names: tuple[str | None, ...]):
  """Ones initialiser of a parameter whose dimensions are named ``names``."""
  return nnx.with_partitioning(nnx.initializers.ones_init(), names)
