"""`deepspeed.ops.op_builder`: ds-ops' op builders under DeepSpeed's path (`CPUAdamBuilder().load()`, `ALL_OPS`).

`PinMemoryBuilder` is ds-ops' pin_memory op (nothing to compile); importing this module makes it the
source of `DS_PIN_MEMORY_BACKEND=native` buffers (see the note below).

As in DeepSpeed, `FusedAdamBuilder` is the accelerator's builder of the `fused_adam` op: the CUDA op,
or on a CPU accelerator `CPUFusedAdamBuilder` (the CPU Adam kernel). It is found on first access,
since asking the accelerator imports torch. DeepSpeed's builder names for ops ds does not implement
(`InferenceBuilder`, `QuantizerBuilder`, ...) resolve to `NotImplementedBuilder`, as DeepSpeed's CPU
accelerator resolves the ops it lacks: its NAME is `deepspeed_not_implemented`, which
`__compatible_ops__` lists as False.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ds_comm
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
    PinMemoryBuilder,
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
    "PinMemoryBuilder",
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


def _load_pin_handle() -> ds_comm.LockedHostAllocator:
    # `PinMemoryBuilder` is looked up when called, so a script (or test) that replaces this module's
    # builder decides where native pinned memory comes from, as in DeepSpeed.
    return PinMemoryBuilder().load().pin_handle()


# [Note: the one import-time effect] Under DeepSpeed's path, native pinned memory is what this module's
# `PinMemoryBuilder` loads (DeepSpeed's NativePinnedMemory builds it from here). ds-comm, below every
# package, cannot import this module, so the module tells ds-comm where to load from. Nothing is
# loaded or built here; ds-comm's default (the same libc allocator) applies until then.
ds_comm.set_pin_handle_loader(_load_pin_handle)


def __getattr__(name: str) -> Any:
    if name == "FusedAdamBuilder":
        return host_op_builders()["fused_adam"]
    if name in NOT_IMPLEMENTED:
        return NotImplementedBuilder
    raise AttributeError(f"module 'ds_engine.ops.op_builder' has no attribute {name!r}")
