"""Sequence parallelism at initialize(): the config's degree must agree with the layout (`_parallel.dims`)."""

from __future__ import annotations

from ds_engine._plan.dist_info import DistInfo

__all__ = ["check_data_parallel_size", "check_sequence_parallel"]


def check_sequence_parallel(config_size: int, dist: DistInfo, *, pipeline: bool, given: bool = True) -> int:
    """The sequence-parallel degree the engine runs with: the mpu's.

    DeepSpeed takes the degree from the client's mpu (`get_sequence_parallel_world_size`) and ignores the
    config key, so a config that leaves `sequence_parallel_size` unset (`given=False`) adopts the mpu's degree.
    A key that is set must agree with it: a mismatch is a silent mistake DeepSpeed would let through.
    Pipelines do not take sequence parallelism.

    Raises:
        ValueError: a set key disagrees with the mpu, or a PipelineModule is given with sequence parallelism.
    """
    if pipeline and config_size > 1:
        raise ValueError(f"sequence_parallel_size={config_size} is not supported with a PipelineModule")
    if not given and not pipeline:
        return dist.sp_world_size
    if config_size != dist.sp_world_size:
        raise ValueError(
            f"sequence_parallel_size={config_size} in the config but the mpu's sequence-parallel world "
            f'size is {dist.sp_world_size}; set "sequence_parallel_size": {dist.sp_world_size}'
        )
    return config_size


def check_data_parallel_size(config_size: int | None, *, with_sequence_parallel: bool, dist: DistInfo) -> None:
    """`data_parallel_size`, given with `sequence_parallel_size`, must be the data-parallel degree.

    DeepSpeed reads `data_parallel_size` only beside `sequence_parallel_size`, to build its (data, sequence)
    mesh; ds builds that mesh from `sequence_parallel_size` alone, so the given degree must be the one the
    world leaves (DeepSpeed's mesh would not fit the world otherwise). Without `sequence_parallel_size`
    the key has no effect, in DeepSpeed as here (`DeepSpeedConfig` warns).

    Raises:
        ValueError: it disagrees with the data-parallel degree (both values and the world named).
    """
    if config_size is None or not with_sequence_parallel or config_size == dist.replica_world_size:
        return
    raise ValueError(
        f"data_parallel_size={config_size} with sequence_parallel_size={dist.sp_world_size}, but the data-parallel "
        f"degree is {dist.replica_world_size} ({dist.dp_world_size} data x sequence ranks / "
        f'{dist.sp_world_size}); set "data_parallel_size": {dist.replica_world_size} or remove it'
    )
