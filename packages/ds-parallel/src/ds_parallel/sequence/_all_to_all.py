"""`seq_all_to_all`: the Ulysses all-to-all as an autograd function (its backward is the reverse all-to-all).

Each rank splits its tensor along `scatter_dim` into one piece per rank, sends piece j to rank j, and
concatenates what it receives along `gather_dim`. Pieces travel flattened through one
`all_to_all_single` with per-rank element counts, so pieces may differ in size (uneven head counts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm

__all__ = ["seq_all_to_all"]


def _exchange(
    x: torch.Tensor,
    group: ProcessGroup | None,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: list[int],
    gather_sizes: list[int],
) -> torch.Tensor:
    world, me = len(scatter_sizes), ds_comm.get_rank(group)
    pieces = [p.contiguous().view(-1) for p in x.split(scatter_sizes, dim=scatter_dim)]
    send = torch.cat(pieces) if world > 1 else pieces[0]
    shapes = []
    for j in range(world):
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[me]
        shape[gather_dim] = gather_sizes[j]
        shapes.append(shape)
    counts = [int(torch.Size(s).numel()) for s in shapes]
    recv = torch.empty(sum(counts), dtype=x.dtype, device=x.device)
    ds_comm.all_to_all_single(
        recv, send, output_split_sizes=counts, input_split_sizes=[p.numel() for p in pieces], group=group
    )
    received = [piece.view(shape) for piece, shape in zip(recv.split(counts), shapes, strict=True)]
    return torch.cat(received, dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: ProcessGroup | None,
        scatter_dim: int,
        gather_dim: int,
        scatter_sizes: list[int],
        gather_sizes: list[int],
    ) -> torch.Tensor:
        ctx.args = (group, scatter_dim, gather_dim, scatter_sizes, gather_sizes)
        return _exchange(x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, scatter_dim, gather_dim, scatter_sizes, gather_sizes = ctx.args
        # The reverse exchange: scatter what was gathered, gather what was scattered.
        back = _exchange(grad.contiguous(), group, gather_dim, scatter_dim, gather_sizes, scatter_sizes)
        return back, None, None, None, None, None


def seq_all_to_all(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: list[int],
    gather_sizes: list[int],
) -> torch.Tensor:
    """Differentiable all-to-all over `group`.

    Args:
        x: this rank's tensor.
        scatter_dim: split along this dim, piece j to rank j (`sum(scatter_sizes) == x.size(scatter_dim)`).
        gather_dim: concatenate the received pieces along this dim.
        scatter_sizes: the piece sizes along `scatter_dim`, one per rank of `group`.
        gather_sizes: each rank's size along `gather_dim` (what it sends along that dim).

    Returns:
        The tensor with `scatter_dim` of size `scatter_sizes[rank]` and `gather_dim` of size `sum(gather_sizes)`.
    """
    world = ds_comm.get_world_size(group)
    if world == 1 and len(scatter_sizes) == 1:
        return x
    if len(scatter_sizes) != world or len(gather_sizes) != world:
        raise ValueError(
            f"seq_all_to_all: {world} ranks but scatter_sizes={scatter_sizes}, gather_sizes={gather_sizes}"
        )
    if sum(scatter_sizes) != x.size(scatter_dim):
        raise ValueError(
            f"seq_all_to_all: scatter_sizes {scatter_sizes} do not add up to dim {scatter_dim} of "
            f"shape {tuple(x.shape)}"
        )
    me = ds_comm.get_rank(group)
    if gather_sizes[me] != x.size(gather_dim):
        raise ValueError(
            f"seq_all_to_all: gather_sizes[{me}]={gather_sizes[me]} but dim {gather_dim} of this "
            f"rank's shape {tuple(x.shape)} is {x.size(gather_dim)}"
        )
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim, list(scatter_sizes), list(gather_sizes))
