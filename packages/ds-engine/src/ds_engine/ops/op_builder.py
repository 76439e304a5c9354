"""`deepspeed.ops.op_builder`: ds-ops' op builders under DeepSpeed's path (`CPUAdamBuilder().load()`, `ALL_OPS`).

As in DeepSpeed, `FusedAdamBuilder` is the accelerator's builder of the `fused_adam` op: the CUDA op,
or on a CPU accelerator `CPUFusedAdamBuilder` (the CPU Adam kernel). It is found on first access,
since asking the accelerator imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_ops.op_builder import (
    ALL_OPS,
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPUFusedAdamBuilder,
    CPULionBuilder,
    CUDAOpBuilder,
    OpBuilder,
    host_op_builders,
)

if TYPE_CHECKING:  # type checkers see one of the two classes the name resolves to
    from ds_ops.op_builder import FusedAdamBuilder

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPUFusedAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "FusedAdamBuilder",
    "OpBuilder",
]


def __getattr__(name: str) -> Any:
    if name == "FusedAdamBuilder":
        return host_op_builders()["fused_adam"]
    raise AttributeError(f"module 'ds_engine.ops.op_builder' has no attribute {name!r}")
