"""DeepSpeed's `deepspeed.runtime.sequence_parallel.parallel_state_sp`: the ALST mpu as module functions.

Some integrations pass this module itself as the mpu; every function here is a view of the installed
`ParallelMesh` (`initialize_sequence_parallel` builds it with `sp=N`). As in DeepSpeed, `get_model_parallel_*`
answer with the sequence-parallel group (code written for Megatron's mpu then treats the SP group as its model
group); the engine, like DeepSpeed's, counts no model parallelism for this module and reads the mesh instead.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from ds_parallel import groups

__all__ = [
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Install the mesh with `sp=sequence_parallel_size` (the rest of the world is data parallel)."""
    groups.initialize_mesh(sp=sequence_parallel_size)


def get_sequence_parallel_group() -> ProcessGroup:
    return groups._get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return groups._get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return groups._get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> ProcessGroup:
    return groups._get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return groups._get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return groups._get_sequence_data_parallel_rank()


def get_data_parallel_group() -> ProcessGroup:
    return groups._get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    return groups._get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return groups._get_data_parallel_rank()


def get_model_parallel_rank() -> int:
    """This rank in the sequence-parallel group (DeepSpeed's alias)."""
    return groups._get_sequence_parallel_rank()


def get_model_parallel_world_size() -> int:
    """The sequence-parallel degree (DeepSpeed's alias)."""
    return groups._get_sequence_parallel_world_size()


def get_model_parallel_group() -> ProcessGroup:
    """The sequence-parallel group (DeepSpeed's alias)."""
    return groups._get_sequence_parallel_group()
