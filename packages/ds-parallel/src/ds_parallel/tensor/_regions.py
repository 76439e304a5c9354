"""The collectives of a tensor-parallel layer, as autograd functions.

A column-parallel layer reads a replicated input and writes a sharded output: its forward needs no
communication, and its backward sums the partial input gradients of the ranks (`CopyToTPRegion`). A
row-parallel layer reads a sharded input and sums the partial outputs (`ReduceFromTPRegion`); its
backward hands the replicated gradient on unchanged. Together they make one all-reduce per block in
the forward and one in the backward, as Megatron-style tensor parallelism does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm

__all__ = [
    "CopyToTPRegion",
    "GatherFromTPRegion",
    "ReduceFromTPRegion",
    "all_gather_along",
    "copy_to_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
]


class CopyToTPRegion(torch.autograd.Function):
    """Identity forward; the backward all-reduces (sums) the gradient over the group."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        grad = grad.contiguous().clone()
        ds_comm.all_reduce(grad, group=ctx.group)
        return None, grad


class ReduceFromTPRegion(torch.autograd.Function):
    """All-reduce (sum) forward on a copy; identity backward."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        ds_comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class GatherFromTPRegion(torch.autograd.Function):
    """Concatenate every rank's slice along the last dim (forward); the backward keeps this rank's slice.

    For a column-parallel layer whose output must be whole (a gathered output head): the gathered
    output is the same on every rank, so its gradient is too, and each rank's slice of it is the
    gradient of that rank's shard of the output.
    """

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, x: torch.Tensor, sizes: tuple[int, ...], rank: int) -> torch.Tensor:
        ctx.offset, ctx.size = sum(sizes[:rank]), sizes[rank]
        return all_gather_along(x.contiguous(), sizes, x.dim() - 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        return None, grad.narrow(-1, ctx.offset, ctx.size).contiguous(), None, None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None, training: bool) -> torch.Tensor:
    """`CopyToTPRegion` when gradients can flow (training), else `x` as is."""
    if group is None or not training:
        return x
    return CopyToTPRegion.apply(group, x)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None, training: bool) -> torch.Tensor:
    """Sum `x` over the group: differentiably in training, in place in inference (no copy)."""
    if group is None:
        return x
    if training:
        return ReduceFromTPRegion.apply(group, x)
    x = x.contiguous()
    ds_comm.all_reduce(x, group=group)
    return x


def gather_from_tp_region(
    x: torch.Tensor, sizes: tuple[int, ...], rank: int, group: ProcessGroup | None, training: bool
) -> torch.Tensor:
    """Every rank's slice of the last dim put together (rank `r`'s is `sizes[r]` wide); differentiable in training.

    Collective: one all_gather on `group` (none when `group` is None).
    """
    if group is None:
        return x
    if training:
        return GatherFromTPRegion.apply(group, x, sizes, rank)
    return all_gather_along(x.contiguous(), sizes, x.dim() - 1, group)


@torch.no_grad()
def all_gather_along(shard: torch.Tensor, sizes: tuple[int, ...], dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's `shard` along `dim`; rank r's shard is `sizes[r]` long there.

    Shards shorter than the longest are zero-padded so one uniform all-gather serves, then trimmed.
    Collective: one all_gather on `group`.
    """
    widest = max(sizes)
    padded_shape = list(shard.shape)
    padded_shape[dim] = widest
    padded = shard.new_zeros(padded_shape)
    padded.narrow(dim, 0, shard.shape[dim]).copy_(shard)
    parts = [torch.empty_like(padded) for _ in sizes]
    ds_comm.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)
