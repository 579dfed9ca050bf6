"""Shared steps of the transformers parity tests (hf_decoder_parity_test, hf_gpt_oss_parity_test,
hf_llama4_parity_test): transformers' greedy generation with its per-step logits, and jaxpe's decoder
fed the same tokens one at a time through one compiled step on its KV cache."""

import importlib

import jax
import numpy as np
from flax import nnx


def hf_greedy(hf, tokens: np.ndarray, mask: np.ndarray, new: int) -> tuple[np.ndarray, np.ndarray]:
  """transformers' greedy ``generate`` of ``new`` tokens (no stopping): ``(tokens [B, new], logits
  [B, new, V])``."""
  torch = importlib.import_module("torch")
  hf.generation_config.eos_token_id = None  # no stopping: min_new_tokens would suppress the EOS id
  with torch.no_grad():
    out = hf.generate(
      torch.tensor(tokens),
      attention_mask=torch.tensor(mask),
      max_new_tokens=new,
      do_sample=False,
      output_logits=True,
      return_dict_in_generate=True,
      pad_token_id=0,
    )
  return out.sequences[:, tokens.shape[1] :].numpy(), np.stack([lg.numpy() for lg in out.logits], axis=1)


def token_by_token_logits(model, tokens: np.ndarray, mask: np.ndarray, ref_tokens: np.ndarray, cache):
  """jaxpe's next-token logits [B, new, V] after the prompt and each of ``ref_tokens`` but the last,
  the prompt (its padding too, by ``attention_mask``) fed a token at a time through one jitted step."""
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda st, tok, m, c: nnx.merge(graphdef, st)(tok, attention_mask=m, cache=c))
  feed = np.concatenate([tokens, ref_tokens[:, :-1]], axis=1)
  valid = np.concatenate([mask, np.ones_like(ref_tokens[:, :-1])], axis=1)
  last = []
  for i in range(feed.shape[1]):
    logits, cache = step(state, feed[:, i : i + 1], valid[:, i : i + 1], cache)
    last.append(np.asarray(logits[:, -1]))
  return np.stack(last[tokens.shape[1] - 1 :], axis=1)
