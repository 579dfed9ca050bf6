"""jaxpe -> Hugging Face BLOOM: the state dict through the name map, a checkpoint directory that
``BloomForCausalLM.from_pretrained`` loads, or a transformers model in memory.

torch, transformers and safetensors (the ``bloom`` extra) are imported inside the functions that
need them, so ``import jaxpe`` never does.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from jaxpe.bloom.config import check_bloom_compatible, hf_config_from
from jaxpe.bloom.names import Dims, weight_rules
from jaxpe.errors import require_extra
from jaxpe.model import Decoder
from jaxpe.model.build import model_params

__all__ = ["EXPORT_FILES", "save_hf", "to_hf_state_dict", "to_transformers"]


def to_hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
  """The ``BloomForCausalLM`` state dict (``transformer.``-prefixed keys, float32 numpy) of a
  BLOOM-compatible jaxpe model. ``lm_head.weight`` is left out when the embeddings are tied (HF
  ties it on load).

  Raises:
    ValueError: the model's config is not BLOOM-compatible (see ``check_bloom_compatible``), or an
      untied output head with a nonzero bias.
  """
  cfg = model.cfg
  check_bloom_compatible(cfg)
  dims = Dims.of(cfg)
  params = model_params(model)
  out = {}
  for rule in weight_rules(cfg):
    key = rule.hf if rule.hf == "lm_head.weight" else "transformer." + rule.hf
    out[key] = np.ascontiguousarray(rule.to_hf(*(params[p] for p in rule.jax), dims), np.float32)
  return out


EXPORT_FILES = ("config.json", "model.safetensors")
"""The files ``save_hf`` writes (and the only ones it ever replaces)."""


def save_hf(model: Decoder, path: str | Path, *, overwrite: bool = False, force: bool = False) -> Path:
  """Writes an HF checkpoint directory (``config.json`` + ``model.safetensors``) that
  ``transformers.BloomForCausalLM.from_pretrained(path)`` loads.

  Only those two files are ever written or replaced; nothing else in ``path`` is touched (an HF
  directory keeps its ``tokenizer.json`` and ``README.md``). A new directory is written under a
  temporary name and renamed into place; in an existing one each file is written to a temporary
  name and renamed over the old one, so an interrupted export never leaves a half-written file.
  Directories and files get the usual permissions (0777 / 0666 less the umask).

  Args:
    model: a BLOOM-compatible ``Decoder`` (see ``check_bloom_compatible``).
    path: the directory to create or write into; never the current directory or one of its parents.
    overwrite: replace the two files of an existing BLOOM export (a directory whose ``config.json``
      says ``model_type: bloom``).
    force: also write into a non-empty directory that is not a BLOOM export (its files are kept;
      one holding its own ``config.json`` or ``model.safetensors`` is refused even so).

  Returns:
    the directory.

  Raises:
    TypeError: ``model`` not a ``Decoder``; ``path`` not a non-empty str / PathLike; a non-bool
      ``overwrite`` or ``force``.
    ValueError: ``path`` is the current directory or one of its parents; ``path`` holds other
      weight files (``*.safetensors``, ``*.bin``, an index) that would shadow or mix with the new
      ones; see also ``to_hf_state_dict``.
    FileExistsError: ``path`` is a BLOOM export and ``overwrite`` is False, or a non-empty
      directory that is not one and ``force`` is False, or not a directory; or, whatever the flags,
      it holds a ``config.json`` or ``model.safetensors`` that is not a BLOOM export's (another
      model's HF directory).
  """
  require_extra("bloom", "save_hf", ("safetensors",))
  from safetensors.numpy import save_file

  if not isinstance(model, Decoder):
    raise TypeError(f"model must be a jaxpe.model.Decoder, got {type(model).__name__}")
  if not isinstance(path, str | os.PathLike) or str(path) == "":
    raise TypeError(f"path must be a non-empty str or os.PathLike directory, got {path!r}")
  for flag, value in (("overwrite", overwrite), ("force", force)):
    if not isinstance(value, bool):
      raise TypeError(f"{flag} must be True or False, got {value!r}")
  root = Path(path)
  _check_export_target(root, overwrite=overwrite, force=force)
  state = to_hf_state_dict(model)
  config_text = json.dumps(hf_config_from(model.cfg), indent=2, allow_nan=False) + "\n"
  umask = os.umask(0)
  os.umask(umask)
  fresh = not root.exists()
  root.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent if fresh else root))
  try:
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(config_text)
    for name in EXPORT_FILES:
      (tmp / name).chmod(0o666 & ~umask)
    if fresh:
      tmp.chmod(0o777 & ~umask)
      tmp.rename(root)
    else:
      for name in EXPORT_FILES:
        os.replace(tmp / name, root / name)
      tmp.rmdir()
  except BaseException:
    for name in EXPORT_FILES:
      (tmp / name).unlink(missing_ok=True)
    if tmp.exists():
      tmp.rmdir()
    raise
  return root


def _check_export_target(root: Path, *, overwrite: bool, force: bool) -> None:
  """Raises unless ``save_hf`` may write ``EXPORT_FILES`` into ``root`` (see there)."""
  resolved, cwd = root.resolve(), Path.cwd().resolve()
  if resolved == cwd or resolved in cwd.parents:
    raise ValueError(
      f"refusing to export into {str(root)!r}: it is the current directory or one of its parents; "
      "give a new subdirectory"
    )
  if not root.exists():
    return
  if not root.is_dir():
    raise FileExistsError(f"{str(root)!r} exists and is not a directory")
  others = sorted(p.name for p in root.iterdir() if p.name not in EXPORT_FILES)
  weights = [
    n for n in others if n.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
  ]
  if weights:
    raise ValueError(
      f"{str(root)!r} holds other weight files ({', '.join(weights)}) that would mix with the export; "
      "remove them or choose another directory"
    )
  try:
    is_export = json.loads((root / "config.json").read_text()).get("model_type") == "bloom"
  except (OSError, ValueError, AttributeError):
    is_export = False
  foreign = [n for n in EXPORT_FILES if (root / n).exists()] if not is_export else []
  if foreign:
    raise FileExistsError(
      f"{str(root)!r} holds {' and '.join(foreign)} not from a BLOOM export; the export would replace them "
      "(force=True keeps only other files): choose another directory"
    )
  if is_export and not overwrite:
    raise FileExistsError(
      f"{str(root)!r} already holds a BLOOM export; pass overwrite=True to replace its config.json and "
      "model.safetensors (other files are kept)"
    )
  if not is_export and any(root.iterdir()) and not force:
    listed = ", ".join(sorted(p.name for p in root.iterdir())[:5])
    raise FileExistsError(
      f"{str(root)!r} is not empty ({listed}) and not a BLOOM export; pass force=True to write "
      "config.json and model.safetensors into it (other files are kept), or choose another directory"
    )


def to_transformers(model: Decoder):
  """A transformers ``BloomForCausalLM`` (float32, eval mode) with the weights of ``model``.

  Raises:
    ValueError: see ``to_hf_state_dict``.
  """
  require_extra("bloom", "to_transformers", ("torch", "transformers"))
  import torch
  from transformers import BloomConfig, BloomForCausalLM

  hf = BloomForCausalLM(BloomConfig(**hf_config_from(model.cfg)))
  state = {k: torch.tensor(v) for k, v in to_hf_state_dict(model).items()}
  hf.load_state_dict(state, strict=not model.cfg.tie_embeddings)
  if model.cfg.tie_embeddings:
    hf.tie_weights()
  return hf.eval()
