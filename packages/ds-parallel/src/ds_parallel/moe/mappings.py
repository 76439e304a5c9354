"""Splitting and re-joining tokens across tensor-parallel ranks (DeepSpeed's `deepspeed.moe.mappings`).

With a tensor-parallel model every rank of a tensor-parallel group holds the same tokens when they reach an
MoE layer. `drop_tokens` keeps this rank's 1/tp slice along a dim (so the expert all-to-all carries each
token once, not tp times); `gather_tokens` all-gathers the slices back. They are each other's backward:
the gradient of a dropped slice is gathered, the gradient of a gathered tensor is this rank's slice (every
rank computes the same full gradient downstream, so no sum is needed).

`group` is the tensor-parallel group; None means the model's (`ds_parallel.groups`: the published mpu's,
else the mesh's `tp` dim). With one tensor-parallel rank both are the identity.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

__all__ = ["_DropTokens", "_GatherTokens", "_drop_tokens", "_gather_tokens", "drop_tokens", "gather_tokens"]


def _tp_group(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is not None:
        return group
    from ds_parallel import groups  # groups imports the moe package; resolved at call time

    size, tp_group, _ = groups._tensor_parallel()
    return tp_group if size > 1 else None


def _gather_tokens(input_: Tensor, dim: int = 0, group: ProcessGroup | None = None) -> Tensor:
    """Concatenate every tensor-parallel rank's `input_` along `dim`, in rank order."""
    group = _tp_group(group)
    input_ = input_.contiguous()
    if group is None or dist.get_world_size(group) == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, input_, group=group)
    return torch.cat(parts, dim=dim).contiguous()


def _drop_tokens(input_: Tensor, dim: int = 0, group: ProcessGroup | None = None) -> Tensor:
    """This tensor-parallel rank's slice of `input_` along `dim`.

    Raises:
        ValueError: `dim`'s size does not split evenly over the tensor-parallel ranks.
    """
    group = _tp_group(group)
    if group is None or dist.get_world_size(group) == 1:
        return input_
    chunks, rank = dist.get_world_size(group), dist.get_rank(group)
    if input_.shape[dim] % chunks:
        raise ValueError(
            f"drop_tokens: dim {dim} ({input_.shape[dim]}) is not divisible by the tensor-parallel world size "
            f"({chunks})"
        )
    size = input_.shape[dim] // chunks
    return torch.narrow(input_, dim, rank * size, size)


class _GatherTokens(torch.autograd.Function):
    """All-gather along a dim; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, input_: Tensor, dim: int, group: ProcessGroup | None = None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather_tokens(input_, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _drop_tokens(grad, ctx.dim, ctx.group), None, None


class _DropTokens(torch.autograd.Function):
    """Keep this rank's slice along a dim; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, input_: Tensor, dim: int, group: ProcessGroup | None = None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _drop_tokens(input_, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather_tokens(grad, ctx.dim, ctx.group), None, None


def gather_tokens(input_: Tensor, dim: int = 0, group: ProcessGroup | None = None) -> Tensor:
    """`_gather_tokens` with autograd; the identity without tensor parallelism."""
    if _tp_group(group) is None:
        return input_
    out: Tensor = _GatherTokens.apply(input_, dim, group)  # type: ignore[no-untyped-call]
    return out


def drop_tokens(input_: Tensor, dim: int = 0, group: ProcessGroup | None = None) -> Tensor:
    """`_drop_tokens` with autograd; the identity without tensor parallelism."""
    if _tp_group(group) is None:
        return input_
    out: Tensor = _DropTokens.apply(input_, dim, group)  # type: ignore[no-untyped-call]
    return out
