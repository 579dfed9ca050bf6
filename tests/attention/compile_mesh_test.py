"""The TPU kernels compile under ``jax.set_mesh(<a mesh of compile-only devices>)``, as maxtext-style
AOT scripts set it, and the splash kernel still runs (interpret mode) under ``jax.set_mesh`` of CPU
devices with the same result.

Issue 45: under ``jax.set_mesh`` of compile-only TPU devices the splash path failed inside
``make_splash_mha`` (its ``jnp.array`` of the mask tables: "'Executable' object has no attribute
'local_devices'"); with the shardings alone it compiled. The kind: a kernel that makes concrete
arrays while it is traced (constant tables under ``ensure_compile_time_eval``) under a mesh context;
its members are the TPU backends ``auto`` / ``splash`` / ``flash`` / ``xla`` (each compiled here).
The reference of the interpret run is ``xla`` attention outside any mesh.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import AttentionMask, attention

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason='libtpu is not installed (pip install "jax[tpu]==<the installed jax>")',
)


@pytest.fixture(autouse=True)
def _libtpu_env(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # xdist workers each load libtpu


def _fn(backend, interpret=False):
  def fn(q, k, v):
    return attention(
      q, k, v, scale=0.125, mask=AttentionMask(causal=True), implementation=backend, interpret=interpret
    )

  return fn


@needs_libtpu
@pytest.mark.parametrize("backend", ["splash", "auto", "flash", "xla"])
def test_compiles_for_v5e_under_set_mesh_of_compile_only_devices(backend):
  from jaxpe.train import targets

  devices = targets.compile_devices(targets.target("v5e-8"))
  mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("x",))
  struct = jax.ShapeDtypeStruct(
    (1, 256, 2, 128), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
  with jax.set_mesh(mesh):
    lowered = jax.jit(_fn(backend)).lower(struct, struct, struct)
    lowered.compile()
  if backend != "xla":
    assert "tpu_custom_call" in lowered.as_text()


def test_splash_in_interpret_mode_under_set_mesh_of_cpu_devices_matches_xla():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 2, 64)), jnp.float32) for _ in range(3))
  want = _fn("xla")(q, k, v)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",))
  with jax.set_mesh(mesh):
    got = jax.jit(_fn("splash", interpret=True))(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)
