"""gather, scatter, batched point-to-point and the monitored barrier, under DeepSpeed's `deepspeed.comm` names.

They follow `torch.distributed` semantics (ranks are global ranks, lists live only on the root) and go
through the same timeout and comms-logger path as the other wrappers in `ds_comm.collectives`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_comm._comms_logger import comms_logger
from ds_comm._dist_init import state
from ds_comm._shm_p2p import shm_link
from ds_comm.accelerator import get_accelerator
from ds_comm.collectives import CollectiveHandle, _error, _issue, _nbytes, _timed_out, irecv, isend

__all__ = ["P2POp", "batch_isend_irecv", "gather", "monitored_barrier", "scatter"]


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.gather`: every rank's `tensor` lands in `gather_list[rank]` on global rank `dst`.

    Args:
        tensor: this rank's contribution (same shape and dtype on every rank).
        gather_list: on `dst` only, one tensor per rank of `group` to receive into; None elsewhere.
        dst: the global rank that receives.
        group: process group (default world).
        async_op: return a handle to `wait()` on instead of blocking.

    Raises:
        ValueError: `gather_list` is missing on the destination or has the wrong length.
    """
    _check_root_list("gather", "gather_list", gather_list, dst, group)
    return _issue(
        "gather",
        lambda a: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(tensor),
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.scatter`: `scatter_list[rank]` on global rank `src` lands in each rank's `tensor`.

    Args:
        tensor: the buffer this rank receives into.
        scatter_list: on `src` only, one tensor per rank of `group`; None elsewhere.
        src: the global rank that sends.
        group: process group (default world).
        async_op: return a handle to `wait()` on instead of blocking.

    Raises:
        ValueError: `scatter_list` is missing on the source or has the wrong length.
    """
    _check_root_list("scatter", "scatter_list", scatter_list, src, group)
    return _issue(
        "scatter",
        lambda a: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(tensor),
    )


def _check_root_list(
    op: str, arg: str, tensors: list[torch.Tensor] | None, root: int, group: ProcessGroup | None
) -> None:
    if dist.get_rank() != root:
        return
    world = dist.get_world_size(group)
    if tensors is None or len(tensors) != world:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise ValueError(f"{op}: {arg} on the root rank {root} needs one tensor per rank ({world}), got {got}")


@dataclasses.dataclass(frozen=True)
class P2POp:
    """One send or receive of a `batch_isend_irecv` batch (`torch.distributed.P2POp`'s fields).

    Attributes:
        op: `isend` or `irecv`, from ds_comm (or deepspeed.comm) or from torch.distributed.
        tensor: the tensor to send, or the buffer to receive into.
        peer: the other side's global rank.
        group: process group (default world).
        tag: message tag, matched between the two sides.
    """

    op: Callable[..., Any]
    tensor: torch.Tensor
    peer: int
    group: ProcessGroup | None = None
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv, dist.isend, dist.irecv):
            raise ValueError(f"P2POp.op must be isend or irecv (ds_comm's or torch.distributed's), got {self.op!r}")

    @property
    def is_send(self) -> bool:
        return self.op in (isend, dist.isend)


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[CollectiveHandle]:
    """Issue every send and receive of the list together and return one handle per op, in order.

    Batching lets a ring exchange (send right, receive left) start on every rank at once without the
    deadlock that blocking sends in a fixed order would risk.

    Raises:
        ValueError: the list is empty or holds something other than `P2POp`.
        CollectiveError: the batch could not be issued (the message names this rank).
    """
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv needs at least one P2POp, got an empty list")
    for item in p2p_op_list:
        if not isinstance(item, P2POp):
            raise ValueError(f"batch_isend_irecv takes a list of P2POp, got {type(item).__name__}")
    start = 0.0
    if comms_logger.should_record("send") or comms_logger.should_record("recv"):
        get_accelerator().synchronize()
        start = time.perf_counter()
    # A message a shared-memory link carries (ds_comm._shm_p2p) must take it here too, or a peer that
    # receives it with irecv would wait on the ring for what went to gloo: those ops go one by one.
    linked = [shm_link(p.peer, p.group, p.tag, _nbytes(p.tensor)) is not None for p in p2p_op_list]
    batched = [p for p, ring in zip(p2p_op_list, linked, strict=True) if not ring]
    handles: list[CollectiveHandle] = []
    works: list[Any] = []
    if batched:
        torch_ops = [
            dist.P2POp(dist.isend if p.is_send else dist.irecv, p.tensor, p.peer, group=p.group, tag=p.tag)
            for p in batched
        ]
        try:
            works = dist.batch_isend_irecv(torch_ops)
        except RuntimeError as err:
            raise _error("batch_isend_irecv", batched[0].group, err, state.timeout, timed_out=False) from err
        # torch returns one work per op on gloo and a single coalesced work on nccl; keep one handle per op.
        if len(works) != len(batched):
            works = [works[-1]] * len(batched)
    remaining = iter(works)
    for p, ring in zip(p2p_op_list, linked, strict=True):
        if ring:
            handles.append((isend if p.is_send else irecv)(p.tensor, p.peer, group=p.group, tag=p.tag))
        else:
            kind = "send" if p.is_send else "recv"
            handles.append(CollectiveHandle(next(remaining), kind, p.group, _nbytes(p.tensor), start))
    return handles


def monitored_barrier(
    group: ProcessGroup | None = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that did not arrive (gloo only, as in torch).

    Args:
        group: process group (default world).
        timeout: how long rank 0 waits for the others (default: the process-group timeout).
        wait_all_ranks: report every missing rank rather than the first.

    Raises:
        CollectiveTimeoutError: some rank did not reach the barrier in time; torch's message lists them.
        CollectiveError: the backend has no monitored barrier (nccl).
    """
    limit = timeout or state.timeout
    began = time.monotonic()
    try:
        dist.monitored_barrier(group=group, timeout=limit, wait_all_ranks=wait_all_ranks)
    except RuntimeError as err:
        timed_out = _timed_out(err, time.monotonic() - began, limit)
        raise _error("monitored_barrier", group, err, limit, timed_out=timed_out) from err
