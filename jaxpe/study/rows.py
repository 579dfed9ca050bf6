"""The study's rows (``ENCODINGS``): each one's training keys, the weights it evaluates, its eval-time
scaling, and the rows whose keys follow the training length and depth (issue 47's attention
patterns). ``jaxpe.study.config`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENCODINGS", "Encoding"]


@dataclass(frozen=True)
class Encoding:
  """One row of the study.

  ``model``: ModelConfig keys set for training (besides the shared architecture); ``base``: the
  encoding whose trained weights this row evaluates (itself when None); ``scaling``: the RoPE
  scaling applied only at evaluation (``linear``, ``dynamic`` or ``yarn``), at lengths above 1x;
  ``finetuned``: the base weights are first fine-tuned with ``scaling`` at the longest eval length
  (position interpolation's recipe, arXiv 2306.15595: factor M = max(eval_multiples), length M T;
  ``finetune_steps`` steps on the model's own data: text, or its retrieval task) and evaluated with
  that fixed factor at every length. ``derived``: ``(T, L) -> keys``, ModelConfig keys that follow
  the training length T and ``num_layers`` L (a window or chunk as a share of T, a layer pattern
  that fits L), set over ``model``. ``streaming``: the row is evaluated with StreamingLLM's cache
  (Xiao et al., arXiv 2309.17453) of ``streaming`` sink tokens and the last ``T - streaming``
  tokens, token by token at positions inside the cache (``streaming_sizes``,
  ``jaxpe.study.evaluation.token_scores``).
  """

  label: str
  model: dict[str, Any] = field(default_factory=dict)
  base: str | None = None
  scaling: str | None = None
  finetuned: bool = False
  derived: Callable[[int, int], dict[str, Any]] | None = None
  streaming: int | None = None


def _two_layers(row: str, layers: int) -> None:
  if layers < 2:
    raise ValueError(
      f"row {row} needs train.model.num_layers >= 2 (a windowed and a global layer), got {layers}: at 1 "
      "layer it would be one global layer, not the pattern"
    )


def _local_global(t: int, layers: int) -> dict[str, Any]:
  """Gemma 3 (``Gemma3TextConfig``): every ``sliding_window_pattern``-th layer global, the others
  sliding; 6 (5 local : 1 global) where L allows, else L (the last layer global: 1 : 1 at L = 2);
  window T / 4 (shorter than training, as Gemma 3's 1024 of 32k).

  Raises:
    ValueError: ``layers`` < 2 (no room for a local and a global layer).
  """
  _two_layers("local_global", layers)
  return {"sliding_window": max(1, t // 4), "sliding_window_pattern": min(6, layers)}


def _chunked(t: int, layers: int) -> dict[str, Any]:
  """Llama 4 (``Llama4TextConfig``): every ``no_rope_layer_interval``-th layer NoPE and global, the
  RoPE layers chunked (transformers: ``use_chunked_attention = use_rope``); interval 4 where L
  allows, else L (1 : 1 at L = 2); chunk T / 4; the NoPE layers' attention temperature with
  ``floor_scale`` = the chunk (Llama 4: 8192 and 8192).

  Raises:
    ValueError: ``layers`` < 2 (no room for a chunked and a global layer).
  """
  _two_layers("chunked", layers)
  n, chunk = min(4, layers), max(1, t // 4)
  return {
    "attention_chunk_size": chunk,
    "floor_scale": float(chunk),
    "no_rope_layer_interval": n,
    "layer_types": tuple(
      "full_attention" if (i + 1) % n == 0 else "chunked_attention" for i in range(layers)
    ),
  }


ENCODINGS: dict[str, Encoding] = {
  "none": Encoding("none (NoPE)", {"pos_encoding": "none"}),
  "learned": Encoding("learned", {"pos_encoding": "learned"}),
  "sinusoidal": Encoding("sinusoidal", {"pos_encoding": "sinusoidal"}),
  "rope": Encoding("rope", {"pos_encoding": "rope"}),
  "rope_linear": Encoding("rope + linear interpolation (eval)", base="rope", scaling="linear"),
  "rope_dynamic": Encoding("rope + dynamic NTK (eval)", base="rope", scaling="dynamic"),
  "rope_yarn": Encoding("rope + YaRN (eval)", base="rope", scaling="yarn"),
  "rope_pi_ft": Encoding(
    "rope + position interpolation (fine-tuned)", base="rope", scaling="linear", finetuned=True
  ),
  "xpos": Encoding("xpos", {"pos_encoding": "xpos"}),
  "alibi": Encoding("alibi", {"pos_encoding": "alibi"}),
  "rope_alibi_k1": Encoding("rope_alibi k=1", {"pos_encoding": "rope_alibi", "rope_alibi_order": 1}),
  "rope_alibi_k2": Encoding("rope_alibi k=2", {"pos_encoding": "rope_alibi", "rope_alibi_order": 2}),
  # the encodings of issue 20
  "rope_nope2": Encoding("rope, every 2nd layer NoPE", {"pos_encoding": "rope", "no_rope_layer_interval": 2}),
  "p_rope": Encoding("p-RoPE (p = 0.75)", {"pos_encoding": "rope", "rope_proportion": 0.75}),
  "rope_sinks": Encoding("rope + attention sinks", {"pos_encoding": "rope", "attention_sinks": True}),
  "rope_alibi_hybrid": Encoding(
    "rope + emulated alibi (hybrid, k=2)",
    {"pos_encoding": "rope_alibi", "rope_alibi_order": 2, "rope_alibi_content_rope": True},
  ),
  "t5": Encoding("T5 relative bias", {"pos_encoding": "t5"}),
  "kerple_log": Encoding("KERPLE log", {"pos_encoding": "kerple_log"}),
  "kerple_power": Encoding("KERPLE power", {"pos_encoding": "kerple_power"}),
  "fire": Encoding("FIRE", {"pos_encoding": "fire"}),
  "cope": Encoding("CoPE", {"pos_encoding": "cope"}),
  # the attention patterns of issue 47
  "rope_streaming": Encoding("rope + StreamingLLM (4 sinks + window, eval)", base="rope", streaming=4),
  "local_global": Encoding(
    "local/global (Gemma 3: window T/4 base 10k, global base 1M)",
    {"pos_encoding": "rope", "rope_theta": 1.0e6, "rope_local_base_freq": 1.0e4},
    derived=_local_global,
  ),
  "chunked": Encoding(
    "chunked RoPE T/4 + global NoPE (Llama 4)",
    {"pos_encoding": "rope", "attn_temperature_tuning": True},
    derived=_chunked,
  ),
}
"""Study rows by name, in table order."""
