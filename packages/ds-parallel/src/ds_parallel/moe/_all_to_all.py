"""`expert_all_to_all`: the expert-parallel exchange of capacity buffers, as an autograd function.

The `[E, C, M]` buffer splits along experts into one equal piece per rank of the expert-parallel group;
piece j goes to rank j, which holds experts `j * E/ep ... (j+1) * E/ep - 1`. What a rank receives is
`[ep, E/ep, C, M]` stacked on the first dim: the tokens every rank routed to its experts. Sending the
results back is the same exchange, and so is the backward of either one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

import ds_comm

__all__ = ["_AllToAll", "expert_all_to_all"]


def _exchange(x: Tensor, group: ProcessGroup | None) -> Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    ds_comm.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The exchange as an autograd function; DeepSpeed's name and argument order (`_AllToAll.apply(group, x)`),
    looked up at call time by `MOELayer`, so a script can count or replace the exchange as DeepSpeed's tests do."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup | None, x: Tensor) -> Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


def expert_all_to_all(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Exchange equal first-dim pieces of `x` with every rank of `group` (differentiable).

    Raises:
        ValueError: the first dim does not split evenly over the group.
    """
    world = ds_comm.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"expert all-to-all: dim 0 ({x.shape[0]}) must split evenly over {world} ranks")
    return _AllToAll.apply(group, x)
