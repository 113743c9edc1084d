"""A small GPT-style decoder and its deterministic synthetic data (the built-in task, tasks/gpt.py).

The model is plain ``nn.Module`` code; sharding (FSDP2 ``fully_shard``) is applied by the
trainer. Sample ``i`` of the global stream is a pure function of (seed, i), so a restore that
sets the global position replays exactly the samples an uninterrupted run would have seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from resilient_training.run.config import ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """The same initial weights for the same (cfg, seed), on every rank and every restart."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return GPT(cfg)
    finally:
        torch.random.set_rng_state(generator_state)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of :class:`GPT` for ``cfg``, without building it."""
    d = cfg.d_model
    block = 12 * d * d + 13 * d  # qkv, proj, fc, out (weights and biases) and two layer norms
    return 2 * cfg.vocab_size * d + cfg.seq_len * d + cfg.n_layers * block + 2 * d


def sample(cfg: ModelConfig, *, seed: int, index: int) -> torch.Tensor:
    """Global sample number ``index`` (``seq_len + 1`` tokens): learnable, a noisy repeating pattern."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index * 7919)
    start = torch.randint(0, cfg.vocab_size, (1,), generator=gen)
    stride = torch.randint(1, 4, (1,), generator=gen)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    noise = torch.rand(tokens.shape, generator=gen) < 0.05
    return torch.where(noise, torch.randint(0, cfg.vocab_size, tokens.shape, generator=gen), tokens)


def batch(cfg: ModelConfig, *, seed: int, first: int, batch_size: int) -> torch.Tensor:
    """Global samples ``first .. first + batch_size - 1``, stacked."""
    return torch.stack([sample(cfg, seed=seed, index=first + i) for i in range(batch_size)])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
