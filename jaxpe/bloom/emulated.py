"""An ALiBi model (BLOOM) converted to RoPE-emulated ALiBi: the emulation plan, its predicted bias
error, and the conversion that puts the extra rotated pair into the q/k projections.

Source: the construction of shared/DESIGN.md section 3 (RoPE arXiv 2104.09864, ALiBi arXiv
2108.12409), solved by ``jaxpe.emulation.solve_emulation``.
"""

from __future__ import annotations

import numpy as np

from jaxpe.emulation import EmulationPlan, emulation_error_bound, solve_emulation
from jaxpe.model import Decoder, emulation_theta
from jaxpe.model.build import build_model, model_params, param_shapes
from jaxpe.model.config import ModelConfig
from jaxpe.ops import alibi
from jaxpe.ops import checks as _checks

__all__ = ["bias_error_bound", "emulation_parameters", "to_emulated"]


def emulation_parameters(
  cfg: ModelConfig,
  *,
  context: int | None = None,
  max_phase: float | None = None,
  target_error: float | None = None,
) -> EmulationPlan:
  """The emulation plan for converting an ALiBi model of ``cfg`` (``jaxpe.emulation.solve_emulation``).

  One theta shared by all heads (one RoPE frequency), rounded down to float32, and the solver's
  predicted worst-case deviation from ALiBi over ``context`` (``plan.bound``, logits).

  Args:
    cfg: the ALiBi model's config.
    context: longest sequence the converted model must serve, in tokens (default ``cfg.max_len``).
    max_phase: largest phase ``d theta`` over the context, radians in (0, pi/2); ``theta =
      max_phase / context`` (the published rule). Default ``cfg.rope_alibi_max_phase`` (0.1: relative
      bias error ``0.1^2 / 6 = 1.7e-3`` at the far end) unless ``target_error`` is given.
    target_error: instead of ``max_phase``, the worst deviation from ALiBi wanted, in logits; the
      solver picks the largest theta that meets it.

  Raises:
    ValueError: both ``max_phase`` and ``target_error``; ``context`` not a positive integer;
      ``max_phase`` outside (0, pi/2); a target below the float32 rounding floor.
  """
  context = cfg.max_len if context is None else _checks.check_positive_int("context", context)
  if max_phase is not None and target_error is not None:
    raise ValueError("give at most one of max_phase (radians) or target_error (logits)")
  if max_phase is None and target_error is None:
    max_phase = cfg.rope_alibi_max_phase
  return solve_emulation(
    num_heads=cfg.num_heads,
    head_dim=cfg.head_size,
    max_len=context,
    order=1,
    max_phase=max_phase,
    target_error=target_error,
    dtype="float32",
    shared_theta=True,
  )


def bias_error_bound(cfg: ModelConfig, distance, position=None) -> np.ndarray:
  """Predicted ``|emulated - ALiBi|`` score bias per head, in logits, of a converted model.

  ``jaxpe.emulation.emulation_error_bound`` at the model's theta: truncation ``(m/theta)(x - sin x)
  <= m theta^2 d^3 / 6`` (x = d theta) plus the float32 rounding model, which grows with the absolute
  position.

  Args:
    cfg: a ``rope_alibi`` config (theta = ``rope_alibi_max_phase / rope_alibi_context``, in float32).
    distance: ``[...]`` token distances ``d = i - j >= 0``.
    position: ``[...]`` query positions i (broadcastable with ``distance``); default ``distance``
      (key at position 0).

  Returns:
    ``[N, ...]`` float64 bounds.

  Raises:
    ValueError: negative distances or positions.
  """
  theta = float(np.float32(emulation_theta(cfg)))  # the model rotates with the float32 value
  return emulation_error_bound(
    alibi.alibi_slopes_f64(cfg.num_heads),
    theta=theta,
    distance=distance,
    position=distance if position is None else position,
    order=1,
    dtype="float32",
  )


def to_emulated(
  model: Decoder,
  *,
  context: int | None = None,
  max_phase: float | None = None,
  target_error: float | None = None,
) -> Decoder:
  """Converts an ALiBi model to RoPE-emulated ALiBi with the extra dims in the q/k projections.

  Every q and k head gets two extra output dims with zero kernel columns; their biases carry the
  fixed vectors ``q_fixed = (-N_h, 0)``, ``k_fixed = (0, 1)``, ``N_h = m_h sqrt(H) / theta``; RoPE
  rotates only that pair, at frequency ``theta`` (``ModelConfig.rope_alibi_in_projection``). The
  score term is then ``-(m_h / theta) sin((i - j) theta) ~= -m_h (i - j)``: the ALiBi bias with the
  relative error ``((i - j) theta)^2 / 6``. All other parameters are copied; a model without biases
  gets zero biases elsewhere.

  Args:
    model: a ``Decoder`` with ``pos_encoding='alibi'`` and float32 dtype.
    context, max_phase, target_error: see ``emulation_parameters`` (the solver of
      ``jaxpe.emulation``); default ``max_phase`` 0.1 over ``cfg.max_len``.

  Returns:
    a new ``Decoder`` (``pos_encoding='rope_alibi'``, ``rope_alibi_in_projection=True``).

  Raises:
    ValueError: the model is not an ALiBi model or not float32; bad ``context``, ``max_phase`` or
      ``target_error``.

  Source: the construction of shared/DESIGN.md section 3 (RoPE arXiv 2104.09864, ALiBi arXiv
  2108.12409), with the extra dims realised through the projection as the published BLOOM
  conversion does.
  """
  cfg = model.cfg
  if cfg.pos_encoding != "alibi":
    raise ValueError(f"model pos_encoding must be 'alibi' to convert, got {cfg.pos_encoding!r}")
  if cfg.dtype != "float32":
    raise ValueError(f"model dtype must be 'float32' (the emulation needs float32), got {cfg.dtype!r}")
  plan = emulation_parameters(cfg, context=context, max_phase=max_phase, target_error=target_error)
  theta, context = float(plan.theta[0]), plan.max_len
  new_cfg = cfg.model_copy(
    update=dict(
      pos_encoding="rope_alibi",
      rope_alibi_in_projection=True,
      use_bias=True,
      rope_alibi_max_phase=theta * context,
      rope_alibi_context=context,
    )
  )
  new_cfg = ModelConfig.model_validate(new_cfg.model_dump())  # re-run the validators
  n, h = cfg.num_heads, cfg.head_size
  amp = plan.amplitudes
  old = model_params(model)
  new = {}
  for name, shape in param_shapes(new_cfg).items():
    parts = name.split(".")
    if len(parts) >= 4 and parts[2] == "attn" and parts[3] in ("q", "k"):
      heads = shape[-2]
      if parts[4] == "kernel":
        value = np.zeros(shape, np.float32)
        value[..., :h] = old[name]
      else:
        value = np.zeros(shape, np.float64)
        value[:, :h] = old.get(name, np.zeros((heads, h)))
        value[:, h:] = np.stack([-amp, np.zeros(n)], -1) if parts[3] == "q" else [0.0, 1.0]
    else:
      value = old.get(name, np.zeros(shape, np.float32) if parts[-1] == "bias" else None)
      if value is None:
        raise ValueError(f"cannot convert: parameter {name!r} has no counterpart in the ALiBi model")
    new[name] = np.asarray(value, np.float32)
  return build_model(new_cfg, new)
