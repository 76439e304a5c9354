"""The rest of `deepspeed.comm`'s everyday surface: the world group, a group's ranks, list all-to-all,
coalesced all-reduce and the feature queries DeepSpeed's code branches on.

The feature queries (`has_all_gather_into_tensor`, ...) answer for the torch ds supports (>= 2.4), where
every one of these collectives exists; code written against DeepSpeed keeps its fast branch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_comm._config_errors import UsageError
from ds_comm.collectives import CollectiveHandle, _issue, _nbytes, get_world_size, is_initialized

__all__ = [
    "all_reduce_coalesced",
    "all_to_all",
    "get_all_ranks_from_group",
    "get_world_group",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "is_available",
]


def is_available() -> bool:
    """Whether torch was built with distributed support (DeepSpeed's `deepspeed.comm.is_available`)."""
    return dist.is_available()


def get_world_group() -> ProcessGroup:
    """The default (world) process group.

    Raises:
        UsageError: the process group is not initialised yet (call `init_distributed()` first).
    """
    if not is_initialized():
        raise UsageError("get_world_group(): the process group is not initialised; call init_distributed() first")
    world = dist.group.WORLD
    assert isinstance(world, ProcessGroup)
    return world


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order (the world's when `group` is None)."""
    if group is None or group is dist.group.WORLD:
        return list(range(get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """`torch.distributed.all_to_all`: `input_tensor_list[j]` goes to rank j, rank j's lands in `output[j]`.

    Raises:
        ValueError: either list's length differs from the group's size.
    """
    world = get_world_size(group)
    for name, tensors in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if len(tensors) != world:
            raise ValueError(f"all_to_all: {name} has {len(tensors)} tensors; the group has {world} ranks")
    return _issue(
        "all_to_all",
        lambda a: dist.all_to_all(output_tensor_list, list(input_tensor_list), group=group, async_op=a),
        group=group,
        async_op=async_op,
        size_bytes=sum(_nbytes(t) for t in input_tensor_list),
    )


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """All-reduce every tensor of `tensors` in place with one collective per dtype.

    The tensors of each dtype are packed into one flat buffer, reduced, and copied back, so N small
    tensors cost one message each dtype rather than N. The results must be copied back before the call
    returns, so with `async_op=True` the handle returned is already complete (DeepSpeed's signature kept).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    handles: list[CollectiveHandle] = []
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        handle = _issue(
            "all_reduce_coalesced",
            lambda a, flat=flat: dist.all_reduce(flat, op=op, group=group, async_op=a),
            group=group,
            async_op=async_op,
            size_bytes=_nbytes(flat),
        )
        if handle is not None:
            handle.wait()
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        if handle is not None:
            handles.append(handle)
    return handles[-1] if handles else None


def has_all_gather_into_tensor() -> bool:
    """True: torch >= 2.4 has `all_gather_into_tensor` on every backend ds runs on."""
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    """True: torch >= 2.4 has `reduce_scatter_tensor`."""
    return hasattr(dist, "reduce_scatter_tensor")


def has_all_reduce_coalesced() -> bool:
    """True: `all_reduce_coalesced` above packs the tensors itself, on any backend."""
    return True


def has_coalescing_manager() -> bool:
    """Whether torch has `_coalescing_manager` (DeepSpeed's check, for code that branches on it)."""
    return hasattr(dist, "_coalescing_manager")
