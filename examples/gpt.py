"""A small GPT-style language model for the examples, the demo and the benchmarks.

Plain PyTorch (no ds imports), so the same model runs under DDP, FSDP2, ZeRO and pipelines.
`GPT.layers()` gives the flat layer list a `PipelineModule` wants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 64
    """Longest sequence the position embedding covers."""
    num_layers: int = 4
    num_heads: int = 4
    dim: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True
    """Share the token embedding with the output head (as GPT-2 does)."""

    @property
    def num_params_estimate(self) -> int:
        per_block = 12 * self.dim * self.dim + 13 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.num_layers * per_block + (self.vocab_size + self.block_size) * self.dim + head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim), nn.Dropout(cfg.dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + position embedding (the first pipeline layer)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.block_size, cfg.dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Head(nn.Module):
    """Final norm and projection to the vocabulary (the last pipeline layer)."""

    def __init__(self, cfg: GPTConfig, embedding: Embedding | None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if embedding is not None:
            self.out.weight = embedding.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    """`GPT(cfg)(idx, targets)` returns the mean next-token cross-entropy; without targets, the logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg, self.embed if cfg.tie_embeddings else None)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def gpt_for_params(target_params: int, *, vocab_size: int = 64, block_size: int = 64) -> GPTConfig:
    """A GPTConfig of roughly `target_params` parameters (for benchmarks: `gpt_for_params(20_000_000)`)."""
    dim = 256
    while True:
        layers = max(1, round((target_params - (vocab_size + block_size) * dim) / (12 * dim * dim)))
        if layers <= 12 or dim >= 2048:
            break
        dim *= 2
    heads = max(1, dim // 64)
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, num_layers=layers, num_heads=heads, dim=dim)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
