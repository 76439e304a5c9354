"""Sequence parallelism at initialize(): the mpu from ds-parallel's mesh, and its agreement with the config."""

from __future__ import annotations

from typing import Any

from ds_engine._dist_info import DistInfo
from ds_engine._optional import require

__all__ = ["check_sequence_parallel", "sequence_parallel_mpu"]


def sequence_parallel_mpu(sequence_parallel_size: int) -> Any:
    """Build ds-parallel's process mesh with `sp=sequence_parallel_size` and return its mpu.

    Raises:
        ImportError: ds-parallel is not installed (names `pip install 'ds-engine[parallel]'`).
        ValueError: the world size is not a multiple of the degree (from `ParallelDims`).
    """
    ds_parallel = require("ds_parallel", extra="parallel", feature=f"sequence_parallel_size={sequence_parallel_size}")
    mesh = ds_parallel.groups.initialize_mesh(sp=sequence_parallel_size)
    return ds_parallel.MeshMPU(mesh)


def check_sequence_parallel(config_size: int, dist: DistInfo, *, pipeline: bool) -> None:
    """The config's `sequence_parallel_size` must be the mpu's degree; pipelines do not take it.

    Raises:
        ValueError: the two disagree, or a PipelineModule is given with sequence parallelism.
    """
    if pipeline and config_size > 1:
        raise ValueError(f"sequence_parallel_size={config_size} is not supported with a PipelineModule")
    if config_size != dist.sp_world_size:
        raise ValueError(
            f"sequence_parallel_size={config_size} in the config but the mpu's sequence-parallel world "
            f'size is {dist.sp_world_size}; set "sequence_parallel_size": {dist.sp_world_size}'
        )
