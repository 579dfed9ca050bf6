"""Report on RoPE-emulated ALiBi: per-head parameters, predicted and measured deviation from ALiBi.

    python -m jaxpe.emulation.report --num-heads 16 --head-dim 64 --context 2048 65536 \\
        --dtype float32 bfloat16 --plot docs/emulation_deviation.png

For each context and dtype it prints (markdown) a table of per-head slope m, theta, N = m sqrt(H) /
theta, and the predicted (``jaxpe.solve_emulation``) and measured maximum deviation from
exact ALiBi, in logits, for orders k = 1, 2, 3 and the exact augmented form. "Measured" runs the
ops as the model does (``apply_rope_alibi`` / ``apply_augmented_alibi``, then a float32 einsum
like ``jaxpe.attention.dot_product_attention``) with zero content dims of the activation dtype
(so the score is the emulated bias alone and content rounding, common to native ALiBi, does not
enter), for queries spread over the context (``--queries``, always including the last position)
against every key j <= i, and compares with ``-m (i - j)`` in float64. Under the precision policy
the emulation dims are float32 whatever the activation dtype, so the bf16 table equals the float32
one; a second bf16 table carries the emulation dims in bf16 (what the policy avoids).

The plot has two panels: deviation versus distance (query at the last position, head 0, largest
context) with the predicted bounds, and deviation versus absolute query position (distances <= 16,
where truncation is negligible) for float32, bf16 under the policy and bf16 without it.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.emulation.base_constrained import solve_base_constrained
from jaxpe.emulation.bounds import emulation_error_bound
from jaxpe.emulation.checks import MAX_POSITION
from jaxpe.emulation.ops import apply_augmented_alibi, apply_rope_alibi
from jaxpe.emulation.solver import emulation_theta, solve_emulation
from jaxpe.errors import require_extra
from jaxpe.ops import checks as _checks
from jaxpe.ops.alibi import alibi_slopes_f64

FORMS: tuple = (1, 2, 3, None)  # orders; None = exact augmented form


def _form_name(order) -> str:
  return "aug" if order is None else f"k={order}"


def measure(
  slopes: np.ndarray,
  *,
  head_dim: int,
  context: int,
  order: int | None,
  theta: np.ndarray | None,
  act_dtype,
  emul_dtype,
  query_positions: np.ndarray,
  chunk: int = 8,
) -> tuple[np.ndarray, np.ndarray]:
  """Measured ``|score - (-m (i - j))|`` for the given queries against keys ``0..context-1``.

  Content q, k are zeros of ``act_dtype`` (the score is the emulated bias alone).

  Args:
    slopes: ``[N]`` ALiBi slopes.
    head_dim: H.
    context: number of keys (positions ``0..context-1``).
    order: k, or None for the augmented form.
    theta: ``[N]`` (or scalar) base frequency for the rotated form.
    act_dtype: dtype of the random content q, k (the activations).
    emul_dtype: dtype carrying the emulation dims (float32 = policy).
    query_positions: ``[T]`` integer query positions ``< context``.
    chunk: queries per computation (memory: ``N * chunk * context`` floats).

  Returns:
    ``(dev [N, T, S] float64 (0 where j > i), distance [T, S] float64)``.
  """
  num_heads = len(slopes)
  k = jnp.zeros((1, context, 1, head_dim), act_dtype)
  kpos = jnp.arange(context, dtype=jnp.int32)[None]
  scale = 1.0 / math.sqrt(head_dim)

  @jax.jit
  def scores(q, qpos):
    if order is None:
      qa, ka = apply_augmented_alibi(q, k, qpos, kpos, slopes=slopes, out_dtype=emul_dtype)
    else:
      qa, ka = apply_rope_alibi(
        q, k, qpos, kpos, slopes=slopes, theta=theta, order=order, out_dtype=emul_dtype
      )
    return jnp.einsum("BTNH,BSH->BNTS", qa, ka[:, :, 0], preferred_element_type=jnp.float32) * jnp.float32(
      scale
    )

  devs = []
  qpos_all = np.asarray(query_positions, np.int64)
  pad = -len(qpos_all) % chunk
  qpos_padded = np.concatenate([qpos_all, np.repeat(qpos_all[-1:], pad)])
  for c in range(0, len(qpos_padded), chunk):
    qp = qpos_padded[c : c + chunk]
    q = jnp.zeros((1, chunk, num_heads, head_dim), act_dtype)
    got = np.asarray(scores(q, jnp.asarray(qp[None], jnp.int32)), np.float64)[0]  # [N, t, S]
    d = qp[:, None].astype(np.float64) - np.arange(context, dtype=np.float64)[None, :]
    ref = -slopes[:, None, None] * d[None]
    devs.append(np.where(d[None] >= 0, np.abs(got - ref), 0.0))
  dev = np.concatenate(devs, axis=1)[:, : len(qpos_all)]
  distance = qpos_all[:, None].astype(np.float64) - np.arange(context, dtype=np.float64)[None, :]
  return dev, np.maximum(distance, 0.0)


def _fmt(x: float) -> str:
  return f"{x:.3g}" if x != 0 else "0"


def report(
  *,
  num_heads: int,
  head_dim: int,
  contexts: Sequence[int],
  dtypes: Sequence[str],
  max_phase: float = 0.1,
  queries: int = 32,
  plot: str | None = None,
  target_error: float = 0.1,
  rotary_dim: int | None = None,
  base: float = 10000.0,
) -> str:
  """Builds the markdown tables (and the plot); returns the markdown text.

  Besides the per-head tables: deviation versus absolute position at the largest context, and the
  base-constrained mode (``base``, ``rotary_dim`` default H) with the longest context that meets
  ``target_error`` logits and the base a longer one would need.

  Args:
    num_heads: N, a positive int (the paper's slopes).
    head_dim: H, a positive int.
    contexts: one or more contexts in tokens, each an int in 2..2^24.
    dtypes: activation dtypes, each ``"float32"`` or ``"bfloat16"``; at least one.
    max_phase: largest phase in radians, in (0, pi/2).
    queries: query positions sampled per context, a positive int.
    plot: PNG path, or None for no plot.
    target_error: logits, > 0 (base-constrained table).
    rotary_dim: the base-constrained rotary block, an even int >= 2; None = H.
    base: the base-constrained RoPE base, > 1.

  Raises:
    ValueError: a value outside those ranges (named in the message).
    TypeError: a wrong type (a string count, a bool).
  """
  num_heads = _checks.check_positive_int("num_heads", num_heads)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  queries = _checks.check_positive_int("queries", queries)
  if isinstance(contexts, str | bytes) or not isinstance(contexts, Sequence) or not contexts:
    raise ValueError(f"contexts must be a non-empty list of ints in 2..2^24, got {contexts!r}")
  contexts = [_checks.check_positive_int("contexts", c) for c in contexts]
  if min(contexts) < 2 or max(contexts) > MAX_POSITION:
    raise ValueError(f"contexts must be ints in 2..2^24 (tokens), got {contexts}")
  if isinstance(dtypes, str | bytes) or not isinstance(dtypes, Sequence) or not dtypes:
    raise ValueError(f"dtypes must be a non-empty list of 'float32' / 'bfloat16', got {dtypes!r}")
  for dtype in dtypes:
    if dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtypes must each be 'float32' or 'bfloat16', got {dtype!r}")
  emulation_theta(max_phase=max_phase, max_len=max(contexts))  # checks max_phase
  target_error = _checks.check_positive_float("target_error", target_error)
  if rotary_dim is not None:
    rotary_dim = _checks.check_positive_int("rotary_dim", rotary_dim, even=True)
  base = _checks.check_positive_float("base", base)
  if base <= 1.0:
    raise ValueError(f"base must be > 1, got {base}")
  slopes = alibi_slopes_f64(num_heads)
  lines: list[str] = []
  curves: dict = {}
  for context in contexts:
    qpos = np.unique(np.concatenate([np.linspace(0, context - 1, queries).astype(np.int64), [context - 1]]))
    plans = {
      order: solve_emulation(
        slopes, head_dim=head_dim, max_len=context, order=order, max_phase=max_phase, dtype="float32"
      )
      for order in FORMS
      if order is not None
    }
    theta = plans[1].theta
    for dtype in dtypes:
      variants = [("float32", "emulation dims float32 (policy)")]
      if dtype != "float32":
        variants.append((dtype, f"emulation dims carried in {dtype} (no policy)"))
      for emul_dtype, label in variants:
        t0 = time.perf_counter()
        pred, meas = {}, {}
        for order in FORMS:
          if order is None:  # rounding only, ~ 2 i: worst at the last query
            pred[order] = emulation_error_bound(
              slopes, theta=1.0, distance=0, position=context - 1, order=None, dtype=emul_dtype
            )
          else:
            d = np.arange(context, dtype=np.float64)
            # worst case over 0 <= j <= i < context: truncation at d = context-1, rounding at i = context-1
            pred[order] = np.max(
              emulation_error_bound(
                slopes, theta=theta, distance=d, position=context - 1, order=order, dtype=emul_dtype
              ),
              axis=1,
            )
          dev, dist = measure(
            slopes,
            head_dim=head_dim,
            context=context,
            order=order,
            theta=theta,
            act_dtype=dtype,
            emul_dtype=emul_dtype,
            query_positions=qpos,
          )
          meas[order] = dev.max(axis=(1, 2))
          if context == max(contexts):
            curves[(dtype, emul_dtype, order)] = (dev, dist, qpos)
        seconds = time.perf_counter() - t0
        lines.append(
          f"\n### N={num_heads}, H={head_dim}, context {context}, activations {dtype}, {label}\n\n"
          f"max_phase {max_phase}, theta {theta[0]:.6g} rad/token (shared), N = m sqrt(H) / theta; "
          f"deviation from ALiBi in logits, max over {len(qpos)} query positions x all keys "
          f"(measured in {seconds:.0f} s).\n"
        )
        head = "| head | m | theta | N |" + "".join(
          f" {_form_name(o)} pred | {_form_name(o)} meas |" for o in FORMS
        )
        lines.append(head)
        lines.append("|" + "---|" * (4 + 2 * len(FORMS)))
        for h in range(num_heads):
          row = f"| {h} | {slopes[h]:.4g} | {theta[h]:.4g} | {plans[1].amplitudes[h]:.4g} |"
          row += "".join(f" {_fmt(pred[o][h])} | {_fmt(meas[o][h])} |" for o in FORMS)
          lines.append(row)
  lines.append(_position_table(curves, max(contexts)))
  lines.append(
    base_constrained_table(
      slopes,
      head_dim=head_dim,
      contexts=contexts,
      max_phase=max_phase,
      target_error=target_error,
      rotary_dim=rotary_dim or head_dim,
      base=base,
    )
  )
  text = "\n".join(lines)
  if plot:
    _plot(curves, slopes, theta_by_context=max(contexts), max_phase=max_phase, head_dim=head_dim, path=plot)
  return text


def _position_table(curves, context: int) -> str:
  """Markdown: max deviation over heads and distances <= 16 at a few absolute query positions."""
  rows = [
    f"\n### Deviation vs absolute query position (context {context}, max over heads, distances <= 16)\n",
  ]
  keys = [key for key in sorted(curves, key=str) if key[2] in (1, None)]
  rows.append(
    "| query position | " + " | ".join(f"{_form_name(o)}, act {a}, emul {e}" for a, e, o in keys) + " |"
  )
  rows.append("|---|" + "---|" * len(keys))
  qpos = curves[keys[0]][2]
  picks = sorted(
    {int(np.argmin(np.abs(qpos - p))) for p in (context // 16, context // 4, context // 2, context - 1)}
  )
  for idx in picks:
    vals = []
    for key in keys:
      dev, dist, _ = curves[key]
      vals.append(_fmt(float(np.where((dist[idx] <= 16)[None], dev[:, idx], 0.0).max())))
    rows.append(f"| {qpos[idx]} | " + " | ".join(vals) + " |")
  return "\n".join(rows)


def base_constrained_table(
  slopes, *, head_dim: int, contexts, max_phase: float, target_error: float, rotary_dim: int, base: float
) -> str:
  """Markdown: the base-constrained mode per context (``jaxpe.solve_base_constrained``)."""
  rows = [
    f"\n### Base-constrained mode: base {base:g}, rotary_dim {rotary_dim}, target {target_error} logits\n",
    "| context | wanted theta | pair r | theta = base^(-2r/R) | predicted max dev (head 0) | "
    "longest context within target | base needed for this context |",
    "|---|---|---|---|---|---|---|",
  ]
  for context in contexts:
    try:
      plan = solve_base_constrained(
        slopes,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        base=base,
        max_len=context,
        max_phase=max_phase,
        target_error=target_error,
        layout="interleaved",
      )
    except ValueError as err:
      rows.append(f"| {context} | - | - | - | refused: {err} | - | - |")
      continue
    needed = "-" if plan.base_needed is None else f"{plan.base_needed:.4g}"
    rows.append(
      f"| {context} | {plan.wanted_theta:.4g} | {plan.pair_index} | {plan.theta:.4g} | "
      f"{_fmt(float(plan.bound[0]))} | {plan.max_context} | {needed} |"
    )
  return "\n".join(rows)


def _plot(curves, slopes, *, theta_by_context, max_phase, head_dim, path) -> None:
  require_extra("train", "the emulation report's plot", ("matplotlib",))
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  context = theta_by_context
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
  # (a) deviation vs distance, query at the last position, head 0, float32 policy; maxima over
  # log-spaced distance bins (the raw curve oscillates with rounding)
  theta = emulation_theta(max_phase=max_phase, max_len=context)
  edges = np.unique(np.geomspace(1, context, 80).astype(np.int64))
  for order in FORMS:
    key = ("float32", "float32", order)
    if key not in curves:
      continue
    dev, dist, _ = curves[key]
    d, row = dist[-1], dev[0, -1]
    centers = edges[1:] - 1  # largest distance of each bin (the bound increases with d)
    binned = np.asarray([row[(d >= lo) & (d < hi)].max(initial=0.0) for lo, hi in zip(edges[:-1], edges[1:])])
    (line,) = ax1.loglog(centers, binned + 1e-12, lw=1.0, label=f"{_form_name(order)} measured")
    bound = emulation_error_bound(
      slopes[:1], theta=theta, distance=centers, position=context - 1, order=order
    )[0]
    ax1.loglog(centers, bound, "--", lw=0.8, color=line.get_color(), label=f"{_form_name(order)} predicted")
  ax1.set_xlabel("distance i - j (tokens)")
  ax1.set_ylabel("|score - ALiBi| (logits), max per distance bin")
  ax1.set_title(f"head 0 (m={slopes[0]:.3g}), query at {context - 1}, float32 policy")
  if ax1.get_legend_handles_labels()[0]:
    ax1.legend(fontsize=7, ncol=2)
  # (b) deviation vs absolute position, distances <= 16 (truncation negligible), all heads
  styles = {"float32": "-", "bfloat16": ":"}
  for (act, emul, order), (dev, dist, qpos) in sorted(curves.items(), key=str):
    if order not in (1, None):
      continue
    near = np.where((dist <= 16)[None], dev, 0.0).max(axis=(0, 2))
    label = f"{_form_name(order)}, act {act}, emul dims {emul}" + (" (policy)" if emul == "float32" else "")
    marker = "x" if act == "bfloat16" and emul == "float32" else "."
    ax2.semilogy(qpos[1:], near[1:] + 1e-12, marker=marker, ls=styles[act], lw=0.8, label=label)
  positions = np.linspace(1, context - 1, 200)
  for emul in sorted({e for (_, e, _) in curves}):
    pred = emulation_error_bound(
      slopes[:1], theta=theta, distance=0, position=positions, order=1, dtype=emul
    )[0]
    ax2.semilogy(positions, pred, "k--", lw=0.6)
    ax2.annotate(f"k=1 bound, {emul}, head 0", (positions[20], pred[20]), fontsize=7, va="bottom")
  ax2.set_xlabel("query position i (tokens)")
  ax2.set_ylabel("max |score - ALiBi| over d <= 16, all heads (logits)")
  ax2.set_title(f"rounding vs absolute position (H={head_dim})")
  ax2.legend(fontsize=7, loc="center right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
  """Command line: prints the markdown tables, writes the plot."""
  parser = argparse.ArgumentParser(
    prog="python -m jaxpe.emulation.report", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--num-heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--context", type=int, nargs="+", default=[2048, 65536])
  parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
  parser.add_argument("--max-phase", type=float, default=0.1)
  parser.add_argument("--queries", type=int, default=32, help="query positions sampled per context")
  parser.add_argument("--plot", default="emulation_deviation.png", help="output PNG ('' for none)")
  parser.add_argument(
    "--target-error", type=float, default=0.1, help="logits, for the base-constrained table"
  )
  parser.add_argument("--rotary-dim", type=int, default=None, help="base-constrained rotary block; default H")
  parser.add_argument("--base", type=float, default=10000.0, help="base-constrained RoPE base")
  args = parser.parse_args(argv)
  try:
    text = report(
      num_heads=args.num_heads,
      head_dim=args.head_dim,
      contexts=args.context,
      dtypes=args.dtype,
      max_phase=args.max_phase,
      queries=args.queries,
      plot=args.plot or None,
      target_error=args.target_error,
      rotary_dim=args.rotary_dim,
      base=args.base,
    )
  except (ValueError, TypeError) as e:
    parser.error(str(e))  # one line on stderr, exit status 2
  print(text)
  if args.plot:
    print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
  main()
