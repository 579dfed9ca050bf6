"""Every backend, the decoder, its train step and generation lower for GPU and TPU from this CPU host.

``jax.jit(f).trace(...).lower(lowering_platforms=(p,))`` runs every lowering rule of platform ``p``
(Triton, Mosaic TPU, jax's cuDNN rule, sharding over an abstract mesh of ``p``'s devices) without a
device: these tests check what each program would hand the device (``benchmarks/lowering_check.py``
prints the same table). The backend is chosen for the platform being lowered, so one trace lowers to
cuDNN or Triton for ``cuda``, Mosaic for ``tpu`` and the CPU kernel only for ``cpu``; a backend a
platform cannot run is refused, with its message, when lowering for that platform only.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.attention import AttentionMask, attention

ROOT = Path(__file__).resolve().parents[2]


def _load():
  spec = importlib.util.spec_from_file_location("lowering_check", ROOT / "benchmarks" / "lowering_check.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules.setdefault("lowering_check", module)
  spec.loader.exec_module(module)
  return module


lc = _load()
PLATFORMS = lc.PLATFORMS


def _check(result, expected, platform, backend):
  if expected is None:  # refused, naming the platform
    assert isinstance(result, ValueError), f"{backend} on {platform} lowered but must be refused"
    assert f"attention implementation {backend!r} is not available on platform {platform!r}" in str(result)
    return
  assert not isinstance(result, Exception), f"{backend} on {platform}: {lc.describe(result)}"
  kinds = lc.call_kinds(result)
  assert "cpu_flash" not in kinds, f"{backend} on {platform} holds the CPU kernel's FFI call"
  for kind in expected:
    assert kind in kinds, f"{backend} on {platform}: no {kind} custom call (found {lc.custom_calls(result)})"
  if not expected:
    assert not {"triton", "mosaic_tpu", "cudnn_fmha"} & set(kinds), kinds


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("encoding", lc.ENCODINGS)
@pytest.mark.parametrize("backend", list(lc.EXPECTED))
def test_every_backend_lowers_for_gpu_and_tpu_or_is_refused(backend, encoding, grad, dtype):
  fn, args = lc.attention_case(backend, encoding, dtype, grad=grad)
  got = lc.lower(fn, args)
  for platform in PLATFORMS:
    _check(got[platform], lc.EXPECTED[backend][platform], platform, backend)


def test_the_cpu_program_keeps_the_cpu_kernel_and_the_others_do_not():
  """One trace of the default (xla) attention: the CPU kernel's FFI calls in the program for the
  CPU, the XLA loops (no FFI call) in those for cuda and tpu; lowered for cpu and cuda together,
  the program holds both branches."""
  fn, args = lc.attention_case("xla", "alibi", jnp.float32, grad=True)
  traced = jax.jit(fn).trace(*args)
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert "cpu_flash" in lc.call_kinds(cpu)
  for platform in PLATFORMS:
    assert "cpu_flash" not in lc.call_kinds(traced.lower(lowering_platforms=(platform,)).as_text())
  both = traced.lower(lowering_platforms=("cpu", "cuda")).as_text()
  assert "cpu_flash" in lc.call_kinds(both) and "stablehlo.case" in both


def test_a_fused_backend_on_the_cpu_is_refused_when_lowered_and_when_run():
  q = jnp.ones((1, 16, 2, 8))
  mask = AttentionMask(causal=True)
  message = r"attention implementation 'flash' is not available on platform 'cpu' \(interpret=False\)"
  with pytest.raises(ValueError, match=message):
    attention(q, q, q, scale=0.5, mask=mask, implementation="flash")
  with pytest.raises(ValueError, match=message):
    jax.jit(lambda q: attention(q, q, q, scale=0.5, mask=mask, implementation="flash"))(q)
  with pytest.raises(ValueError, match=message):  # the gradient program is refused too, not zeros
    jax.jit(jax.grad(lambda q: attention(q, q, q, scale=0.5, mask=mask, implementation="flash").sum()))(q)
  # interpret mode stays the host's choice and runs here
  out = attention(q, q, q, scale=0.5, mask=mask, implementation="flash", interpret=True)
  want = attention(q, q, q, scale=0.5, mask=mask)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)


def test_auto_passes_over_kernels_that_refuse_the_call():
  """``auto`` with a learned position bias (a T5 table, xla only): xla everywhere; with attention sinks
  (cuDNN refuses them): jaxpe's flash (Triton) on cuda, splash (which takes sinks) on tpu; nothing is
  refused (issue 48: sinks stay on a fused kernel)."""
  from jaxpe.attention import PositionBias

  b, t, n, h = 2, 32, 2, 16
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

  def with_bias(q):
    def fn(params, qp, kp):  # [B, N, t, s]: a learned slope times the distance
      d = (qp[:, None, :, None] - kp[:, None, None, :]).astype(jnp.float32)
      return params[0] * d * jnp.ones((1, n, 1, 1), jnp.float32)

    bias = PositionBias(fn, (jnp.ones(()),), pos, pos)
    return attention(
      q, q, q, scale=0.25, mask=AttentionMask(causal=True), implementation="auto", position_bias=bias
    )

  def with_sinks(q):
    return attention(
      q, q, q, scale=0.25, mask=AttentionMask(causal=True), implementation="auto", sinks=jnp.zeros((n,))
    )

  got = lc.lower(with_bias, (q,))
  for platform in PLATFORMS:
    _check(got[platform], (), platform, "auto")
  got = lc.lower(with_sinks, (q,))
  _check(got["cuda"], ("triton",), "cuda", "auto")
  _check(got["tpu"], ("mosaic_tpu",), "tpu", "auto")


def _model_cases():
  from jaxpe.model import encodings as registry

  return [(enc, backend) for enc in sorted(registry.REGISTRY) for backend in lc.model_backends(enc)]


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam mixes Python floats with int32 counts
@pytest.mark.parametrize(("encoding", "backend"), _model_cases())
def test_the_decoder_its_train_step_and_generation_lower_for_gpu_and_tpu(encoding, backend):
  """Forward, the sharded train step (an abstract mesh of 8 devices: data 2, fsdp 2, tensor 2) and
  KV-cache generation; fused kernels where the backend has them (flash: Triton / Mosaic; auto:
  cuDNN / splash on the encodings they take), never the CPU kernel."""
  cfg = lc.tiny_model(encoding, backend)
  for platform in PLATFORMS:
    got = lc.model_lowering(cfg, platform)
    for program, result in got.items():
      assert not isinstance(result, Exception), (
        f"{encoding}/{backend} {program} on {platform}: {lc.describe(result)}"
      )
      kinds = lc.call_kinds(result)
      assert "cpu_flash" not in kinds, (encoding, backend, program, platform)
      if backend == "flash" and program != "generate":  # generation decodes on xla (a KV cache)
        assert ("triton" if platform == "cuda" else "mosaic_tpu") in kinds, (
          encoding,
          program,
          platform,
          kinds,
        )


def test_a_refused_backend_is_refused_under_vmap_and_a_fused_kernel_for_several_platforms():
  q = jnp.ones((3, 1, 16, 2, 8))
  mask = AttentionMask(causal=True)
  flash = jax.vmap(lambda q: attention(q, q, q, scale=0.5, mask=mask, implementation="flash"))
  with pytest.raises(ValueError, match="'flash' is not available on platform 'cpu'"):
    flash(q)
  s = jax.ShapeDtypeStruct(q.shape, q.dtype)
  traced = jax.jit(flash).trace(s)
  assert "triton" in lc.call_kinds(traced.lower(lowering_platforms=("cuda",)).as_text())
  splash = jax.vmap(lambda q: attention(q, q, q, scale=0.5, mask=mask, implementation="splash"))
  with pytest.raises(ValueError, match="'splash' is not available on platform 'cuda'"):
    jax.jit(splash).trace(s).lower(lowering_platforms=("cuda",))
  with pytest.raises(
    ValueError, match="'flash' is a fused kernel, which lowers for one platform per program"
  ):
    traced.lower(lowering_platforms=("cuda", "tpu"))


def test_a_mesh_of_the_hosts_devices_does_not_pin_the_cpu_branch():
  """Traced under ``jax.set_mesh`` of CPU devices, the program lowered for cuda holds no CPU kernel."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  fn, args = lc.attention_case("auto", "none", jnp.float32, grad=False)
  with jax.set_mesh(mesh):
    traced = jax.jit(fn).trace(*args)
  kinds = lc.call_kinds(traced.lower(lowering_platforms=("cuda",)).as_text())
  assert "cpu_flash" not in kinds and "triton" in kinds, kinds  # flash: no cuDNN plugin on this host


@pytest.mark.parametrize("batch", [8, 6])
def test_fused_kernels_on_a_mesh_match_xla_also_for_a_batch_the_mesh_does_not_divide(batch):
  """The decoder on a (data 2, fsdp 2, tensor 2) mesh of fake CPU devices: flash in interpret mode
  (per device's rows through ``batch_local``; unsplit when B does not divide by 4) gives xla's logits."""
  from flax import nnx

  from jaxpe.model import Decoder, partitioning
  from jaxpe.model.config import LogicalRules
  from jaxpe.train import sharding

  mesh = sharding.make_mesh((2, 2, 2, 1), devices=jax.devices()[:8])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, 16)), jnp.int32)
  logits = {}
  for backend in ("xla", "flash"):
    cfg = lc.tiny_model("alibi", backend).model_copy(update={"attention_interpret": True})
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    with partitioning.activation_sharding(mesh, LogicalRules()):
      logits[backend] = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
  np.testing.assert_allclose(logits["flash"], logits["xla"], atol=2e-5, rtol=0)
