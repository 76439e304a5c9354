"""The ops ds-ops ships: one builder per op, with DeepSpeed's op names."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import ClassVar

from ds_ops.op_builder._aio import AsyncIOBuilder
from ds_ops.op_builder._base import CFunctionSpec, OpBuilder
from ds_ops.op_builder._cuda import CUDAOpBuilder

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# Arrays (one entry per tensor of a param group) are passed as pointers to ctypes arrays.
_i64s, _i32s, _ptrs = ctypes.POINTER(_i64), ctypes.POINTER(_i32), ctypes.POINTER(_ptr)


# num_tensors, numels, params, dtypes, grads, dtypes, exp_avgs, exp_avg_sqs, state dtypes, copies, copy dtypes,
# decay, l2, 1-beta1, beta2, 1-beta2, bc2_sqrt, eps, neg_step_size: ds_cpu_adam_step's arguments before num_threads
_ADAM_ARGS = (_i32, _i64s, _ptrs, _i32s, _ptrs, _i32s, _ptrs, _ptrs, _i32s, _ptrs, _i32s, *(_f32,) * 8)


class CPUAdamBuilder(OpBuilder):
    """Adam/AdamW for CPU tensors (DeepSpeedCPUAdam): a step, and its inverse (`rollback_subgroup`)."""

    NAME = "cpu_adam"
    SOURCES = ("adam/cpu_adam.cpp",)
    FUNCTIONS: ClassVar[dict[str, CFunctionSpec]] = {
        "ds_cpu_adam_step": (_i32, (*_ADAM_ARGS, _i32)),  # ..., num_threads
        "ds_cpu_adam_rollback": (_i32, (*_ADAM_ARGS, _f32, _i32)),  # ..., beta1, num_threads
    }


class CPUFusedAdamBuilder(CPUAdamBuilder):
    """The fused_adam op on a CPU accelerator: FusedAdam's CPU tensors step with the CPU Adam kernel.

    DeepSpeed's CPU accelerator builds its own `fused_adam` from its CPU Adam sources; so does this
    builder (from `adam/cpu_adam.cpp`, into its own library). `host_op_builders()` maps the op name
    `fused_adam` to this class when the accelerator is the CPU, so `__compatible_ops__` and `ds_report`
    answer for the implementation a CPU run uses. It is never taken from the wheel's prebuilt libraries,
    whose `fused_adam` is the CUDA one (`FusedAdamBuilder`); it compiles in seconds on first use.
    """

    NAME = "fused_adam"

    def absolute_name(self) -> str:
        return "ds_ops.fused_adam_cpu_op"

    def prebuilt_installed(self) -> bool:
        return False

    def prebuilt_library(self) -> tuple[Path | None, str]:
        return None, "the prebuilt fused_adam is the CUDA op; the CPU one is JIT-built"


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


# The ops by name, as built ahead of time and listed; `fused_adam` is the CUDA op here (see host_op_builders).
ALL_OPS: dict[str, type[OpBuilder]] = {
    builder.NAME: builder
    for builder in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, AsyncIOBuilder)
}


def host_op_builders() -> dict[str, type[OpBuilder]]:
    """Each op's builder for this process's accelerator, as DeepSpeed's op builders follow the accelerator.

    `ALL_OPS`, except that `fused_adam` is `CPUFusedAdamBuilder` when the accelerator is the CPU
    (`ds_comm.get_accelerator()`, so `DS_ACCELERATOR=cpu` counts). Imports torch.
    """
    from ds_comm import get_accelerator  # noqa: PLC0415 - this package imports no torch at import time

    if get_accelerator().device_name() == "cpu":
        return {**ALL_OPS, CPUFusedAdamBuilder.NAME: CPUFusedAdamBuilder}
    return dict(ALL_OPS)
