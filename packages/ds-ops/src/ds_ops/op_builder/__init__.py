"""Op builders: compile ds-ops' native kernels just in time (ninja) or ahead of time, and load them.

Usage mirrors DeepSpeed's `deepspeed.ops.op_builder`:

    from ds_ops.op_builder import CPUAdamBuilder
    builder = CPUAdamBuilder()
    if not builder.is_compatible():
        print(builder.is_compatible().reasons)
    lib = builder.load()          # prebuilt, cached, or compiled now (one log line, under a file lock)

This package does not import torch at import time, so the wheel's build hook can use it.
"""

from __future__ import annotations

from ds_ops.op_builder._aio import AsyncIOBuilder, io_uring_status
from ds_ops.op_builder._aot import env_var, selected_ops
from ds_ops.op_builder._base import ABI_VERSION, Compatibility, OpBuilder, OpNotCompatibleError
from ds_ops.op_builder._builders import (
    ALL_OPS,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPUFusedAdamBuilder,
    CPULionBuilder,
    FusedAdamBuilder,
    host_op_builders,
)
from ds_ops.op_builder._cache import extensions_root
from ds_ops.op_builder._cuda import CUDAOpBuilder
from ds_ops.op_builder._evoformer import EvoformerAttnBuilder
from ds_ops.op_builder._ninja import OpBuildError
from ds_ops.op_builder._not_implemented import NotImplementedBuilder
from ds_ops.op_builder._pin_memory import PinMemoryBuilder, PinMemoryOp
from ds_ops.op_builder._prebuilt import MANIFEST_NAME, PREBUILT_DIR, prebuilt_entry
from ds_ops.op_builder._toolchain import SIMD_FLAGS, detect_simd

__all__ = [
    "ABI_VERSION",
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPUFusedAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "Compatibility",
    "EvoformerAttnBuilder",
    "FusedAdamBuilder",
    "MANIFEST_NAME",
    "NotImplementedBuilder",
    "OpBuildError",
    "OpBuilder",
    "OpNotCompatibleError",
    "PREBUILT_DIR",
    "PinMemoryBuilder",
    "PinMemoryOp",
    "SIMD_FLAGS",
    "detect_simd",
    "env_var",
    "extensions_root",
    "host_op_builders",
    "io_uring_status",
    "prebuilt_entry",
    "selected_ops",
]
