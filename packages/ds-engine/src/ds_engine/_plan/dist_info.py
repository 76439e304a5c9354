"""Who this process is in the job: global rank, data-parallel group and rank, model-parallel rank."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed import ProcessGroup

import ds_comm

__all__ = ["DistInfo", "discover_dist"]


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """The process layout the engine uses; read once at initialize()."""

    global_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_group: ProcessGroup | None = None
    dp_world_size: int = 1
    dp_rank: int = 0
    dp_src_rank: int = 0
    """Global rank of data-parallel rank 0 (the broadcast source)."""
    mp_rank: int = 0
    mp_world_size: int = 1
    sp_world_size: int = 1
    """Sequence-parallel degree. With it > 1 the `dp_*` fields describe data x sequence ranks (gradients are
    reduced and ZeRO partitions over them), while batches count per model replica (`replica_world_size`)."""

    @property
    def replica_world_size(self) -> int:
        """Data-parallel replicas: the factor of the batch triple (`dp_world_size / sp_world_size`)."""
        return self.dp_world_size // self.sp_world_size


def discover_dist(mpu: Any = None) -> DistInfo:
    """The layout from torch.distributed (a world of one when it is not initialised) and an optional mpu.

    An mpu is DeepSpeed's model-parallel unit: an object with `get_data_parallel_group()`,
    `get_data_parallel_world_size()`, `get_data_parallel_rank()`, `get_model_parallel_rank()` and
    `get_model_parallel_world_size()`. An mpu whose `get_sequence_parallel_world_size()` is above 1
    (ds-parallel's `MeshMPU`, ALST's) also gives `get_sequence_data_parallel_group()`: data-parallel
    work (gradient reduction, ZeRO partitions, the parameter broadcast) then spans data x sequence ranks.
    """
    if not ds_comm.is_initialized():
        return DistInfo(local_rank=ds_comm.get_local_rank())
    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    local = ds_comm.get_local_rank()
    if mpu is None:
        return DistInfo(rank, world, local, None, world, rank, 0, 0, 1)
    sp = int(mpu.get_sequence_parallel_world_size()) if hasattr(mpu, "get_sequence_parallel_world_size") else 1
    if sp > 1:
        group = mpu.get_sequence_data_parallel_group()
        size, dp_rank = int(mpu.get_sequence_data_parallel_world_size()), int(mpu.get_sequence_data_parallel_rank())
    else:
        group = mpu.get_data_parallel_group()
        size, dp_rank = int(mpu.get_data_parallel_world_size()), int(mpu.get_data_parallel_rank())
    return DistInfo(
        rank,
        world,
        local,
        group,
        size,
        dp_rank,
        ds_comm.get_global_rank(group, 0),
        int(mpu.get_model_parallel_rank()),
        int(mpu.get_model_parallel_world_size()),
        sp,
    )
