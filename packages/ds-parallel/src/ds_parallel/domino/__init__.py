"""Domino: tensor parallelism whose all-reduces overlap compute (DeepSpeed's `deepspeed.runtime.domino`).

The batch is split in two halves that take turns through the layers; every tensor-parallel all-reduce is
asynchronous, so one half's reduction runs while the other half computes. See `transformer` for the
schedule and `async_linear` for the linears.
"""

from __future__ import annotations

from ds_parallel.domino.async_linear import (
    DominoAsyncColumnParallelLinear,
    DominoAsyncColumnParallelLinearImpl,
    RowParallelLinearNoComm,
)
from ds_parallel.domino.transformer import (
    AttnMaskType,
    AttnType,
    CoreAttention,
    DominoModule,
    DominoTransformer,
    DominoTransformerLayer,
    DominoUtil,
    LayerType,
    ModelType,
    ShardedAttention,
)

__all__ = [
    "AttnMaskType",
    "AttnType",
    "CoreAttention",
    "DominoAsyncColumnParallelLinear",
    "DominoAsyncColumnParallelLinearImpl",
    "DominoModule",
    "DominoTransformer",
    "DominoTransformerLayer",
    "DominoUtil",
    "LayerType",
    "ModelType",
    "RowParallelLinearNoComm",
    "ShardedAttention",
]
