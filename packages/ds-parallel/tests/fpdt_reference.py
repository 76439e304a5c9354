"""A plain-PyTorch transformer attention block to check FPDT against: QKV projection, rotary, causal attention."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
HIDDEN = 16


def config() -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
    )


def params(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {
        "w_qkv": torch.randn(qkv, HIDDEN, generator=gen, dtype=dtype) * 0.3,
        "b_qkv": torch.randn(qkv, generator=gen, dtype=dtype) * 0.1,
        "w_out": torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=gen, dtype=dtype) * 0.3,
    }


def rotary(seq: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[seq, 1, 1, HEAD_DIM]`, sequence first (Megatron's layout)."""
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=dtype) / HEAD_DIM))
    freqs = torch.outer(torch.arange(seq, dtype=dtype), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None, None], emb.sin()[:, None, None]


def _rot(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention_block(x: torch.Tensor, p: dict[str, torch.Tensor], rope: tuple | None) -> torch.Tensor:
    """`[s, b, hidden]` -> `[s, b, hidden]`: causal attention, the output projection's bias left out."""
    s, b = x.shape[:2]
    qkv = F.linear(x, p["w_qkv"], p["b_qkv"])
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.reshape(s, b, -1, HEAD_DIM) for t in (q, k, v))
    if rope is not None:
        cos, sin = rope
        q, k = _rot(q, cos, sin), _rot(k, cos, sin)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).flatten(2)
    return out @ p["w_out"].t()
