"""`deepspeed.utils.bwc`: an mpu's tensor- and pipeline-parallel degrees, whichever API generation it has.

Model-parallel units name these differently: Megatron and DeepSpeed's `PipelineParallelGrid` now have
`get_tensor_model_parallel_world_size()` / `get_pipeline_model_parallel_world_size()`; older grids
`get_slice_parallel_world_size()` / `get_pipe_parallel_world_size()`; the oldest Megatron only
`get_model_parallel_world_size()` (its tensor-parallel degree, with no pipeline). These helpers try
them in that order, so checkpoint metadata records the same degrees whichever mpu a script passes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["bwc_pipeline_parallel_world_size", "bwc_tensor_model_parallel_world_size"]


def bwc_tensor_model_parallel_world_size(mpu: Any = None) -> int:
    """The tensor-parallel degree of `mpu` (1 without one)."""
    if mpu is None:
        return 1
    for getter in ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size"):
        if hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    return int(mpu.get_model_parallel_world_size())


def bwc_pipeline_parallel_world_size(mpu: Any = None) -> int:
    """The pipeline-parallel degree of `mpu` (1 without one, or when it has no pipeline API)."""
    if mpu is None:
        return 1
    for getter in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"):
        if hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    return 1
