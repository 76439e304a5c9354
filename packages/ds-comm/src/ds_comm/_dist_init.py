"""`init_distributed`: one idempotent entry point that finds the job layout and creates the default group."""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta

import torch.distributed as dist

from ds_comm._comms_logger import configure
from ds_comm._config_errors import UsageError
from ds_comm._exit_teardown import register_exit_teardown
from ds_comm._group_cache import forget
from ds_comm._launch_env import LaunchInfo, discover
from ds_comm.accelerator import get_accelerator

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_MIN = 30


@dataclasses.dataclass
class _State:
    launch: LaunchInfo | None = None
    timeout: timedelta = timedelta(minutes=_DEFAULT_TIMEOUT_MIN)


state = _State()


def default_timeout() -> timedelta:
    """`DEEPSPEED_TIMEOUT` (minutes) when set, else 30 minutes (torch's default for gloo/nccl)."""
    minutes = os.environ.get("DEEPSPEED_TIMEOUT")
    if minutes:
        try:
            return timedelta(minutes=float(minutes))
        except ValueError:
            raise ValueError(f"DEEPSPEED_TIMEOUT={minutes!r} must be a number of minutes") from None
    return timedelta(minutes=_DEFAULT_TIMEOUT_MIN)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group, once, from whatever launched this process.

    Discovery order: `rank`/`world_size` arguments; RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
    (torchrun, the `deepspeed` launcher); an MPI launch via mpi4py (OpenMPI, MPICH, Intel MPI env
    markers) when `auto_mpi_discovery`; SLURM_* from `srun`; otherwise a world of one on localhost.
    The found layout is exported back to the env so child code sees the torch contract.

    Args:
        dist_backend: "gloo", "nccl", ...; default: the accelerator's (nccl on cuda, gloo on cpu).
        auto_mpi_discovery: ask mpi4py for the layout when mpirun started us without torch env vars.
        distributed_port: MASTER_PORT when a launched job's environment has none. A world of one (no
            launcher) without MASTER_PORT listens on a free port instead, as only it joins the store.
        verbose: log the layout found on rank 0.
        timeout: how long a collective may take before it fails; default `DEEPSPEED_TIMEOUT`
            minutes or 30 minutes. The collective wrappers use it too.
        init_method: a torch init method URL; default `env://`.
        dist_init_required: False skips initialisation entirely (an error in a launched job of several
            ranks, WORLD_SIZE > 1, with no group yet); True or None initialises when needed.
        config: accepted for DeepSpeed compatibility (its `comms_logger` section); see `configure`.
        rank: explicit rank (with `world_size`), overriding discovery.
        world_size: explicit world size.

    Idempotent: when the default group exists nothing changes (the timeout is still recorded).
    Either way the groups are destroyed at interpreter exit, also after an uncaught exception (see
    `ds_comm._exit_teardown`: gloo can otherwise abort the process with SIGABRT); an explicit
    `destroy_process_group` first is fine.
    """
    state.timeout = timeout if timeout is not None else default_timeout()
    if config is not None:
        configure(config)
    if dist_init_required is False:
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > 1 and not dist.is_initialized():
            # DeepSpeed asserts here; running on would have each of the launched ranks train alone.
            raise UsageError(
                f"dist_init_required=False, but no process group exists and WORLD_SIZE={launched}: each rank would "
                "run as a world of one; create the group first (torch.distributed.init_process_group or "
                "deepspeed.init_distributed()), or pass dist_init_required=True (or leave it None)"
            )
        return
    if dist.is_initialized():
        register_exit_teardown()
        return
    info = discover(auto_mpi_discovery=auto_mpi_discovery, default_port=distributed_port)
    if rank >= 0 or world_size > 0:
        if rank < 0 or world_size <= 0:
            raise ValueError(f"pass both rank and world_size, got rank={rank}, world_size={world_size}")
        if rank >= world_size:
            raise ValueError(f"rank={rank} must be smaller than world_size={world_size}")
        info = dataclasses.replace(info, rank=rank, world_size=world_size, source="args")
    info.export()
    state.launch = info
    backend = dist_backend or get_accelerator().communication_backend_name()
    if verbose and info.rank == 0:
        logger.info(
            "initializing %s: world_size=%d from %s, master %s:%d",
            backend,
            info.world_size,
            info.source,
            info.master_addr,
            info.master_port,
        )
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=info.rank,
        world_size=info.world_size,
        timeout=state.timeout,
    )
    register_exit_teardown()


def get_local_rank() -> int:
    """This process's rank on its node (LOCAL_RANK), 0 before initialisation."""
    if state.launch is not None:
        return state.launch.local_rank
    return int(os.environ.get("LOCAL_RANK", 0))


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Tear down `group` (default: everything) and forget the recorded layout."""
    if dist.is_initialized():
        dist.destroy_process_group(group)
    forget(group)
    if group is None:
        state.launch = None
