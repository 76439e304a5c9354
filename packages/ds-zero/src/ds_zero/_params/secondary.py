"""hpZ (ZeRO++ hierarchical partitioning): a second, coarser shard of each parameter for backward gathers.

[Note: the secondary partition]
With `zero_hpz_partition_size = h`, the data-parallel ranks are cut into blocks of `h` consecutive
ranks (one node's GPUs, typically), each with its own process group. When a parameter is gathered
from its primary shards (all `N` ranks, inter-node), this rank also keeps `ds_secondary_tensor`: its
1/h slice of the padded flat parameter (`shard_numel * N` elements, the layout the primary gather
fills), zeros past `ds_numel`. Until the end of the iteration, gathers of that parameter (its
backward, a re-fetch) all-gather those slices inside the block instead (intra-node traffic only):
the same padded flat, in the same order, hence the same values bit for bit. At the start and the end
of each iteration (so no optimizer step, checkpoint load or other shard change between iterations can
leave a slice behind) and whenever a shard is written, the secondary slices are marked stale; the next
primary gather refreshes them. The slice buffer stays allocated (1/h of the parameter) so it is not
reallocated every iteration.

Every rank makes the same choice for the same gather (it depends only on the sequence of gathers),
so all ranks of a block meet in the same collectives.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._params.partitioned_param import state_of

__all__ = ["SecondaryPartition", "fill_secondary", "invalidate_secondaries", "secondary_partition", "write_secondary"]


@dataclasses.dataclass(frozen=True, slots=True)
class SecondaryPartition:
    """This rank's hpZ block: the group of `size` consecutive data-parallel ranks and its index in it."""

    group: ProcessGroup | None
    """The block's process group (secondary gathers run on it)."""
    size: int
    """Ranks in a block (`zero_hpz_partition_size`)."""
    rank: int
    """This rank's index in its block (which slice `ds_secondary_tensor` holds)."""


def secondary_partition(dp_group: ProcessGroup | None, size: int) -> SecondaryPartition:
    """Create the hpZ block groups over the ranks of `dp_group` (None: the world); returns this rank's.

    Collective: every rank of `dp_group` calls it (one `new_group` per block, in block order).

    Raises:
        ValueError: `size` is not a positive divisor of the data-parallel world size.
    """
    world = ds_comm.get_world_size(dp_group)
    if size < 1 or world % size:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={size} must divide the data-parallel world size {world} "
            "(the ranks are cut into blocks of that many consecutive ranks)"
        )
    ranks = torch.distributed.get_process_group_ranks(dp_group) if dp_group is not None else list(range(world))
    me = ds_comm.get_rank()
    mine: SecondaryPartition | None = None
    for start in range(0, world, size):
        block = ranks[start : start + size]
        group = ds_comm.new_group(block)
        if me in block:
            mine = SecondaryPartition(group=group, size=size, rank=block.index(me))
    assert mine is not None, f"rank {me} is not in the data-parallel group {ranks}"
    return mine


def write_secondary(
    param: torch.nn.Parameter,
    flat: torch.Tensor,
    *,
    aligned_numel: int,
    group_size: int,
    rank_in_group: int,
    device: torch.device | str,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Set `param.ds_secondary_tensor` to this rank's hpZ slice of `flat` (the parameter's flat values).

    The slice is `aligned_numel // group_size` elements starting at `rank_in_group` times that; the part
    past `param.ds_numel` (padding, or all of it for a small parameter's last ranks) is zero, so nothing
    stale travels in a gather. The buffer is allocated on first use (on `device`, in `flat`'s dtype, never
    requiring grad) and reused after. Returns it.
    """
    size = aligned_numel // group_size
    sec = getattr(param, "ds_secondary_tensor", None)
    if sec is None or sec.numel() != size or sec.dtype != flat.dtype:
        sec = torch.empty(size, dtype=flat.dtype, device=device)
        if pin_memory and sec.device.type == "cpu":
            sec = ds_comm.get_accelerator().pin_memory(sec)
        sec.requires_grad_(False)
        sec.ds_numel = size  # type: ignore[attr-defined]  # DeepSpeed's attribute on the slice
        param.ds_secondary_tensor = sec
    start = size * rank_in_group
    count = max(0, min(param.ds_numel - start, size))
    with torch.no_grad():
        sec.zero_()
        if count:
            sec[:count].copy_(flat.reshape(-1)[start : start + count])
    return sec


def fill_secondary(param: torch.nn.Parameter, part: SecondaryPartition) -> None:
    """After a primary gather: keep this rank's slice of the gathered values and mark it current."""
    st = state_of(param)
    write_secondary(
        param,
        st.full_flat,
        aligned_numel=st.shard_numel * st.world_size,
        group_size=part.size,
        rank_in_group=part.rank,
        device=st.full_flat.device,
    )
    st.secondary_valid = True


def invalidate_secondaries(params: list[torch.nn.Parameter]) -> None:
    """Mark the secondary slices of `params` stale (their next gather goes to the primary shards)."""
    for p in params:
        state_of(p).secondary_valid = False
