"""The PyTorch reference of jaxpe's train step: a nanoGPT-style decoder of the same shape as
``jaxpe.model.decoder.Decoder`` with ``pos_encoding="rope"`` and its AdamW step, what a user would
write instead (issue 21, item 3).

Same model as jaxpe's default decoder (``jaxpe/model/decoder.py``, ``layers.py``): token embedding
``[V, D]``; L pre-LayerNorm blocks (LayerNorm -> causal self-attention with RoPE on q and k ->
residual, LayerNorm -> ``D -> F`` -> exact GELU -> ``F -> D`` -> residual), no biases on the linear
layers, LayerNorms with scale and bias (eps ``1e-5``); final LayerNorm; logits tied to the embedding
(``x @ E^T``); mean next-token cross-entropy. RoPE in jaxpe's interleaved layout (pairs ``(2i,
2i + 1)``, Meta's llama ``apply_rotary_emb``) at ``theta ** (-2i / H)`` rounded to float32 as jaxpe
and HF hold it, phases ``p * inv_freq`` computed in float64 (jaxpe's exact phases). q, k and v come
from one ``[D, 3 D]`` projection (nanoGPT's ``c_attn``; the same product as jaxpe's three), attention
is ``F.scaled_dot_product_attention(is_causal=True)`` (PyTorch's fused flash kernel on CPU), scale
``H ** -0.5``. Initialisation as jaxpe (and nanoGPT): Normal(0, 0.02), output projections
``0.02 / sqrt(2 L)``, LayerNorm ones / zeros. Float32 throughout.

The optimizer is jaxpe's trainer's (``jaxpe.train.optimizer.make_optimizer``): global-norm clipping
at ``grad_clip``, AdamW (``b1``, ``b2``, eps ``1e-8``, decoupled ``weight_decay`` on rank >= 2
parameters only: the embedding and the kernels), learning rate with linear warmup and cosine decay to
``min_lr_ratio`` of the peak over ``num_steps``; ``torch.optim.AdamW``'s default implementation on
CPU (as nanoGPT on CPU).

Shape alphabet: B batch, T positions, N heads, H head dim, D model dim, F MLP dim, V vocab, L layers.
Source: Karpathy's nanoGPT ``model.py`` (github.com/karpathy/nanoGPT); Su et al., RoFormer, arXiv
2104.09864; Meta llama ``model.py`` ``apply_rotary_emb``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def rope_cos_sin(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
  """``(cos, sin)`` ``[T, H/2]`` float32 of the phases ``p * inv_freq_i``, ``p < T``,
  ``inv_freq_i = theta ** (-2i / H)`` rounded to float32, the product and cos / sin in float64."""
  inv = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32)
  phase = np.arange(seq, dtype=np.float64)[:, None] * inv.astype(np.float64)[None, :]
  return torch.from_numpy(np.cos(phase).astype(np.float32)), torch.from_numpy(
    np.sin(phase).astype(np.float32)
  )


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """Rotates pairs ``(2i, 2i + 1)`` of x ``[B, T, N, H]`` by the phases ``cos, sin [T, H/2]``."""
  x0, x1 = x[..., 0::2], x[..., 1::2]
  c, s = cos[:, None, :], sin[:, None, :]
  return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class Block(nn.Module):
  """Pre-LayerNorm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; x ``[B, T, D]``."""

  def __init__(self, d_model: int, num_heads: int, mlp_dim: int, eps: float):
    super().__init__()
    self.num_heads = num_heads
    self.ln_1 = nn.LayerNorm(d_model, eps=eps)
    self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)  # q | k | v, heads (N, H) row-major
    self.c_proj = nn.Linear(d_model, d_model, bias=False)
    self.ln_2 = nn.LayerNorm(d_model, eps=eps)
    self.c_fc = nn.Linear(d_model, mlp_dim, bias=False)
    self.mlp_proj = nn.Linear(mlp_dim, d_model, bias=False)

  def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    n = self.num_heads
    q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, n, d // n).unbind(2)  # [B, T, N, H] each
    q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
    y = F.scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
    return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TorchDecoder(nn.Module):
  """The decoder; ``model(tokens [B, T] int64) -> logits [B, T, V]`` float32, ``model.loss(batch
  [B, T + 1])`` the mean next-token cross-entropy (nats per token).

  Raises:
    ValueError: ``d_model`` not divisible by ``num_heads``, an odd head dim, or T > ``max_len``.
  """

  def __init__(
    self,
    *,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    mlp_dim: int,
    max_len: int,
    rope_theta: float = 10000.0,
    eps: float = 1e-5,
    init_std: float = 0.02,
    seed: int = 0,
  ):
    super().__init__()
    if d_model % num_heads or (d_model // num_heads) % 2:
      raise ValueError(
        f"d_model ({d_model}) must be divisible by num_heads ({num_heads}) into an even head dim"
      )
    self.max_len = max_len
    self.wte = nn.Embedding(vocab_size, d_model)
    self.h = nn.ModuleList(Block(d_model, num_heads, mlp_dim, eps) for _ in range(num_layers))
    self.ln_f = nn.LayerNorm(d_model, eps=eps)
    cos, sin = rope_cos_sin(max_len, d_model // num_heads, rope_theta)
    self.register_buffer("cos", cos, persistent=False)
    self.register_buffer("sin", sin, persistent=False)
    gen = torch.Generator().manual_seed(seed)
    out_std = init_std / math.sqrt(2 * num_layers)
    with torch.no_grad():
      for name, p in self.named_parameters():
        if name.startswith("ln") or ".ln_" in name:
          continue  # LayerNorm: ones and zeros
        p.normal_(
          0.0, out_std if name.endswith(("c_proj.weight", "mlp_proj.weight")) else init_std, generator=gen
        )

  @classmethod
  def from_config(cls, cfg, *, seed: int = 0) -> TorchDecoder:
    """The reference of a ``jaxpe.model.config.ModelConfig`` with ``pos_encoding="rope"`` and the
    default decoder options (no biases, no embedding LayerNorm, exact GELU, tied embeddings, MHA,
    H = D / N, float32, no RoPE scaling, interleaved layout).

    Raises:
      ValueError: a config with any other option.
    """
    other = {
      "pos_encoding": "rope",
      "rope_layout": "interleaved",
      "use_bias": False,
      "embed_layernorm": False,
      "gelu_approximate": False,
      "tie_embeddings": True,
      "dtype": "float32",
      "rope_scaling": None,
      "rotary_dim": None,
      "head_dim": None,
    }
    wrong = {k: getattr(cfg, k) for k, v in other.items() if getattr(cfg, k) != v}
    if wrong or cfg.kv_heads != cfg.num_heads:
      raise ValueError(f"the torch reference covers only {other} with num_kv_heads = num_heads; got {wrong}")
    return cls(
      vocab_size=cfg.vocab_size,
      d_model=cfg.d_model,
      num_layers=cfg.num_layers,
      num_heads=cfg.num_heads,
      mlp_dim=cfg.mlp_size,
      max_len=cfg.max_len,
      rope_theta=cfg.rope_theta,
      eps=cfg.layernorm_eps,
      init_std=cfg.init_std,
      seed=seed,
    )

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.shape[1]
    if t > self.max_len:
      raise ValueError(f"tokens has T = {t} positions, more than max_len = {self.max_len}")
    x = self.wte(tokens)
    cos, sin = self.cos[:t], self.sin[:t]
    for block in self.h:
      x = block(x, cos, sin)
    return self.ln_f(x) @ self.wte.weight.T

  def last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` logits of the last token only (nanoGPT's inference forward: ``lm_head(x[:, [-1]])``)."""
    t = tokens.shape[1]
    x = self.wte(tokens)
    cos, sin = self.cos[:t], self.sin[:t]
    for block in self.h:
      x = block(x, cos, sin)
    return self.ln_f(x[:, -1]) @ self.wte.weight.T

  @torch.no_grad()
  def generate(self, tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """nanoGPT's ``GPT.generate`` at temperature 0 (greedy): each new token recomputes the forward
    of the last ``max_len`` tokens (no KV cache) and appends the argmax of the last token's logits.
    ``tokens [B, T]`` int64 -> ``[B, max_new_tokens]`` int64."""
    idx = tokens
    for _ in range(max_new_tokens):
      logits = self.last_logits(idx[:, -self.max_len :])
      idx = torch.cat([idx, torch.argmax(logits, dim=-1, keepdim=True)], dim=1)
    return idx[:, tokens.shape[1] :]

  def loss(self, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``batch[:, 1:]`` given ``batch[:, :-1]`` (``[B, T + 1]`` int64)."""
    logits = self(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def load_jaxpe_params(torch_model: TorchDecoder, model) -> None:
  """Copies the parameters of a jaxpe ``Decoder`` (the config ``from_config`` accepts) into
  ``torch_model``: q/k/v kernels ``[D, N, H]`` into ``c_attn`` (``[3 D, D]``), o ``[N, H, D]`` into
  ``c_proj``, MLP kernels transposed, LayerNorm scale / bias, the embedding."""
  blocks = list(model.blocks)

  def t(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float32))

  with torch.no_grad():
    torch_model.wte.weight.copy_(t(model.embed.embedding[...]))
    for tb, jb in zip(torch_model.h, blocks, strict=True):
      d = tb.c_attn.in_features
      qkv = [t(getattr(jb.attn, n).kernel[...]).reshape(d, -1).T for n in ("q", "k", "v")]
      tb.c_attn.weight.copy_(torch.cat(qkv, 0))
      tb.c_proj.weight.copy_(t(jb.attn.o.kernel[...]).reshape(-1, d).T)
      tb.c_fc.weight.copy_(t(jb.mlp.up.kernel[...]).T)
      tb.mlp_proj.weight.copy_(t(jb.mlp.down.kernel[...]).T)
      for tn, jn in ((tb.ln_1, jb.attn_norm), (tb.ln_2, jb.mlp_norm)):
        tn.weight.copy_(t(jn.scale[...]))
        tn.bias.copy_(t(jn.bias[...]))
    torch_model.ln_f.weight.copy_(t(model.final_norm.scale[...]))
    torch_model.ln_f.bias.copy_(t(model.final_norm.bias[...]))


def make_optimizer(
  model: nn.Module, train_cfg
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
  """``(AdamW, its schedule)`` with the settings of a ``jaxpe.train.config.TrainConfig`` (those of
  ``jaxpe.train.optimizer.make_optimizer``): decay on rank >= 2 parameters, warmup then cosine."""
  peak, warmup, steps = train_cfg.learning_rate, train_cfg.warmup_steps, train_cfg.num_steps
  floor = train_cfg.min_lr_ratio
  params = [p for p in model.parameters() if p.requires_grad]
  groups = [
    {"params": [p for p in params if p.dim() >= 2], "weight_decay": train_cfg.weight_decay},
    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
  ]
  opt = torch.optim.AdamW(groups, lr=peak, betas=(train_cfg.b1, train_cfg.b2), eps=1e-8)
  decay = max(steps, warmup + 1)

  def factor(count: int) -> float:  # optax.warmup_cosine_decay_schedule / peak
    if count < warmup:
      return count / warmup
    frac = min(count - warmup, decay - warmup) / (decay - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

  return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def make_train_step(model: TorchDecoder, train_cfg, *, compile_model: bool = False):
  """``step(batch [B, T + 1] int64) -> loss`` (a float): one AdamW step as jaxpe's trainer takes it
  (loss, backward, global-norm clipping at ``grad_clip``, update, schedule). ``compile_model``
  runs the model's loss under ``torch.compile`` (the optimizer stays eager); the first call compiles."""
  opt, sched = make_optimizer(model, train_cfg)
  loss_fn = torch.compile(model.loss) if compile_model else model.loss

  def step(batch: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
    opt.step()
    sched.step()
    return loss.item()

  return step
