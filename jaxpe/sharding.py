"""Device mesh, logical-axis rules and sharded model creation (``jax.jit`` shardings).

The decoder's parameters carry logical axis names; ``LOGICAL_RULES`` maps them onto the two mesh
axes ``data`` (batch, data parallelism) and ``model`` (heads / MLP / vocab, tensor parallelism).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpe.config import ModelConfig

MESH_AXES = ("data", "model")
LOGICAL_RULES = (
  ("batch", "data"),
  ("vocab", "model"),
  ("heads", "model"),
  ("kv_heads", "model"),
  ("mlp", "model"),
  ("embed", None),
  ("head_dim", None),
  ("pos", None),
)


def make_mesh(shape: tuple[int, int] = (-1, 1)) -> jax.sharding.Mesh:
  """A ``(data, model)`` mesh over all devices; ``-1`` takes the remaining devices.

  Axes are ``Auto`` (jax.make_mesh's default Explicit axes break NNX embedding lookups).

  Args:
    shape: ``(data, model)`` axis sizes in devices; at most one may be ``-1``.

  Raises:
    ValueError: more than one ``-1``, or the shape does not multiply out to the device count.
  """
  n = jax.device_count()
  data, model = shape
  if data == -1 and model == -1:
    raise ValueError(f"mesh_shape may have at most one -1, got {shape}")
  if data == -1:
    data = n // model if model > 0 and n % model == 0 else 0
  if model == -1:
    model = n // data if data > 0 and n % data == 0 else 0
  if data <= 0 or model <= 0 or data * model != n:
    raise ValueError(f"mesh_shape {shape} does not fit {n} devices (data * model must equal {n})")
  return jax.make_mesh((data, model), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def state_shardings(state, mesh: jax.sharding.Mesh):
  """NamedShardings for an NNX state (or abstract state) from its logical axis names.

  Returns a pytree like ``state`` whose leaves are ``NamedSharding`` on ``mesh`` (``LOGICAL_RULES``
  maps e.g. ``heads`` to ``model``; unnamed axes are replicated).
  """
  with nnx.logical_axis_rules(LOGICAL_RULES):
    return nnx.get_named_sharding(state, mesh)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Sharding for ``[B, ...]`` arrays (token batches ``[B, T + 1]``): B split over the ``data``
  axis, the rest replicated. B must divide by the data axis size (``check_divisible``)."""
  return NamedSharding(mesh, P("data"))


def create_sharded(make, mesh: jax.sharding.Mesh):
  """Builds ``make()`` (a function returning an NNX object) directly into its shardings.

  Shapes come from ``nnx.eval_shape``; the init is jitted with ``out_shardings`` so that no
  device holds an unsharded copy. Returns the NNX object (same graph as ``make()``) with its
  arrays sharded on ``mesh``.
  """
  abstract = nnx.eval_shape(make)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh)

  def init():
    return nnx.state(make())

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def check_divisible(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_size: int) -> None:
  """Checks that sharded sizes divide by their mesh axes: ``batch_size`` (B) by ``data``; N, K, F
  and V by ``model``.

  Raises:
    ValueError: naming the size (``batch_size``, ``num_heads``, ``num_kv_heads``, ``mlp_dim``,
      ``vocab_size``) and the axis size it must divide by.
  """
  data, model = mesh.shape["data"], mesh.shape["model"]
  if batch_size % data:
    raise ValueError(f"batch_size ({batch_size}) must be divisible by the data axis ({data})")
  for name, size in (
    ("num_heads", cfg.num_heads),
    ("num_kv_heads", cfg.kv_heads),
    ("mlp_dim", cfg.mlp_size),
    ("vocab_size", cfg.vocab_size),
  ):
    if size % model:
      raise ValueError(f"{name} ({size}) must be divisible by the model axis ({model})")
