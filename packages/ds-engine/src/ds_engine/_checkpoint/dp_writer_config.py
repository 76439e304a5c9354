"""Which ranks write checkpoint files, and each one's share: DeepSpeed's data-parallel writer description.

DeepSpeed's `model_checkpointing.utils` / `data_parallel_writer_factory` describe the process layout
(`UniversalParallelInfo`, from the world, an mpu and the expert groups) and give each rank a
`DataParallelWriterConfig` (writers of a file, this rank's index among them) or None (it writes nothing).
ds decides the same for `data_parallel` unset (data-parallel rank 0 writes; every rank at ZeRO-3; each
rank its own partition at ZeRO-1/2) and REPLICA (every data-parallel rank writes a share). SOCKET and
MACHINE are refused, as the engine config refuses them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ds_comm
from ds_engine._checkpoint import writer_constants as c

__all__ = [
    "SOCKETS_PER_MACHINE",
    "DataParallelWriterConfig",
    "DataParallelWriterFactory",
    "ExpertParallelInfo",
    "MPUInfo",
    "UniversalParallelInfo",
    "create_data_parallel_writer_config",
    "create_universal_parallel_info",
]

SOCKETS_PER_MACHINE = 2
"""DeepSpeed's fixed socket count per machine (its SOCKET unit; refused here)."""

_ZERO_WEIGHTS = 3
_ZERO_OPTIMIZER_STATES = 1


@dataclasses.dataclass
class DataParallelWriterConfig:
    """This rank's part in writing a file: `world_size` writers, this one is `rank` among them."""

    world_size: int
    rank: int
    global_rank: int
    local_rank: int
    pure_dp: bool


@dataclasses.dataclass
class MPUInfo:
    """The model-parallel layout an mpu reports."""

    pp_world_size: int
    pp_rank: int
    tp_world_size: int
    tp_rank: int
    dp_world_size: int
    dp_peer_ranks: list[int]
    dp_rank: int


@dataclasses.dataclass
class ExpertParallelInfo:
    """The layout of the largest expert-parallel group."""

    ep_world_size: int
    ep_rank: int
    dp_world_size: int
    dp_peer_ranks: list[int]
    dp_rank: int


@dataclasses.dataclass
class UniversalParallelInfo:
    """Everything the writer decision reads about the processes."""

    global_world_size: int
    global_rank: int
    local_rank: int
    mpu_info: MPUInfo | None
    ep_info: ExpertParallelInfo | None
    pure_dp: bool
    num_machines: int
    machine_rank: int
    num_sockets: int
    dp_rank: int = 0
    """The data-parallel rank without an mpu (the global rank: pure data parallelism)."""


def _world() -> tuple[int, int]:
    if ds_comm.is_initialized():
        return ds_comm.get_world_size(), ds_comm.get_rank()
    return 1, 0


def _mpu_info(mpu: Any) -> MPUInfo:
    return MPUInfo(
        pp_world_size=mpu.get_pipeline_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        tp_world_size=mpu.get_tensor_model_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        dp_world_size=mpu.get_data_parallel_world_size(),
        dp_peer_ranks=list(mpu.get_data_parallel_group_ranks()),
        dp_rank=mpu.get_data_parallel_rank(),
    )


def _expert_info(groups: Any) -> ExpertParallelInfo:
    name = groups._get_max_expert_size_name()
    return ExpertParallelInfo(
        ep_world_size=groups._get_expert_parallel_world_size(name),
        ep_rank=groups._get_expert_parallel_rank(name),
        dp_world_size=groups._get_expert_data_parallel_world_size(name),
        dp_peer_ranks=list(groups._get_expert_data_parallel_group_ranks(name)),
        dp_rank=groups._get_expert_data_parallel_rank(name),
    )


def create_universal_parallel_info(groups: Any, has_moe_layers: bool) -> UniversalParallelInfo:
    """The layout from the world, `groups.mpu` and (with MoE layers) the expert groups.

    Machines come from the launcher's `CROSS_SIZE` / `CROSS_RANK` (one machine when unset)."""
    world, rank = _world()
    mpu = getattr(groups, "mpu", None)
    machines = int(os.environ.get("CROSS_SIZE", "1"))
    return UniversalParallelInfo(
        global_world_size=world,
        global_rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        mpu_info=None if mpu is None else _mpu_info(mpu),
        ep_info=_expert_info(groups) if has_moe_layers else None,
        pure_dp=mpu is None or mpu.get_data_parallel_world_size() == world,
        num_machines=machines,
        machine_rank=int(os.environ.get("CROSS_RANK", "0")),
        num_sockets=machines * SOCKETS_PER_MACHINE,
        dp_rank=rank,
    )


class DataParallelWriterFactory:
    """Decides this rank's `DataParallelWriterConfig` for one `parallel_unit` (None or REPLICA).

    Raises:
        ValueError: SOCKET or MACHINE (one writer per socket / node), which ds does not implement.
    """

    def __init__(self, uni_parallel_info: UniversalParallelInfo, parallel_unit: str | None) -> None:
        unit = parallel_unit.upper() if isinstance(parallel_unit, str) else parallel_unit
        if unit in (c.CheckpointDataParallel.SOCKET, c.CheckpointDataParallel.MACHINE):
            raise ValueError(f"checkpoint.writer.data_parallel: {unit!r} is not implemented; use 'REPLICA' or null")
        if unit not in (None, c.CheckpointDataParallel.REPLICA):
            raise ValueError(f"checkpoint.writer.data_parallel: {parallel_unit!r} is not one of REPLICA, null")
        self._info = uni_parallel_info
        self._parallel_unit = unit

    def create_config(self, zero_stage: int, has_moe_layers: bool) -> DataParallelWriterConfig | None:
        """This rank's writer config; None when it writes no replicated file."""
        if int(zero_stage) == _ZERO_WEIGHTS:
            return self._config(1, 0)  # every rank holds different model states: each writes its own
        config = self._expert_config() if has_moe_layers else self._dp_config()
        if config is None and int(zero_stage) >= _ZERO_OPTIMIZER_STATES:
            return self._config(1, 0)  # its optimizer partition is its own file
        return config

    def _config(self, world_size: int, rank: int) -> DataParallelWriterConfig:
        info = self._info
        return DataParallelWriterConfig(world_size, rank, info.global_rank, info.local_rank, info.pure_dp)

    def _dp_config(self) -> DataParallelWriterConfig | None:
        info, mpu = self._info, self._info.mpu_info
        if self._parallel_unit is None:
            dp_rank = info.dp_rank if mpu is None else mpu.dp_rank
            return self._config(1, 0) if dp_rank == 0 else None
        if info.pure_dp:
            return self._config(info.global_world_size, info.global_rank)
        assert mpu is not None
        return self._config(mpu.dp_world_size, mpu.dp_rank)

    def _expert_config(self) -> DataParallelWriterConfig | None:
        ep = self._info.ep_info
        if ep is None:
            raise ValueError("create_config(has_moe_layers=True) needs the expert groups' layout (ep_info)")
        if self._parallel_unit is None:
            return self._config(1, 0) if ep.dp_rank == 0 else None
        if not self._info.pure_dp:
            raise ValueError(
                "checkpoint.writer.data_parallel: parallel writes of expert files need pure data parallelism"
            )
        return self._config(ep.dp_world_size, ep.dp_rank)


def create_data_parallel_writer_config(
    groups: Any, parallel_unit: str | None, zero_stage: int, has_moe_layers: bool
) -> DataParallelWriterConfig | None:
    """This rank's `DataParallelWriterConfig` (None: it writes no replicated file)."""
    info = create_universal_parallel_info(groups, has_moe_layers)
    return DataParallelWriterFactory(info, parallel_unit).create_config(zero_stage, has_moe_layers)
