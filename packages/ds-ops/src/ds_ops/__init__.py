"""ds-ops: compiled ops for ds.

Op builders that compile native kernels just in time with ninja (or ahead of time into the wheel),
CPU optimizers with DeepSpeed's classes (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion),
the multi-tensor CUDA FusedAdam, `MuonWithAuxAdam` (Muon with Newton–Schulz in torch), ZenFlow's
selective AdamW (`ZenFlowSelectiveAdamW[_stage3]`), the async I/O op for ZeRO-Infinity
(`AsyncIOHandle`, DeepSpeed's `aio_handle`), and `ds_report`. Importing builds nothing and reads no environment.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_ops.__about__ import __version__
from ds_ops._in_pass_copy import InPassCopyOptimizer, supports_in_pass_copy
from ds_ops.adagrad import DeepSpeedCPUAdagrad
from ds_ops.adam import (
    DeepSpeedCPUAdam,
    FusedAdam,
    ZenFlowCPUAdam,
    ZenFlowSelectiveAdamW,
    ZenFlowSelectiveAdamW_stage3,
)
from ds_ops.aio import AioError, AsyncIOHandle, aio_handle
from ds_ops.lion import DeepSpeedCPULion
from ds_ops.muon import MuonWithAuxAdam, muon_update, newton_schulz_orthogonalize
from ds_ops.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum, StateOffloader, StatesOffloadedError
from ds_ops.op_builder import (
    ALL_OPS,
    AsyncIOBuilder,
    Compatibility,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    FusedAdamBuilder,
    OpBuilder,
    OpBuildError,
    OpNotCompatibleError,
)

if TYPE_CHECKING:  # type checkers see the lazy name's real type
    from ds_ops.aio._config import AioConfig


def __getattr__(name: str) -> object:
    # AioConfig imports pydantic (~0.3 s to import); it loads when first asked for.
    if name == "AioConfig":
        return importlib.import_module("ds_ops.aio._config").AioConfig
    raise AttributeError(f"module 'ds_ops' has no attribute {name!r}")


__all__ = [
    "ALL_OPS",
    "AioConfig",
    "AioError",
    "AsyncIOBuilder",
    "AsyncIOHandle",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "Compatibility",
    "DeepSpeedCPUAdagrad",
    "DeepSpeedCPUAdam",
    "DeepSpeedCPULion",
    "FusedAdam",
    "FusedAdamBuilder",
    "MuonWithAuxAdam",
    "InPassCopyOptimizer",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "OpBuildError",
    "OpBuilder",
    "OpNotCompatibleError",
    "StateOffloader",
    "StatesOffloadedError",
    "ZenFlowCPUAdam",
    "ZenFlowSelectiveAdamW",
    "ZenFlowSelectiveAdamW_stage3",
    "__version__",
    "aio_handle",
    "muon_update",
    "newton_schulz_orthogonalize",
    "supports_in_pass_copy",
]
