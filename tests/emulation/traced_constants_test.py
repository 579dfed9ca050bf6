"""Values that must be concrete (ALiBi slopes, the emulation's theta, score scales) name the fix
when they arrive traced, the usual cause being a constant kept on an NNX module (``nnx.jit``
traces array attributes, numpy ones too): every such error says to keep a tuple or numpy constant.
The README's pattern (a tuple on the module) runs under ``nnx.jit``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.attention import blockwise_attention
from jaxpe.emulation import bf16_exact, lean, solver

HINT = r"not traced under jit\. Keep it a host constant.*tuple\(np\.asarray\(\.\.\.\)\.tolist\(\)\)"
Q = jnp.ones((1, 4, 2, 8))
POS = jnp.arange(4)[None]
SLOPES = np.asarray([0.25, 0.0625])
THETA = 1e-4
LEAN = dict(dot_scale=1.0, max_position=64, num_kv_heads=2)

CASES = {
  "apply_rope_alibi slopes": lambda s: jaxpe.apply_rope_alibi(Q, Q, POS, POS, slopes=s, theta=THETA),
  "apply_rope_alibi theta": lambda s: jaxpe.apply_rope_alibi(Q, Q, POS, POS, slopes=SLOPES, theta=s[0]),
  "apply_augmented_alibi": lambda s: jaxpe.apply_augmented_alibi(Q, Q, POS, POS, slopes=s),
  "emulated_alibi_attention": lambda s: jaxpe.emulated_alibi_attention(
    Q, Q, Q, POS, POS, slopes=s, theta=THETA
  ),
  "emulation_amplitudes slopes": lambda s: jaxpe.emulation_amplitudes(s, head_dim=8, theta=THETA),
  "emulation_amplitudes theta": lambda s: jaxpe.emulation_amplitudes(SLOPES, head_dim=8, theta=s[0]),
  "emulation_error_bound theta": lambda s: jaxpe.emulation_error_bound(
    SLOPES, theta=s[0], distance=3, position=3
  ),
  "solve_emulation slopes": lambda s: solver.solve_emulation(s, head_dim=8, max_len=64, max_phase=0.1),
  "lean_alibi_dims": lambda s: lean.lean_alibi_dims(POS, POS, **LEAN, slopes=s),
  "exact_alibi_dims": lambda s: bf16_exact.exact_alibi_dims(POS, POS, **LEAN, slopes=s),
  "blockwise_attention scale": lambda s: blockwise_attention(Q, Q, Q, scale=s[0]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_constants_name_the_fix(name):
  with pytest.raises((ValueError, TypeError), match=HINT):
    jax.jit(CASES[name])(jnp.asarray(SLOPES, jnp.float32))


def test_slopes_on_an_nnx_module():
  from flax import nnx

  class Alibi(nnx.Module):
    def __init__(self, slopes):
      self.slopes = slopes

    def __call__(self, q):
      theta = jaxpe.emulation_theta(max_phase=0.1, max_len=64)
      return jaxpe.apply_rope_alibi(q, q, POS, POS, slopes=self.slopes, theta=theta)[0]

  call = nnx.jit(lambda m, q: m(q))
  with pytest.raises(ValueError, match=HINT):
    call(Alibi(jaxpe.alibi_slopes(2)), Q)  # a jax array attribute: traced
  kept = Alibi(tuple(np.asarray(jaxpe.alibi_slopes(2), np.float64).tolist()))  # the README's pattern
  eager = Alibi(np.asarray(jaxpe.alibi_slopes(2), np.float64))(Q)
  np.testing.assert_array_equal(call(kept, Q), eager)
