"""ds-comm: the floor every ds package stands on.

Accelerator abstraction, distributed initialisation (env, MPI, SLURM), collectives with named
timeouts and an optional comms logger, the `ConfigModel` base, the crash-safe file writer every
checkpoint uses (`atomic_save`), and (in `ds_comm.testing`) the multi-process test harness.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_comm.__about__ import __version__
from ds_comm._atomic_file import atomic_save, atomic_write, atomic_write_text, fsync_dir
from ds_comm._comms_log_api import get_comm_operation_count, get_logged_comm_ops, has_comm_data, reset_log
from ds_comm._comms_logger import DEFAULT_MAX_SAMPLES, CommsLogger, comms_logger, configure
from ds_comm._compat_backend import (
    CCLBackend,
    TorchBackend,
    all_gather_coalesced,
    allgather_fn,
    enable_symm_mem_for_group,
    init_deepspeed_backend,
    mpi_discovery,
    patch_aml_env_for_torch_nccl_backend,
    patch_aws_sm_env_for_torch_nccl_backend,
    reduce_scatter_fn,
    set_backend,
)
from ds_comm._compat_helpers import (
    ProcessGroup,
    get_debug_log_name,
    get_default_args,
    get_local_rank_from_launcher,
    get_msg_size_from_args,
    get_tensor_kwarg,
    get_tensor_position,
    get_world_rank_from_launcher,
    get_world_size_from_launcher,
    in_aml,
    in_aws_sm,
    in_dlts,
    timed_op,
)
from ds_comm._config_errors import AUTO, Auto, ConfigDeprecationWarning, ConfigError, UsageError
from ds_comm._device_mesh import initialize_mesh_device
from ds_comm._dist_init import destroy_process_group, get_local_rank, init_distributed
from ds_comm._group_helpers import (
    all_reduce_coalesced,
    all_to_all,
    get_all_ranks_from_group,
    get_world_group,
    has_all_gather_into_tensor,
    has_all_reduce_coalesced,
    has_coalescing_manager,
    has_reduce_scatter_tensor,
    is_available,
)
from ds_comm._locked_host_allocator import LockedHostAllocator, locked_host_allocator
from ds_comm._pinned_memory import (
    PinnedMemoryTracker,
    pinned_memory_summary,
    pinned_memory_tracker,
    track_pinned_memory,
)
from ds_comm._rooted_and_batched import P2POp, batch_isend_irecv, gather, monitored_barrier, scatter
from ds_comm._shm_p2p import open_shm_p2p, shm_p2p_carries
from ds_comm._shm_shared import PairSharedTensor, pair_shared_tensor
from ds_comm._trim_mean import trim_mean
from ds_comm.accelerator import Accelerator, get_accelerator, is_current_accelerator_supported, set_accelerator
from ds_comm.checkpoint_files import CheckpointFileError, check_deepspeed_version, load_checkpoint_file
from ds_comm.collectives import (
    CollectiveError,
    CollectiveHandle,
    CollectiveTimeoutError,
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    get_global_rank,
    get_rank,
    get_world_size,
    inference_all_reduce,
    irecv,
    is_initialized,
    isend,
    log_summary,
    new_group,
    pair_all_gather_into_tensors,
    pair_exchange,
    pair_ranks,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    send,
)
from ds_comm.logging import get_logger, log_dist
from ds_comm.native_pinned_memory import (
    NativePinnedMemory,
    get_active_native_pinned_memory,
    set_pin_handle_loader,
)

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from ds_comm.config import (
        CommsLoggerConfig,
        ConfigModel,
        find_auto,
        find_ignored,
        validate_section,
        warn_ignored,
    )

#: Names served from `ds_comm.config` on first access: it imports pydantic (~0.3 s), which only
#: code that reads a config needs. `from ds_comm import ConfigModel` works as usual.
_CONFIG_NAMES = frozenset(
    {"CommsLoggerConfig", "ConfigModel", "find_auto", "find_ignored", "validate_section", "warn_ignored"}
)


def __getattr__(name: str) -> object:
    if name in _CONFIG_NAMES:
        return getattr(importlib.import_module("ds_comm.config"), name)
    raise AttributeError(f"module 'ds_comm' has no attribute {name!r}")


__all__ = [
    "AUTO",
    "Accelerator",
    "Auto",
    "CCLBackend",
    "CheckpointFileError",
    "CollectiveError",
    "CollectiveHandle",
    "CollectiveTimeoutError",
    "CommsLogger",
    "CommsLoggerConfig",
    "ConfigDeprecationWarning",
    "ConfigError",
    "ConfigModel",
    "DEFAULT_MAX_SAMPLES",
    "LockedHostAllocator",
    "NativePinnedMemory",
    "P2POp",
    "PairSharedTensor",
    "PinnedMemoryTracker",
    "ProcessGroup",
    "ReduceOp",
    "TorchBackend",
    "UsageError",
    "__version__",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "atomic_save",
    "atomic_write",
    "atomic_write_text",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "check_deepspeed_version",
    "comms_logger",
    "configure",
    "destroy_process_group",
    "enable_symm_mem_for_group",
    "find_auto",
    "find_ignored",
    "fsync_dir",
    "gather",
    "get_accelerator",
    "get_active_native_pinned_memory",
    "get_all_ranks_from_group",
    "get_comm_operation_count",
    "get_debug_log_name",
    "get_default_args",
    "get_global_rank",
    "get_local_rank",
    "get_local_rank_from_launcher",
    "get_logged_comm_ops",
    "get_logger",
    "get_msg_size_from_args",
    "get_rank",
    "get_tensor_kwarg",
    "get_tensor_position",
    "get_world_group",
    "get_world_rank_from_launcher",
    "get_world_size",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
    "inference_all_reduce",
    "init_deepspeed_backend",
    "init_distributed",
    "initialize_mesh_device",
    "irecv",
    "is_available",
    "is_current_accelerator_supported",
    "is_initialized",
    "isend",
    "load_checkpoint_file",
    "locked_host_allocator",
    "log_dist",
    "log_summary",
    "monitored_barrier",
    "mpi_discovery",
    "new_group",
    "open_shm_p2p",
    "pair_all_gather_into_tensors",
    "pair_exchange",
    "pair_ranks",
    "pair_shared_tensor",
    "patch_aml_env_for_torch_nccl_backend",
    "patch_aws_sm_env_for_torch_nccl_backend",
    "pinned_memory_summary",
    "pinned_memory_tracker",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reset_log",
    "scatter",
    "send",
    "set_accelerator",
    "set_backend",
    "set_pin_handle_loader",
    "shm_p2p_carries",
    "timed_op",
    "track_pinned_memory",
    "trim_mean",
    "validate_section",
    "warn_ignored",
]
