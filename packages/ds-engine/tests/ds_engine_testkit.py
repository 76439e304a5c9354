"""Shared helpers for ds-engine tests: a tiny model, deterministic data, engine construction in one process."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import ds_engine


class TinyNet(nn.Module):
    """Two linear layers with a buffer and optional dropout (to exercise RNG state in checkpoints)."""

    def __init__(self, dropout: float = 0.0, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.l1 = nn.Linear(d_in, d_hidden)
        self.l2 = nn.Linear(d_hidden, d_out)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("buf", torch.arange(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.tanh(self.l1(x))))


class NormNet(nn.Module):
    """Linear layers around a LayerNorm: modules autocast treats as lower-precision safe, and one it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.norm(self.l1(x))))


def tiny_net(seed: int = 0, dropout: float = 0.0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(dropout)


def batches(
    num: int, batch: int, seed: int = 1, d_in: int = 8, d_out: int = 4
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num` (x, y) pairs of `batch` rows each, from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(num)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


def base_config(**overrides: Any) -> dict[str, Any]:
    """fp32, torch AdamW (so a plain torch loop can be the reference), no clipping, micro batch 4."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    cfg.update(overrides)
    return cfg


def make_engine(model: nn.Module, config: dict[str, Any], **kwargs: Any) -> ds_engine.DeepSpeedEngine:
    """initialize() in this process; no process group unless one already exists (run_ranks makes one)."""
    kwargs.setdefault("dist_init_required", False)
    engine, *_ = ds_engine.initialize(model=model, config=copy.deepcopy(config), **kwargs)
    return engine


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
