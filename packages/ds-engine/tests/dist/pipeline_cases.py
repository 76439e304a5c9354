"""A tiny 2-stage pipeline (2 ranks, ZeRO 1) for the dist tests that save and read its checkpoints."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D, H, ROWS, GAS = 6, 10, 4, 2


def two_stage_engine(**config: Any) -> Any:
    """Linear(D,H), ReLU | Linear(H,H), Linear(H,2) on two stages, seeded layers, AdamW; `config` is added."""
    import ds_engine
    from ds_pipe import LayerSpec, PipeDataParallelTopology, PipelineModule

    model = PipelineModule(
        [LayerSpec(nn.Linear, D, H), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, H, H), LayerSpec(nn.Linear, H, 2)],
        topology=PipeDataParallelTopology(num_pp=2, num_dp=1),
        loss_fn=lambda out, y: F.mse_loss(out, y),
        partition_method=[0, 2, 4],
        seed_layers=True,
        base_seed=7,
    )
    base = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = ds_engine.initialize(model=model, config=copy.deepcopy({**base, **config}))
    return engine


def batches(step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The `GAS` micro-batches of one training batch (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    return iter([(torch.randn(ROWS, D, generator=g), torch.randn(ROWS, 2, generator=g)) for _ in range(GAS)])
