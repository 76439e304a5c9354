"""`all_gather_autograd`: an all-gather whose backward sums each rank's gradient for its own piece.

Used to combine per-shard losses: every rank computes the same total from the gathered pieces, so the
gradient of a rank's piece is the sum of what every rank's total sends back to it.
(`torch.distributed.nn.functional.all_gather` is deprecated and its backward fails on gloo subgroups.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm

__all__ = ["all_gather_autograd"]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group, ctx.rank = group, ds_comm.get_rank(group)
        world = ds_comm.get_world_size(group)
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
        ds_comm.all_gather_into_tensor(out, x.contiguous().unsqueeze(0), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        ds_comm.all_reduce(total, group=ctx.group)
        return total[ctx.rank], None


def all_gather_autograd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """`[world, *x.shape]`: every rank's `x`, differentiable (backward: the summed gradient of this rank's piece)."""
    if ds_comm.get_world_size(group) == 1:
        return x.unsqueeze(0)
    return _AllGather.apply(x, group)
