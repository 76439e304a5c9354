"""`deepspeed.ops.op_builder`: ds-ops' op builders under DeepSpeed's path (`CPUAdamBuilder().load()`, `ALL_OPS`)."""

from __future__ import annotations

from ds_ops.op_builder import (
    ALL_OPS,
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    CUDAOpBuilder,
    FusedAdamBuilder,
    OpBuilder,
)

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "FusedAdamBuilder",
    "OpBuilder",
]
