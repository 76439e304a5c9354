"""DeepSpeed's remaining `deepspeed.comm` entry points, mapped onto ds-comm's one backend.

DeepSpeed keeps a "current backend" object (`cdb`, a `TorchBackend` or `CCLBackend`) behind its functions;
ds has none: every function here works on torch.distributed's groups, which `init_distributed` creates
(the only init path). So `allgather_fn`/`reduce_scatter_fn` are the flat-tensor collectives (torch >= 2.4
always has them, DeepSpeed's list fallback never applies), the MPI/AML/SageMaker env patchers write the
torch env contract as DeepSpeed's do, and the backend classes refuse construction, naming what to use.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ds_comm._config_errors import UsageError
from ds_comm._dist_init import init_distributed
from ds_comm._group_cache import waits_on_cpu
from ds_comm._launch_env import from_mpi
from ds_comm.collectives import (
    CollectiveHandle,
    _dist_all_gather_flat,
    _issue,
    _nbytes,
    all_gather_into_tensor,
    pair_all_gather_into_tensors,
    reduce_scatter_tensor,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CCLBackend",
    "TorchBackend",
    "all_gather_coalesced",
    "allgather_fn",
    "enable_symm_mem_for_group",
    "init_deepspeed_backend",
    "mpi_discovery",
    "patch_aml_env_for_torch_nccl_backend",
    "patch_aws_sm_env_for_torch_nccl_backend",
    "reduce_scatter_fn",
    "set_backend",
]

#: DeepSpeed's fixed values for an Azure ML single-node job (deepspeed/comm/constants.py).
DEFAULT_AML_MASTER_PORT = "54965"
DEFAULT_AML_NCCL_SOCKET_IFNAME = "^docker0,lo"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def _require_initialized(fn: str) -> None:
    if not dist.is_initialized():
        raise UsageError(f"{fn}(): the process group is not initialised; call ds_comm.init_distributed() first")


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    debug: str | None = None,
) -> CollectiveHandle | None:
    """DeepSpeed's `allgather_fn`: `all_gather_into_tensor` (rank i's input fills slice i of the output).

    `debug` (DeepSpeed's caller-name tag) is accepted; the comms logger's `debug` setting names callers.
    """
    _require_initialized("allgather_fn")
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    debug: str | None = None,
) -> CollectiveHandle | None:
    """DeepSpeed's `reduce_scatter_fn`: `reduce_scatter_tensor` (slice `rank` of the reduction lands in
    `output_tensor`). `prof`/`debug` are accepted; the comms logger's `prof_all`/`prof_ops` decide logging."""
    _require_initialized("reduce_scatter_fn")
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_gather_coalesced(
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """`all_gather_into_tensor(output_tensors[i], input_tensors[i])` for every i, issued as one batch.

    On a gloo pair, one exchange writing straight into the outputs (ds_comm._gloo_pair); elsewhere under
    torch's coalescing manager (one NCCL group call), as DeepSpeed does. With `async_op` a handle whose
    `wait()` completes every gather; otherwise None once all are done. Logged as `all_gather_coalesced`
    (or `all_gather_into_tensor` on the pair path).

    Raises:
        ValueError: the two lists differ in length.
        UsageError: no process group yet.
    """
    if len(output_tensors) != len(input_tensors):
        raise ValueError(
            f"all_gather_coalesced: {len(output_tensors)} output tensors for {len(input_tensors)} input tensors"
        )
    _require_initialized("all_gather_coalesced")
    if not input_tensors:
        return None
    handle: CollectiveHandle | _Handles | None = pair_all_gather_into_tensors(output_tensors, input_tensors, group)
    if handle is None:
        if waits_on_cpu(group):
            # gloo: several outstanding gathers on one group complete in order; each applies the timeout.
            handles = [
                all_gather_into_tensor(o, i, group=group, async_op=True)
                for o, i in zip(output_tensors, input_tensors, strict=True)
            ]
            handle = _Handles([h for h in handles if h is not None])
        else:
            handle = _issue(
                "all_gather_coalesced",
                lambda a: _coalesced_gather(output_tensors, input_tensors, group),
                group=group,
                async_op=True,
                size_bytes=sum(_nbytes(t) for t in output_tensors),
            )
    if async_op:
        return handle
    if handle is not None:
        handle.wait()
    return None


def _coalesced_gather(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group: ProcessGroup | None
) -> Any:
    with dist._coalescing_manager(group, inputs[0].device, async_ops=True) as manager:
        for out, inp in zip(outputs, inputs, strict=True):
            _dist_all_gather_flat(out, inp, group=group, async_op=True)
    return manager


class _Handles:
    """Several handles waited on as one (what `all_gather_coalesced(async_op=True)` returns on gloo)."""

    def __init__(self, handles: list[CollectiveHandle]) -> None:
        self._handles = handles

    def wait(self, timeout: timedelta | None = None) -> bool:
        for handle in self._handles:
            handle.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)


def mpi_discovery(distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True) -> None:
    """Ask MPI (mpi4py) for this process's rank, world size, node-local rank and rank 0's address, and
    write RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (= `distributed_port`) to the env.

    Raises:
        ImportError: mpi4py is not installed.
        UsageError: a process group already exists with a different rank or size than MPI reports.
    """
    try:
        importlib.import_module("mpi4py")
    except ImportError as err:
        raise ImportError(
            "mpi_discovery() needs mpi4py (pip install mpi4py, or 'ds-comm[mpi]') to read the MPI layout"
        ) from err
    info = from_mpi(distributed_port)
    os.environ["RANK"] = str(info.rank)
    os.environ["WORLD_SIZE"] = str(info.world_size)
    os.environ["LOCAL_RANK"] = str(info.local_rank)
    os.environ["MASTER_ADDR"] = info.master_addr
    os.environ["MASTER_PORT"] = str(distributed_port)
    if verbose:
        logger.info(
            "Discovered MPI settings of world_rank=%d, local_rank=%d, world_size=%d, master_addr=%s, master_port=%d",
            info.rank,
            info.local_rank,
            info.world_size,
            info.master_addr,
            distributed_port,
        )
    if dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
        raise UsageError(
            f"mpi_discovery(): MPI reports rank {info.rank} of {info.world_size}, but the process group has rank "
            f"{dist.get_rank()} of {dist.get_world_size()}"
        )


def _env(fn: str, name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise KeyError(f"{fn}(): environment variable {name} is not set (is this an OpenMPI launch?)")
    return value


def patch_aml_env_for_torch_nccl_backend(master_port: int = 6105, verbose: bool = True) -> None:
    """Azure ML (OpenMPI) job: write RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
    NCCL_SOCKET_IFNAME from AML's variables, as DeepSpeed does. Several nodes: the master is
    AZ_BATCH_MASTER_NODE's host and MASTER_PORT (if unset) `master_port`; one node: AZ_BATCHAI_MPI_MASTER_NODE
    and port 54965.

    Raises:
        KeyError: naming the first AML/OpenMPI variable that is missing.
    """
    fn = "patch_aml_env_for_torch_nccl_backend"
    os.environ["RANK"] = _env(fn, "OMPI_COMM_WORLD_RANK")
    os.environ["WORLD_SIZE"] = _env(fn, "OMPI_COMM_WORLD_SIZE")
    if int(_env(fn, "OMPI_COMM_WORLD_LOCAL_SIZE")) == int(os.environ["WORLD_SIZE"]):
        os.environ["MASTER_ADDR"] = _env(fn, "AZ_BATCHAI_MPI_MASTER_NODE")
        os.environ["MASTER_PORT"] = DEFAULT_AML_MASTER_PORT
    else:
        os.environ["MASTER_ADDR"] = _env(fn, "AZ_BATCH_MASTER_NODE").split(":")[0]
        os.environ.setdefault("MASTER_PORT", str(master_port))
    if verbose:
        logger.info("NCCL_SOCKET_IFNAME original value = %s", os.environ.get("NCCL_SOCKET_IFNAME"))
    os.environ["NCCL_SOCKET_IFNAME"] = DEFAULT_AML_NCCL_SOCKET_IFNAME
    os.environ["LOCAL_RANK"] = _env(fn, "OMPI_COMM_WORLD_LOCAL_RANK")
    if verbose:
        _log_layout("AzureML")


def patch_aws_sm_env_for_torch_nccl_backend(verbose: bool = True) -> None:
    """AWS SageMaker (OpenMPI) job: write RANK, LOCAL_RANK and WORLD_SIZE from OpenMPI's variables.

    Raises:
        KeyError: naming the first OpenMPI variable that is missing.
    """
    fn = "patch_aws_sm_env_for_torch_nccl_backend"
    os.environ["RANK"] = _env(fn, "OMPI_COMM_WORLD_RANK")
    os.environ["LOCAL_RANK"] = _env(fn, "OMPI_COMM_WORLD_LOCAL_RANK")
    os.environ["WORLD_SIZE"] = _env(fn, "OMPI_COMM_WORLD_SIZE")
    if verbose:
        _log_layout("AWS SageMaker")


def _log_layout(where: str) -> None:
    env = os.environ
    logger.info(
        "Discovered %s settings of world_rank=%s, local_rank=%s, world_size=%s, master_addr=%s, master_port=%s",
        where,
        env.get("RANK"),
        env.get("LOCAL_RANK"),
        env.get("WORLD_SIZE"),
        env.get("MASTER_ADDR"),
        env.get("MASTER_PORT"),
    )


def init_deepspeed_backend(ds_backend: str, timeout: timedelta | None, init_method: str | None) -> None:
    """DeepSpeed's hook for its native backends. Only "ccl" has one there (oneCCL kernels); ds has no native
    kernels, so "ccl" becomes torch.distributed's ccl backend through `init_distributed` (needs
    oneccl_bindings_for_pytorch). Every other name does nothing, as in DeepSpeed, whose nccl/mpi/gloo/hccl
    native backends are not implemented: `init_distributed` then creates the torch group."""
    if ds_backend == "ccl":
        init_distributed(dist_backend="ccl", timeout=timeout, init_method=init_method)
        return
    logger.debug("init_deepspeed_backend: no native %r backend; init_distributed creates the torch group", ds_backend)


def set_backend() -> None:
    """DeepSpeed picks which of its initialised native backends its functions use. ds's functions always use
    torch.distributed's groups (made by `init_distributed`), so there is nothing to pick: this changes nothing."""
    logger.debug("set_backend: ds-comm always uses torch.distributed's default group")


def enable_symm_mem_for_group(group_name: str) -> None:
    """Enable torch's symmetric memory on the group named `group_name` (`group.group_name`).

    Raises:
        UsageError: no process group yet.
    """
    _require_initialized("enable_symm_mem_for_group")
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group as enable

    enable(cast(Any, group_name))  # torch types it as its GroupName alias of str


class TorchBackend:
    """DeepSpeed's wrapper object around torch.distributed. ds has no backend object: call
    `ds_comm.init_distributed(dist_backend=...)` and the module-level functions of `deepspeed.comm`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "TorchBackend: ds has no backend object; call ds_comm.init_distributed(dist_backend=...) "
            "(deepspeed.init_distributed) and use deepspeed.comm's functions"
        )


class CCLBackend(TorchBackend):
    """DeepSpeed's oneCCL-kernel backend. ds builds no CCL kernels: call
    `ds_comm.init_distributed(dist_backend="ccl")` (torch's ccl backend, oneccl_bindings_for_pytorch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "CCLBackend: ds builds no oneCCL kernels; call ds_comm.init_distributed(dist_backend='ccl') "
            "(torch's ccl backend via oneccl_bindings_for_pytorch) and use deepspeed.comm's functions"
        )
