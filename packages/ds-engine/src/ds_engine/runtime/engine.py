"""`deepspeed.runtime.engine`: the module path of `DeepSpeedEngine` (type checks in the frameworks use it).

`_checkpoint_parallel_metadata(mpu)` is the `checkpoint_parallel_dimensions` entry DeepSpeed's engine
adds to each model-states file for a given mpu; tests and tools build expected metadata with it.
"""

from __future__ import annotations

from typing import Any

from ds_engine._engine.engine import DeepSpeedEngine
from ds_engine.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE
from ds_engine.utils.bwc import bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_world_size

__all__ = ["DeepSpeedEngine"]


def _checkpoint_parallel_metadata(mpu: Any) -> dict[str, dict[str, int]]:
    """`{checkpoint_parallel_dimensions: {pp_degree, tp_degree}}` of `mpu` (1 and 1 for None)."""
    return {
        CHECKPOINT_PARALLEL_DIMS: {
            CHECKPOINT_PP_DEGREE: bwc_pipeline_parallel_world_size(mpu),
            CHECKPOINT_TP_DEGREE: bwc_tensor_model_parallel_world_size(mpu),
        }
    }
