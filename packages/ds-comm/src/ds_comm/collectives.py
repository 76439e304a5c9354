"""Collective wrappers with torch.distributed semantics, timeouts that name the op, and optional logging.

[Note: timeouts] On gloo (CPU) every collective is issued with `async_op=True` and waited on with
the configured timeout, so a mismatched or abandoned collective raises `CollectiveTimeoutError`
naming the op, the group and the rank instead of hanging. On nccl the wrappers keep torch's
stream-ordered semantics (a CPU-side wait would serialise the GPU) and rely on the process group
timeout and NCCL's watchdog, which also names the op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work

from ds_comm._comms_logger import comms_logger, configure
from ds_comm._dist_init import state
from ds_comm._gloo_pair import (
    PairWork,
    pair_all_gather,
    pair_all_gather_many,
    pair_all_reduce,
    pair_broadcast,
    pair_peer,
    pair_reduce_scatter,
)
from ds_comm._gloo_pair import (
    pair_exchange as _pair_exchange,
)
from ds_comm._group_cache import waits_on_cpu
from ds_comm._shm_p2p import ShmP2PWork, shm_link
from ds_comm._shm_pair import ShmWork
from ds_comm.accelerator import get_accelerator

logger = logging.getLogger(__name__)

# torch 2.13 renamed the flat-tensor collectives to `*_single`; the old names still work but warn on every
# rank at every call site. Call whichever name the installed torch has (the ops keep DeepSpeed's names).
_dist_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_dist_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "get_global_rank",
    "get_rank",
    "get_world_size",
    "inference_all_reduce",
    "irecv",
    "is_initialized",
    "isend",
    "log_summary",
    "new_group",
    "pair_all_gather_into_tensors",
    "pair_exchange",
    "pair_ranks",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
]


class CollectiveError(RuntimeError):
    """A collective failed; the message names the op, the group and this rank."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the timeout (mismatched ops across ranks, a dead rank)."""


def describe_group(group: ProcessGroup | None) -> str:
    """`world group (4 ranks)` or `group of ranks [0, 2]`, for messages."""
    if group is None or group is dist.group.WORLD:
        return f"world group ({dist.get_world_size()} ranks)"
    try:
        return f"group of ranks {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError):
        return "a process group this rank is not part of"


#: Raised by a blocking torch.distributed call that failed: gloo raises plain RuntimeError (timeouts
#: included), the c10d typed errors derive from it, and Python's TimeoutError is an OSError.
_TORCH_ERRORS = (RuntimeError, TimeoutError)


def _timed_out(cause: BaseException, waited_s: float, limit: timedelta | None) -> bool:
    """Whether a failed wait was a timeout: by the exception's type, or by having waited out the limit.

    [Note: what torch raises] torch 2.13 raises a plain `RuntimeError` when a gloo collective times
    out ("Operation timed out!" from `Work.wait(timeout)`, "Timed out waiting 3000ms for recv ..."
    from a blocking op), the same type as for any other gloo failure; only the store's waits have
    a type of their own (`DistStoreError`). So besides `TimeoutError` and `DistStoreError`, a wait
    that failed after the whole timeout had elapsed is a timeout, whatever its message says.
    """
    if isinstance(cause, (TimeoutError, dist.DistStoreError)):
        return True
    limits = [t.total_seconds() for t in (limit, state.timeout) if t is not None]
    return bool(limits) and waited_s >= 0.95 * min(limits)


def _error(
    op: str, group: ProcessGroup | None, cause: BaseException, timeout: timedelta | None, *, timed_out: bool
) -> CollectiveError:
    rank = dist.get_rank() if dist.is_initialized() else -1
    text = str(cause)
    kind = CollectiveTimeoutError if timed_out else CollectiveError
    what = f"did not complete within {timeout}" if timed_out else "failed"
    hint = " (are all ranks issuing the same collectives in the same order, with matching sizes?)" if timed_out else ""
    return kind(f"{op} on {describe_group(group)} {what} on rank {rank}{hint}: {text.splitlines()[0] if text else ''}")


class CollectiveHandle:
    """What an `async_op=True` wrapper returns: `wait()` applies the timeout and the comms logger."""

    __slots__ = ("_work", "_op", "_group", "_size_bytes", "_start", "_done")

    def __init__(
        self,
        work: Work | PairWork | ShmWork | ShmP2PWork,
        op: str,
        group: ProcessGroup | None,
        size_bytes: int,
        start: float,
    ) -> None:
        self._work = work
        self._op = op
        self._group = group
        self._size_bytes = size_bytes
        self._start = start
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        _finish(self._work, self._op, self._group, self._size_bytes, self._start, timeout)
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._work.get_future()


def _finish(
    work: Work | PairWork | ShmWork | ShmP2PWork | None,
    op: str,
    group: ProcessGroup | None,
    size_bytes: int,
    start: float,
    timeout: timedelta | None = None,
) -> None:
    if work is not None:
        limit = timeout or state.timeout
        began = time.monotonic()
        try:
            if waits_on_cpu(group):
                work.wait(timeout=limit)
            else:
                work.wait()
        except _TORCH_ERRORS as err:
            raise _error(op, group, err, limit, timed_out=_timed_out(err, time.monotonic() - began, limit)) from err
    if start:
        get_accelerator().synchronize()
        world = dist.get_world_size(group)
        comms_logger.record(op, size_bytes, time.perf_counter() - start, world)


def _issue(
    op: str,
    call: Callable[[bool], Work | PairWork | ShmWork | ShmP2PWork | None],
    *,
    group: ProcessGroup | None,
    async_op: bool,
    size_bytes: int,
) -> CollectiveHandle | None:
    """Run `call(async_op)` with the timeout policy and logging; `size_bytes` feeds the logger."""
    start = 0.0
    if comms_logger.should_record(op):
        get_accelerator().synchronize()
        start = time.perf_counter()
    cpu_wait = waits_on_cpu(group)
    began = time.monotonic()
    try:
        work = call(True if cpu_wait else async_op)
    except _TORCH_ERRORS as err:
        raise _error(
            op, group, err, state.timeout, timed_out=_timed_out(err, time.monotonic() - began, state.timeout)
        ) from err
    if async_op:
        assert work is not None
        return CollectiveHandle(work, op, group, size_bytes, start)
    _finish(work if cpu_wait else None, op, group, size_bytes, start)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.all_reduce`, in place on `tensor` (two ranks of one host: see ds_comm._shm_pair)."""
    return _issue(
        "all_reduce",
        lambda a: pair_all_reduce(tensor, op, group) or dist.all_reduce(tensor, op=op, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(tensor),
    )


def inference_all_reduce(
    tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, group: ProcessGroup | None = None
) -> torch.Tensor:
    """DeepSpeed's `inference_all_reduce`: a synchronous in-place all-reduce for tensor-parallel inference.

    DeepSpeed sends it to a shared-memory kernel on CPU hosts when one is built, else to torch's
    all_reduce; here it is `all_reduce` (gloo or nccl, logged as `all_reduce`, as DeepSpeed logs it),
    skipped in a group of one. Returns `tensor`, which holds the reduction.
    """
    if get_world_size(group) > 1:
        all_reduce(tensor, op=op, group=group)
    return tensor


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.reduce` to global rank `dst`."""
    return _issue(
        "reduce",
        lambda a: dist.reduce(tensor, dst, op=op, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(tensor),
    )


def broadcast(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveHandle | None:
    """`torch.distributed.broadcast` from global rank `src` (two ranks of one host: see ds_comm._shm_pair)."""
    return _issue(
        "broadcast",
        lambda a: pair_broadcast(tensor, src, group) or dist.broadcast(tensor, src, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(tensor),
    )


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveHandle | None:
    """`torch.distributed.all_gather` into a list of per-rank tensors."""
    return _issue(
        "all_gather",
        lambda a: dist.all_gather(tensor_list, tensor, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=sum(_nbytes(t) for t in tensor_list),
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveHandle | None:
    """`torch.distributed.all_gather_into_tensor`: rank i's input lands in the i-th slice of the output."""
    return _issue(
        "all_gather_into_tensor",
        lambda a: (
            pair_all_gather(output_tensor, input_tensor, group)
            or _dist_all_gather_flat(output_tensor, input_tensor, group=group, async_op=a)
        ),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(output_tensor),
    )


def pair_all_gather_into_tensors(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group: ProcessGroup | None = None
) -> CollectiveHandle | None:
    """On a gloo group of two CPU ranks, `all_gather_into_tensor(outputs[i], inputs[i])` for every i as one
    asynchronous exchange that writes straight into the outputs (no staging buffer, no copy out of one);
    None, with nothing issued, on any other group or tensors (the caller gathers another way).
    Logged as `all_gather_into_tensor`. See ds_comm._gloo_pair."""
    if not waits_on_cpu(group):
        return None
    work = pair_all_gather_many(list(outputs), list(inputs), group)
    if work is None:
        return None
    return _issue(
        "all_gather_into_tensor",
        lambda a: work,
        group=group,
        async_op=True,
        size_bytes=sum(_nbytes(t) for t in outputs),
    )


def pair_ranks(group: ProcessGroup | None = None) -> tuple[int, int] | None:
    """(this rank, the other rank) in `group` when it is a gloo group of two ranks, where
    `pair_exchange` and `pair_all_gather_into_tensors` work; None otherwise."""
    return pair_peer(group)


def pair_exchange(
    sends: Sequence[torch.Tensor],
    recvs: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    op: str = "pair_exchange",
    addends: Sequence[torch.Tensor | None] | None = None,
) -> CollectiveHandle | None:
    """On a gloo group of two CPU ranks, send `sends[i]` to the other rank and receive its `sends[i]` into
    `recvs[i]`, for every i, as one asynchronous operation (a caller's own collective built from halves,
    such as a reduce-scatter without a staging buffer); logged as `op`. The lists may differ in length
    (one may be empty) where the other rank's sends match these receives. `addends[i]` (same shape and
    dtype as `recvs[i]`, or None) makes that receive `addends[i] + the peer's`: a two-rank sum in one pass.
    None, with nothing issued, on any other group or tensors. See ds_comm._gloo_pair (and
    ds_comm._shm_pair: on one host, shared memory)."""
    if not waits_on_cpu(group):
        return None
    work = _pair_exchange(list(sends), list(recvs), group, None if addends is None else list(addends))
    if work is None:
        return None
    size = sum(_nbytes(t) for t in sends) + sum(_nbytes(t) for t in recvs)
    return _issue(op, lambda a: work, group=group, async_op=True, size_bytes=size)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.reduce_scatter`: the sum of everyone's `input_list[rank]` lands in `output`."""
    return _issue(
        "reduce_scatter",
        lambda a: dist.reduce_scatter(output, input_list, op=op, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=sum(_nbytes(t) for t in input_list),
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.reduce_scatter_tensor`: slice `rank` of the reduced input lands in `output`."""
    return _issue(
        "reduce_scatter_tensor",
        lambda a: (
            pair_reduce_scatter(output, input, op, group)
            or _dist_reduce_scatter_flat(output, input, op=op, group=group, async_op=a)
        ),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(input),
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.all_to_all_single`."""
    return _issue(
        "all_to_all_single",
        lambda a: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=_nbytes(input),
    )


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> CollectiveHandle | None:
    """`torch.distributed.barrier`, with the timeout applied on gloo."""
    return _issue(
        "barrier", lambda a: dist.barrier(group=group, async_op=a), group=group, async_op=async_op, size_bytes=0
    )


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> CollectiveHandle:
    """Non-blocking send to global rank `dst`; `wait()` on the handle."""
    handle = _issue(
        "send",
        lambda a: _ring_send(tensor, dst, group, tag) or dist.isend(tensor, dst, group=group, tag=tag),
        group=group,
        async_op=True,
        size_bytes=_nbytes(tensor),
    )
    assert handle is not None
    return handle


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0
) -> CollectiveHandle:
    """Non-blocking receive from global rank `src`; `wait()` on the handle."""
    handle = _issue(
        "recv",
        lambda a: _ring_post(tensor, src, group, tag) or dist.irecv(tensor, src, group=group, tag=tag),
        group=group,
        async_op=True,
        size_bytes=_nbytes(tensor),
    )
    assert handle is not None
    return handle


def _ring_send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None, tag: int) -> ShmP2PWork | None:
    """The send through a shared-memory link with `dst` (see ds_comm._shm_p2p), or None: gloo's."""
    link = shm_link(dst, group, tag, _nbytes(tensor))
    return link.send(tensor) if link is not None else None


def _ring_post(tensor: torch.Tensor, src: int | None, group: ProcessGroup | None, tag: int) -> ShmP2PWork | None:
    link = shm_link(src, group, tag, _nbytes(tensor))
    return link.post(tensor) if link is not None else None


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Blocking send (completes within the timeout or raises naming the op)."""
    isend(tensor, dst, group=group, tag=tag).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Blocking receive (completes within the timeout or raises naming the op)."""
    irecv(tensor, src, group=group, tag=tag).wait()


def broadcast_object_list(object_list: list[Any], src: int = 0, group: ProcessGroup | None = None) -> None:
    """`torch.distributed.broadcast_object_list` (pickled objects; not for hot paths)."""
    began = time.monotonic()
    try:
        dist.broadcast_object_list(object_list, src=src, group=group)
    except _TORCH_ERRORS as err:
        raise _error(
            "broadcast_object_list",
            group,
            err,
            state.timeout,
            timed_out=_timed_out(err, time.monotonic() - began, state.timeout),
        ) from err


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """`torch.distributed.all_gather_object` (pickled objects; not for hot paths)."""
    began = time.monotonic()
    try:
        dist.all_gather_object(object_list, obj, group=group)
    except _TORCH_ERRORS as err:
        raise _error(
            "all_gather_object",
            group,
            err,
            state.timeout,
            timed_out=_timed_out(err, time.monotonic() - began, state.timeout),
        ) from err


def new_group(
    ranks: Sequence[int] | None = None, timeout: timedelta | None = None, backend: str | None = None
) -> ProcessGroup:
    """`torch.distributed.new_group`; every rank of the world must call it with the same `ranks`."""
    group = dist.new_group(
        ranks=list(ranks) if ranks is not None else None, timeout=timeout or state.timeout, backend=backend
    )
    return group


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    """Rank in `group` (default world); 0 when not initialised, so single-process code runs unchanged."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Size of `group` (default world); 1 when not initialised."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The world rank of `group_rank` within `group`."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> str | dict[str, Any]:
    """Log the comms summary table on rank 0 and return it (every rank gets its own figures).

    DeepSpeed's columns: per op and message size, the call count, total latency, and the 10%-trimmed
    mean latency, algorithmic and bus bandwidth over the kept calls (`CommsLogger`'s note).

    Args:
        show_straggler: add the straggler table (each call's latency against the fastest rank's); then
            every rank must call it (a MIN all-reduce per record over the world).
        return_dict: return DeepSpeed's dictionary (`CommsLogger.log_all`) instead of the table text.
    """
    result = comms_logger.log_all(print_log=get_rank() == 0, show_straggler=show_straggler, return_dict=return_dict)
    if result is not None:
        return result
    return comms_logger.summary()
