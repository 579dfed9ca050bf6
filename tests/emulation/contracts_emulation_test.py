"""The emulation surface's contract (docs/contracts.md, attention section), walked with hostile values.

A table of (entry point, argument, bad value, exception, message regex) over the emulation
(solver, bounds, ops, base-constrained mode), the bf16-exact dims and the report; traced slopes;
the report's command line. ``emulated_alibi_attention`` is walked in
tests/attention/contracts_attention_test.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe import emulation
from jaxpe.emulation import bf16_exact
from jaxpe.emulation import report as emulation_report
from jaxpe.ops.layouts import REQUIRED

H = 8
nan, inf = float("nan"), float("inf")
SLOPES = np.array([0.5, 0.25])


def _rand(*shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(9).normal(size=shape), dtype)


PLAN = emulation.solve_base_constrained(
  SLOPES, head_dim=H, rotary_dim=8, max_len=8, max_phase=0.1, layout="interleaved"
)
EMUL_Q, EMUL_K = _rand(1, 8, 2, 4), _rand(1, 8, 1, 4)
EPOS = jnp.arange(8, dtype=jnp.int32)[None]


def _kw(fn, base, *args):
  return lambda **kw: fn(*args, **(base | kw))


_ROPE = _kw(emulation.apply_rope_alibi, dict(slopes=SLOPES, theta=0.01))
_AUG = _kw(emulation.apply_augmented_alibi, dict(slopes=SLOPES))


def _rope(**kw):
  args = dict(q=EMUL_Q, k=EMUL_K, q_positions=EPOS, k_positions=EPOS) | kw
  return _ROPE(**args)


def _aug(**kw):
  args = dict(q=EMUL_Q, k=EMUL_K, q_positions=EPOS, k_positions=EPOS) | kw
  return _AUG(**args)


EMULATION_ENTRY = {
  "emulation_weights": emulation.emulation_weights,
  "emulation_theta": _kw(emulation.emulation_theta, dict(max_phase=0.1, max_len=8)),
  "emulation_amplitudes": _kw(emulation.emulation_amplitudes, dict(slopes=[0.5], head_dim=4, theta=0.01)),
  "emulation_error_bound": _kw(
    emulation.emulation_error_bound, dict(slopes=[0.5], theta=0.01, distance=3, position=5)
  ),
  "solve_emulation": _kw(
    emulation.solve_emulation, dict(slopes=[0.5, 0.25], head_dim=4, max_len=8, max_phase=0.1)
  ),
  "solve_base_constrained": _kw(
    emulation.solve_base_constrained,
    dict(slopes=[0.5, 0.25], head_dim=4, rotary_dim=8, max_len=8, max_phase=0.1, layout="interleaved"),
  ),
  "pad_head_dim": lambda **kw: emulation.pad_head_dim(**(dict(x=EMUL_Q) | kw)),
  "apply_rope_alibi": _rope,
  "apply_augmented_alibi": _aug,
  "base_constrained_qk": lambda **kw: emulation.base_constrained_qk(
    **(dict(q=_rand(1, 8, 2, H), k=_rand(1, 8, 1, H), plan=PLAN) | kw)
  ),
  "split_bf16": lambda **kw: bf16_exact.split_bf16(**(dict(x=EMUL_Q) | kw)),
  "split_product_dims": lambda **kw: bf16_exact.split_product_dims(
    **(dict(q_extra=EMUL_Q, k_extra=EMUL_K) | kw)
  ),
  "position_digits": bf16_exact.position_digits,
  "exact_alibi_dims": _kw(
    bf16_exact.exact_alibi_dims,
    dict(q_positions=EPOS, k_positions=EPOS, slopes=SLOPES, dot_scale=0.5, max_position=8, num_kv_heads=1),
  ),
  "round_mantissa": _kw(bf16_exact.round_mantissa, dict(x=[1.0], fmt="tf32")),
  "alibi_term_dims": _kw(
    bf16_exact.alibi_term_dims,
    dict(form="exact", q_positions=[0, 1], k_positions=[0, 1], slopes=[0.5], head_dim=4, max_len=8),
  ),
  "report": _kw(
    emulation_report.report, dict(num_heads=2, head_dim=4, contexts=[16], dtypes=["float32"], plot=None)
  ),
}

EMULATION_ROWS = [
  ("emulation_weights", "order", dict(order=0), ValueError, r"order must be a positive integer"),
  ("emulation_weights", "order", dict(order=9), ValueError, r"order must be in 1..8"),
  ("emulation_weights", "order", dict(order=2.0), ValueError, r"order must be a positive integer"),
  ("emulation_weights", "order", dict(order=True), ValueError, r"order must be a positive integer"),
  ("emulation_weights", "order", dict(order=None), ValueError, r"order must be a positive integer"),
  ("emulation_theta", "max_phase", dict(max_phase=nan), ValueError, r"max_phase must be in \(0, pi/2\)"),
  ("emulation_theta", "max_phase", dict(max_phase=0.0), ValueError, r"max_phase must be in \(0, pi/2\)"),
  ("emulation_theta", "max_phase", dict(max_phase=-0.1), ValueError, r"max_phase must be in \(0, pi/2\)"),
  (
    "emulation_theta",
    "max_phase",
    dict(max_phase=math.pi / 2),
    ValueError,
    r"max_phase must be in \(0, pi/2\)",
  ),
  ("emulation_theta", "max_phase", dict(max_phase=inf), ValueError, r"max_phase must be in \(0, pi/2\)"),
  ("emulation_theta", "max_phase", dict(max_phase="0.1"), TypeError, r"max_phase must be a real number"),
  ("emulation_theta", "max_phase", dict(max_phase=True), TypeError, r"max_phase must be a real number"),
  ("emulation_theta", "max_len", dict(max_len=0), ValueError, r"max_len must be a positive integer"),
  ("emulation_theta", "max_len", dict(max_len=8.0), ValueError, r"max_len must be a positive integer"),
  ("emulation_theta", "max_len", dict(max_len=2**40), ValueError, r"max_len must be <= 2\^24"),
  ("emulation_amplitudes", "slopes", dict(slopes=[nan]), ValueError, r"slopes must be finite and > 0"),
  ("emulation_amplitudes", "slopes", dict(slopes=[-1.0]), ValueError, r"slopes must be finite and > 0"),
  ("emulation_amplitudes", "slopes", dict(slopes=[0.0]), ValueError, r"slopes must be finite and > 0"),
  (
    "emulation_amplitudes",
    "slopes",
    dict(slopes=[]),
    ValueError,
    r"slopes must have shape \[N\] with N >= 1",
  ),
  ("emulation_amplitudes", "slopes", dict(slopes=[[0.5]]), ValueError, r"slopes must have shape \[N\]"),
  ("emulation_amplitudes", "slopes", dict(slopes=["a"]), TypeError, r"slopes must be a \[N\] float array"),
  ("emulation_amplitudes", "slopes", dict(slopes=[True]), TypeError, r"slopes must be a \[N\] float array"),
  ("emulation_amplitudes", "head_dim", dict(head_dim=0), ValueError, r"head_dim must be a positive integer"),
  ("emulation_amplitudes", "theta", dict(theta=nan), ValueError, r"theta must be a finite number > 0"),
  ("emulation_amplitudes", "theta", dict(theta=0), ValueError, r"theta must be a finite number > 0"),
  ("emulation_amplitudes", "theta", dict(theta=inf), ValueError, r"theta must be a finite number > 0"),
  ("emulation_amplitudes", "theta", dict(theta="0.01"), TypeError, r"theta must be a real number"),
  (
    "emulation_amplitudes",
    "theta",
    dict(theta=[0.1, 0.2]),
    ValueError,
    r"theta must be a number > 0 or \[N\]",
  ),
  ("emulation_error_bound", "slopes", dict(slopes=[nan]), ValueError, r"slopes must be finite and > 0"),
  ("emulation_error_bound", "theta", dict(theta=nan), ValueError, r"theta must be finite and > 0"),
  (
    "emulation_error_bound",
    "theta",
    dict(theta=[0.1, 0.1]),
    ValueError,
    r"theta must be a number or \[N\] = \[1\]",
  ),
  ("emulation_error_bound", "distance", dict(distance=-1), ValueError, r"distance must be finite and >= 0"),
  ("emulation_error_bound", "distance", dict(distance=nan), ValueError, r"distance must be finite and >= 0"),
  ("emulation_error_bound", "position", dict(position=inf), ValueError, r"position must be finite and >= 0"),
  ("emulation_error_bound", "position", dict(position="5"), TypeError, r"position must be a number"),
  (
    "emulation_error_bound",
    "position",
    dict(distance=[1, 2], position=[1, 2, 3]),
    ValueError,
    r"distance and position must broadcast together",
  ),
  ("emulation_error_bound", "order", dict(order=0), ValueError, r"order must be a positive integer"),
  ("emulation_error_bound", "dtype", dict(dtype="float64"), ValueError, r"dtype must be one of"),
  ("solve_emulation", "max_len", dict(max_len=0), ValueError, r"max_len must be a positive integer"),
  ("solve_emulation", "max_len", dict(max_len=2**25), ValueError, r"max_len must be <= 2\^24"),
  ("solve_emulation", "head_dim", dict(head_dim=-4), ValueError, r"head_dim must be a positive integer"),
  ("solve_emulation", "order", dict(order=9), ValueError, r"order must be in 1..8"),
  ("solve_emulation", "max_phase", dict(max_phase=nan), ValueError, r"max_phase must be in \(0, pi/2\)"),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error=nan),
    ValueError,
    r"target_error must be a finite number > 0",
  ),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error=0.0),
    ValueError,
    r"target_error must be",
  ),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error=1e-30),
    ValueError,
    r"rounding floor",
  ),
  (
    "solve_emulation",
    "target_error",
    dict(max_phase=None, target_error="0.1"),
    TypeError,
    r"target_error must be a real number",
  ),
  ("solve_emulation", "max_phase", dict(target_error=0.1), ValueError, r"exactly one of max_phase"),
  ("solve_emulation", "slopes", dict(slopes=None), ValueError, r"exactly one of slopes"),
  (
    "solve_emulation",
    "num_heads",
    dict(slopes=None, num_heads=0),
    ValueError,
    r"num_heads must be a positive integer",
  ),
  (
    "solve_emulation",
    "dtype",
    dict(dtype="float16", max_len=2**20),
    ValueError,
    r"not representable in float16",
  ),
  ("solve_emulation", "dtype", dict(dtype="int8"), ValueError, r"dtype must be one of"),
  ("solve_emulation", "shared_theta", dict(shared_theta="no"), TypeError, r"shared_theta must be a bool"),
  ("solve_base_constrained", "base", dict(base=1.0), ValueError, r"base must be > 1"),
  ("solve_base_constrained", "base", dict(base=nan), ValueError, r"base must be a finite number > 0"),
  ("solve_base_constrained", "rotary_dim", dict(rotary_dim=3), ValueError, r"rotary_dim must be even"),
  ("solve_base_constrained", "rotary_dim", dict(rotary_dim=0), ValueError, r"rotary_dim must be a positive"),
  (
    "solve_base_constrained",
    "layout",
    dict(layout="neox"),
    ValueError,
    r"layout must be 'interleaved' or 'half'",
  ),
  ("solve_base_constrained", "max_len", dict(max_len=10**6), ValueError, r"raise the base"),
  (
    "solve_base_constrained",
    "layout",
    dict(layout=REQUIRED),
    TypeError,
    r"missing required keyword argument 'layout'",
  ),
  ("solve_base_constrained", "max_phase", dict(max_phase=None), ValueError, r"give max_phase"),
  ("solve_base_constrained", "target_error", dict(target_error=-1), ValueError, r"target_error must be"),
  ("pad_head_dim", "multiple", dict(multiple=0), ValueError, r"multiple must be a positive integer"),
  ("pad_head_dim", "multiple", dict(multiple=8.0), ValueError, r"multiple must be a positive integer"),
  ("pad_head_dim", "multiple", dict(multiple=10**9), ValueError, r"multiple must be in 1..4096"),
  ("pad_head_dim", "x", dict(x=[1.0, 2.0]), TypeError, r"x must be an array of rank >= 1"),
  ("pad_head_dim", "x", dict(x=jnp.zeros(())), TypeError, r"x must be an array of rank >= 1"),
  ("apply_rope_alibi", "slopes", dict(slopes=[0.5]), ValueError, r"one entry per head \(N = 2\)"),
  ("apply_rope_alibi", "slopes", dict(slopes=[nan, 1.0]), ValueError, r"slopes must be finite and > 0"),
  ("apply_rope_alibi", "slopes", dict(slopes=[0.0, 1.0]), ValueError, r"slopes must be finite and > 0"),
  ("apply_rope_alibi", "theta", dict(theta=nan), ValueError, r"theta must be a finite number > 0"),
  ("apply_rope_alibi", "theta", dict(theta=0.0), ValueError, r"theta must be a finite number > 0"),
  ("apply_rope_alibi", "theta", dict(theta=1.0), ValueError, r"theta too large for these positions"),
  ("apply_rope_alibi", "theta", dict(theta="0.01"), TypeError, r"theta must be a real number"),
  ("apply_rope_alibi", "theta", dict(theta=[0.01]), ValueError, r"theta must be a number > 0 or \[N\]"),
  ("apply_rope_alibi", "order", dict(order=0), ValueError, r"order must be a positive integer"),
  ("apply_rope_alibi", "out_dtype", dict(out_dtype="float64"), ValueError, r"dtype must be one of"),
  (
    "apply_rope_alibi",
    "out_dtype",
    dict(out_dtype=jnp.float16, theta=1e-5),
    ValueError,
    r"not representable in float16",
  ),
  (
    "apply_rope_alibi",
    "pad_multiple",
    dict(pad_multiple=0),
    ValueError,
    r"pad_multiple must be an int in 1\.\.4096, got 0",
  ),
  (
    "apply_rope_alibi",
    "q_positions",
    dict(q_positions=EPOS.astype(jnp.float32)),
    TypeError,
    r"q_positions must be an integer array",
  ),
  ("apply_rope_alibi", "q_positions", dict(q_positions=EPOS[:, :4]), ValueError, r"q_positions shape"),
  ("apply_rope_alibi", "k_positions", dict(k_positions=EPOS - 1), ValueError, r"k_positions must be >= 0"),
  (
    "apply_rope_alibi",
    "k_positions",
    dict(q_positions=EPOS + 2**24, k_positions=EPOS + 2**24),
    ValueError,
    r"< 2\^24",
  ),
  ("apply_rope_alibi", "k", dict(k=_rand(1, 8, 0, 4)), ValueError, r"at least one head"),
  ("apply_rope_alibi", "k", dict(k=_rand(1, 8, 3, 4)), ValueError, r"multiple of kv heads"),
  ("apply_rope_alibi", "q", dict(q=EMUL_Q.astype(jnp.int32)), TypeError, r"q must be a float array"),
  ("apply_augmented_alibi", "slopes", dict(slopes=[-1.0, 1.0]), ValueError, r"slopes must be finite and > 0"),
  ("apply_augmented_alibi", "slopes", dict(slopes="ab"), TypeError, r"slopes must be a \[N\] float array"),
  ("apply_augmented_alibi", "k", dict(k=_rand(1, 8, 0, 4)), ValueError, r"at least one head"),
  (
    "apply_augmented_alibi",
    "q_positions",
    dict(q_positions=EPOS[0]),
    ValueError,
    r"q_positions must have shape",
  ),
  ("apply_augmented_alibi", "out_dtype", dict(out_dtype=jnp.int32), ValueError, r"dtype must be one of"),
  ("base_constrained_qk", "plan", dict(plan="plan"), TypeError, r"plan must be a BaseConstrainedPlan"),
  ("base_constrained_qk", "q", dict(q=_rand(1, 8, 3, H)), ValueError, r"q must have N = 2 heads"),
  (
    "base_constrained_qk",
    "q",
    dict(q=_rand(1, 8, 2, H).astype(jnp.int32)),
    TypeError,
    r"q must be a float array",
  ),
  ("base_constrained_qk", "k", dict(k=_rand(1, 8, 1, H + 1)), ValueError, r"must have H = plan.head_dim"),
  ("base_constrained_qk", "k", dict(k=_rand(2, 8, 1, H)), ValueError, r"same batch size"),
  ("split_bf16", "parts", dict(parts=0), ValueError, r"parts must be a positive integer"),
  ("split_bf16", "x", dict(x=EMUL_Q.astype(jnp.int32)), TypeError, r"x must be a float array"),
  ("split_product_dims", "k_extra", dict(k_extra=_rand(1, 8, 1, 3)), ValueError, r"same last dim E"),
  (
    "position_digits",
    "max_position",
    dict(max_position=0),
    ValueError,
    r"max_position must be a positive integer",
  ),
  ("position_digits", "max_position", dict(max_position=2**25), ValueError, r"max_position must be <= 2\^24"),
  (
    "exact_alibi_dims",
    "dot_scale",
    dict(dot_scale=nan),
    ValueError,
    r"dot_scale must be a finite number > 0",
  ),
  (
    "exact_alibi_dims",
    "dot_scale",
    dict(dot_scale=0.0),
    ValueError,
    r"dot_scale must be a finite number > 0",
  ),
  ("exact_alibi_dims", "num_kv_heads", dict(num_kv_heads=0), ValueError, r"num_kv_heads must be a positive"),
  ("exact_alibi_dims", "slopes", dict(slopes=[-1.0]), ValueError, r"slopes must be finite and >= 0"),
  (
    "exact_alibi_dims",
    "max_position",
    dict(max_position=4),
    ValueError,
    r"q_positions must be in \[0, max_position",
  ),
  ("exact_alibi_dims", "q_positions", dict(q_positions=EPOS[0]), ValueError, r"q_positions must have shape"),
  ("round_mantissa", "fmt", dict(fmt="fp8"), ValueError, r"fmt must be one of"),
  ("alibi_term_dims", "form", dict(form="linear"), ValueError, r"form must be 'lean', 'exact' or 'rotated'"),
  ("alibi_term_dims", "representation", dict(representation="fp8"), ValueError, r"representation must be"),
  ("alibi_term_dims", "head_dim", dict(head_dim=0), ValueError, r"head_dim must be a positive integer"),
  ("alibi_term_dims", "q_positions", dict(q_positions=[-1]), ValueError, r"q_positions must be >= 0"),
  ("alibi_term_dims", "q_positions", dict(q_positions=[2**31]), ValueError, r"q_positions must be < 2\^31"),
  (
    "alibi_term_dims",
    "k_positions",
    dict(k_positions=[0.5]),
    TypeError,
    r"k_positions must be an integer array",
  ),
  ("report", "num_heads", dict(num_heads=0), ValueError, r"num_heads must be a positive integer"),
  ("report", "head_dim", dict(head_dim=-1), ValueError, r"head_dim must be a positive integer"),
  ("report", "contexts", dict(contexts=[]), ValueError, r"contexts must be a non-empty list"),
  ("report", "contexts", dict(contexts=[1]), ValueError, r"contexts must be ints in 2..2\^24"),
  ("report", "contexts", dict(contexts="2048"), ValueError, r"contexts must be a non-empty list"),
  ("report", "dtypes", dict(dtypes=["float16"]), ValueError, r"dtypes must each be 'float32' or 'bfloat16'"),
  ("report", "queries", dict(queries=0), ValueError, r"queries must be a positive integer"),
  ("report", "max_phase", dict(max_phase=nan), ValueError, r"max_phase must be in"),
  ("report", "target_error", dict(target_error=-1.0), ValueError, r"target_error must be"),
  ("report", "rotary_dim", dict(rotary_dim=3), ValueError, r"rotary_dim must be even"),
  ("report", "base", dict(base=0.5), ValueError, r"base must be > 1"),
]


@pytest.mark.parametrize(
  "entry,arg,kwargs,exc,match",
  EMULATION_ROWS,
  ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(EMULATION_ROWS)],
)
def test_emulation_entry_points_refuse_bad_arguments(entry, arg, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    EMULATION_ENTRY[entry](**kwargs)


def test_traced_slopes_are_refused_with_a_message():
  with pytest.raises(ValueError, match="slopes must be concrete"):
    jax.jit(lambda s: _rope(slopes=s))(jnp.asarray(SLOPES))


def test_emulation_report_command_line_gives_one_line_and_status_2(capsys):
  with pytest.raises(SystemExit) as info:
    emulation_report.main(["--num-heads", "0", "--plot", ""])
  assert info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].endswith("num_heads must be a positive integer, got 0")
  assert not any("Traceback" in line for line in err)
