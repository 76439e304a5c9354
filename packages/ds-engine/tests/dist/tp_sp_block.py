"""The tiny attention block the tensor x sequence parallel tests train: AutoTP cuts its projections by `SPECS`,
and the sequence-parallel runs swap `Block.attention` for DistributedAttention."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

D, HEAD_DIM = 16, 4

SPECS: list[dict[str, Any]] = [
    {"patterns": [r".*\.(q_proj|k_proj|v_proj|up_proj)\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.(o_proj|down_proj)\.weight$"], "partition_type": "row"},
]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention over whole sequences, `[b, s, h, d]` in and out."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    s = q.size(2)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


class Block(nn.Module):
    """Attention (heads cut by AutoTP's column/row layers) and an MLP, both residual."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.o_proj = nn.Linear(D, D)
        self.up_proj, self.down_proj = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.attention: Any = causal_attention  # the sequence-parallel run swaps in DistributedAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = (proj(h).view(b, s, -1, HEAD_DIM) for proj in (self.q_proj, self.k_proj, self.v_proj))
        x = x + self.o_proj(self.attention(q, k, v).reshape(b, s, -1))
        return x + self.down_proj(torch.tanh(self.up_proj(x)))
