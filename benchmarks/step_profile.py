"""Where jaxpe's train step spends its time: XLA's trace of the trainer's compiled step, each
executed operation (a thunk: a fusion, a matmul, a copy) attributed to the part of the model whose
code emitted it.

  python benchmarks/step_profile.py [--small] [--steps 3] [--top 0]

For each size of ``train_bench.SIZES`` it runs jaxpe's trainer step (``train_bench.trainer_step``)
under ``jax.profiler`` and sums the duration of every thunk the CPU runtime traced, by part. A
thunk's part comes from the Python stack XLA keeps for the HLO instruction it runs (the compiled
module's ``StackFrames``): attention core (``jaxpe/attention``), RoPE, the attention projections,
the MLP, LayerNorm, embedding, logits + loss, the optimizer update, the step's norms and its
non-finite guard; matmuls (``dot_general``) apart from the rest, forward apart from backward
(``transpose(...)`` in the op name). Thunks may overlap (independent ones run concurrently), so the
parts are shares of the summed thunk time; the step's wall time is printed beside it.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import linecache
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import train_bench

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def _table(text: str, header: str, pattern: str) -> dict[int, re.Match]:
  """Rows ``<id> <pattern>`` of one of the HLO module's tables (FileNames, FunctionNames, ...),
  by id; group 1 is the id, the pattern's groups follow."""
  out = {}
  lines = text.splitlines()
  try:
    start = lines.index(header) + 1
  except ValueError:
    return out
  for line in lines[start:]:
    m = re.match(r"^(\d+) " + pattern, line)
    if not m:
      break
    out[int(m[1])] = m
  return out


def instruction_stacks(hlo_text: str) -> dict[str, tuple[str, list[tuple[str, str, int]]]]:
  """``{instruction name: (op_name, [(file, function, line), ...] innermost first)}`` of a compiled
  HLO module's text (``compiled.as_text()``)."""
  files = {i: m[2] for i, m in _table(hlo_text, "FileNames", r'"(.*)"').items()}
  funcs = {i: m[2] for i, m in _table(hlo_text, "FunctionNames", r'"(.*)"').items()}
  locs = _table(hlo_text, "FileLocations", r"\{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
  frames = _table(hlo_text, "StackFrames", r"\{file_location_id=(\d+) parent_frame_id=(\d+)")

  def stack(frame: int) -> list[tuple[str, str, int]]:
    out, seen = [], set()
    while frame in frames and frame not in seen:
      seen.add(frame)
      loc = locs[int(frames[frame][2])]
      out.append((files[int(loc[2])], funcs[int(loc[3])], int(loc[4])))
      parent = int(frames[frame][3])
      frame = parent if parent != frame else -1
    return out

  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    op = _OP_NAME.search(line)
    fr = _FRAME.search(line)
    out[m[1]] = (op[1] if op else "", stack(int(fr[1])) if fr else [])
  return out


def part_of(op_name: str, stack: list[tuple[str, str, int]]) -> str:
  """The model part of an instruction from its op name and Python stack (innermost first)."""
  functions = {f for _, f, _ in stack}
  paths = [p for p, _, _ in stack]
  matmul = op_name.endswith("dot_general")
  if any("/jaxpe/attention/" in p for p in paths):
    part = "attention core"
  elif functions & {"Rope.encode_qk", "apply_rope"} or any("/jaxpe/ops/" in p for p in paths):
    part = "rope"
  elif "Attention.__call__" in functions:
    part = "attention projections"
  elif "MLP.__call__" in functions:
    part = "mlp"
  elif "LayerNorm.__call__" in functions:
    part = "layernorm"
  elif "Decoder.embed_inputs" in functions:
    part = "embedding"
  elif "Decoder.__call__" in functions or "next_token_loss" in functions:
    part = "logits + loss"
  elif "Block.__call__" in functions or "Decoder._blocks" in functions:
    part = "residual"
  elif stack:
    code = linecache.getline(stack[0][0], stack[0][2])
    if "optimizer.update" in code:
      part = "optimizer update"
    elif "norm" in code:
      part = "step norms"
    elif "where" in code:
      part = "non-finite guard"
    else:
      part = f"other ({stack[0][1]}:{stack[0][2]})"
  else:
    part = "other (no stack)"
  if part in ("attention core", "attention projections", "mlp", "logits + loss"):
    part += ", matmul" if matmul else ", other"
  return part + (" [bwd]" if "transpose(" in op_name else "")


def _thunk_microseconds(trace_dir: Path, names: set[str]) -> collections.Counter:
  total: collections.Counter = collections.Counter()
  for path in trace_dir.rglob("*.trace.json.gz"):
    for event in json.load(gzip.open(path))["traceEvents"]:
      if event.get("ph") == "X" and event.get("name") in names:
        total[event["name"]] += event.get("dur", 0)
  return total


def profile(cfg, *, batch: int, seq: int, steps: int = 3) -> tuple[dict[str, float], float, float]:
  """``({part: ms per step}, summed thunk ms per step, wall ms per step)`` of jaxpe's trainer step."""
  trainer = train_bench.trainer_step(cfg, batch=batch, seq=seq)
  run = trainer.run
  stacks = instruction_stacks(trainer.step.lower(*trainer.args()).compile().as_text())
  run()
  run()
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    t0 = time.perf_counter()
    for _ in range(steps):
      run()
    wall = (time.perf_counter() - t0) / steps
    jax.profiler.stop_trace()
    micros = _thunk_microseconds(Path(tmp), set(stacks))
  parts: collections.Counter = collections.Counter()
  for name, us in micros.items():
    parts[part_of(*stacks[name])] += us / steps / 1e3
  return dict(parts.most_common()), sum(parts.values()), wall * 1e3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--small", action="store_true", help="the --quick batch sizes")
  parser.add_argument("--steps", type=int, default=3, help="traced steps per size")
  args = parser.parse_args()
  for label, cfg, full, quick in train_bench.SIZES:
    batch, seq = quick if args.small else full
    parts, thunks, wall = profile(cfg, batch=batch, seq=seq, steps=args.steps)
    print(f"\n{label}, B {batch} x T {seq}: step {wall:.0f} ms wall, thunks {thunks:.0f} ms summed")
    groups: collections.Counter = collections.Counter()
    for part, ms in parts.items():
      groups[part.split(",")[0].replace(" [bwd]", "")] += ms
    for part, ms in groups.most_common():
      print(f"  {part:<28} {ms:9.1f} ms  {ms / thunks:6.1%}")
    print("  detail:")
    for part, ms in parts.items():
      print(f"    {part:<40} {ms:9.1f} ms  {ms / thunks:6.1%}")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
