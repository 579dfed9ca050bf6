"""RoPE-emulated ALiBi, pure JAX and Flax-free: ALiBi's bias carried by RoPE machinery.

Modules, in import order (each imports only the ones before it and ``jaxpe.ops``):

- ``checks``: the dtype tables and position limits, and the argument checks every module shares.
- ``bounds``: the construction's weights and its error model (truncation bound, rounding model).
- ``solver``: theta and the amplitudes for a context (``solve_emulation`` -> ``EmulationPlan``).
- ``ops``: the emulation dims on q and k (``apply_rope_alibi``, ``apply_augmented_alibi``,
  ``pad_head_dim``).
- ``base_constrained``: the emulation on a standard RoPE engine's frequency table.
- ``lean``: ALiBi as ``m (j - j0)`` (a per-row constant apart) in the fewest bf16-exact dims, keys
  shared by every kv head (the fused kernels' default form).
- ``bf16_exact``: the emulation dims split into products that are exact in a float32 accumulator
  (what the fused kernels of ``jaxpe.attention`` read).
- ``report``: predicted and measured deviation from ALiBi (``python -m jaxpe.emulation.report``).

Attention with the emulation (``emulated_alibi_attention``) lives in ``jaxpe.attention``, which
imports this package (never the reverse).

Sources: the construction in ``shared/DESIGN.md`` section 3 (RoPE: Su et al., arXiv 2104.09864;
ALiBi: Press et al., arXiv 2108.12409); the higher-order, base-constrained, augmented and padded
forms are jaxpe's extensions (``docs/emulation.md``).

Shape alphabet: B batch, T query positions, S key positions, N heads, K kv heads, H head dim.
"""

from jaxpe.emulation.base_constrained import BaseConstrainedPlan, base_constrained_qk, solve_base_constrained
from jaxpe.emulation.bounds import (
  ROUNDING_CONSTANT,
  emulation_error_bound,
  emulation_weights,
  leading_error_coefficient,
  rounding_sum,
  truncation_error_bound,
)
from jaxpe.emulation.checks import DTYPE_MAX, MAX_PAD_MULTIPLE, MAX_POSITION, UNIT_ROUNDOFF
from jaxpe.emulation.ops import apply_augmented_alibi, apply_rope_alibi, pad_head_dim
from jaxpe.emulation.solver import EmulationPlan, emulation_amplitudes, emulation_theta, solve_emulation

__all__ = [
  "BaseConstrainedPlan",
  "DTYPE_MAX",
  "EmulationPlan",
  "MAX_PAD_MULTIPLE",
  "MAX_POSITION",
  "ROUNDING_CONSTANT",
  "UNIT_ROUNDOFF",
  "apply_augmented_alibi",
  "apply_rope_alibi",
  "base_constrained_qk",
  "emulation_amplitudes",
  "emulation_error_bound",
  "emulation_theta",
  "emulation_weights",
  "leading_error_coefficient",
  "pad_head_dim",
  "rounding_sum",
  "solve_base_constrained",
  "solve_emulation",
  "truncation_error_bound",
]
