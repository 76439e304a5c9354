"""`deepspeed.ops.op_builder`: ds-ops' op builders under DeepSpeed's path (`CPUAdamBuilder().load()`, `ALL_OPS`).

As in DeepSpeed, `FusedAdamBuilder` is the accelerator's builder of the `fused_adam` op: the CUDA op,
or on a CPU accelerator `CPUFusedAdamBuilder` (the CPU Adam kernel). It is found on first access,
since asking the accelerator imports torch. DeepSpeed's builder names for ops ds does not implement
(`InferenceBuilder`, `QuantizerBuilder`, ...) resolve to `NotImplementedBuilder`, as DeepSpeed's CPU
accelerator resolves the ops it lacks: its NAME is `deepspeed_not_implemented`, which
`__compatible_ops__` lists as False.
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
    NotImplementedBuilder,
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
    "NotImplementedBuilder",
    "OpBuilder",
]

#: DeepSpeed 0.19.8's op builders whose ops ds does not implement.
NOT_IMPLEMENTED = frozenset(
    {
        "CCLCommBuilder",
        "DeepCompileBuilder",
        "EvoformerAttnBuilder",
        "FPQuantizerBuilder",
        "FusedLambBuilder",
        "FusedLionBuilder",
        "GDSBuilder",
        "InferenceBuilder",
        "InferenceCoreBuilder",
        "InferenceCutlassBuilder",
        "PinMemoryBuilder",
        "QuantizerBuilder",
        "RaggedOpsBuilder",
        "RaggedUtilsBuilder",
        "RandomLTDBuilder",
        "ShareMemCommBuilder",
        "SparseAttnBuilder",
        "SpatialInferenceBuilder",
        "StochasticTransformerBuilder",
        "TransformerBuilder",
        "UtilsBuilder",
    }
)


def __getattr__(name: str) -> Any:
    if name == "FusedAdamBuilder":
        return host_op_builders()["fused_adam"]
    if name in NOT_IMPLEMENTED:
        return NotImplementedBuilder
    raise AttributeError(f"module 'ds_engine.ops.op_builder' has no attribute {name!r}")
