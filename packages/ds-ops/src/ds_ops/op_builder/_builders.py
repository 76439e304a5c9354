"""The ops ds-ops ships: one builder per op, with DeepSpeed's op names."""

from __future__ import annotations

import ctypes
from typing import ClassVar

from ds_ops.op_builder._aio import AsyncIOBuilder
from ds_ops.op_builder._base import CFunctionSpec, OpBuilder
from ds_ops.op_builder._cuda import CUDAOpBuilder

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# Arrays (one entry per tensor of a param group) are passed as pointers to ctypes arrays.
_i64s, _i32s, _ptrs = ctypes.POINTER(_i64), ctypes.POINTER(_i32), ctypes.POINTER(_ptr)


class CPUAdamBuilder(OpBuilder):
    """Adam/AdamW for CPU tensors (DeepSpeedCPUAdam)."""

    NAME = "cpu_adam"
    SOURCES = ("adam/cpu_adam.cpp",)
    FUNCTIONS: ClassVar[dict[str, CFunctionSpec]] = {
        # num_tensors, numels, params, dtypes, grads, dtypes, exp_avgs, exp_avg_sqs, state dtypes, copies,
        # copy dtypes, decay, l2, 1-beta1, beta2, 1-beta2, bc2_sqrt, eps, neg_step_size, num_threads
        "ds_cpu_adam_step": (
            _i32,
            (
                _i32,
                _i64s,
                _ptrs,
                _i32s,
                _ptrs,
                _i32s,
                _ptrs,
                _ptrs,
                _i32s,
                _ptrs,
                _i32s,
                _f32,
                _f32,
                _f32,
                _f32,
                _f32,
                _f32,
                _f32,
                _f32,
                _i32,
            ),
        ),
    }


class CPUAdagradBuilder(OpBuilder):
    """Adagrad for CPU tensors (DeepSpeedCPUAdagrad)."""

    NAME = "cpu_adagrad"
    SOURCES = ("adagrad/cpu_adagrad.cpp",)
    FUNCTIONS: ClassVar[dict[str, CFunctionSpec]] = {
        # num_tensors, numels, params, dtypes, grads, dtypes, exp_avg_sqs, state dtypes, copies, copy dtypes,
        # l2, eps, neg_lr, num_threads
        "ds_cpu_adagrad_step": (
            _i32,
            (_i32, _i64s, _ptrs, _i32s, _ptrs, _i32s, _ptrs, _i32s, _ptrs, _i32s, _f32, _f32, _f32, _i32),
        ),
    }


class CPULionBuilder(OpBuilder):
    """Lion for CPU tensors (DeepSpeedCPULion)."""

    NAME = "cpu_lion"
    SOURCES = ("lion/cpu_lion.cpp",)
    FUNCTIONS: ClassVar[dict[str, CFunctionSpec]] = {
        # num_tensors, numels, params, dtypes, grads, dtypes, exp_avgs, state dtypes, copies, copy dtypes,
        # decay, beta1, 1-beta1, beta2, 1-beta2, neg_lr, num_threads
        "ds_cpu_lion_step": (
            _i32,
            (
                _i32,
                _i64s,
                _ptrs,
                _i32s,
                _ptrs,
                _i32s,
                _ptrs,
                _i32s,
                _ptrs,
                _i32s,
                _f32,
                _f32,
                _f32,
                _f32,
                _f32,
                _f32,
                _i32,
            ),
        ),
    }


class FusedAdamBuilder(CUDAOpBuilder):
    """Multi-tensor Adam/AdamW for CUDA tensors (FusedAdam)."""

    NAME = "fused_adam"
    SOURCES = ("adam/fused_adam.cu",)
    INCLUDE_DIRS = ()
    FUNCTIONS: ClassVar[dict[str, CFunctionSpec]] = {
        # meta, num_tensors, num_chunks, chunk_numel, dtype,
        # decay, l2, 1-beta1, beta2, 1-beta2, bc2_sqrt, eps, neg_step_size, stream
        "ds_fused_adam_step": (
            _i32,
            (_ptr, _i32, _i64, _i64, _i32, _f32, _f32, _f32, _f32, _f32, _f32, _f32, _f32, _ptr),
        ),
    }


ALL_OPS: dict[str, type[OpBuilder]] = {
    builder.NAME: builder
    for builder in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, AsyncIOBuilder)
}
