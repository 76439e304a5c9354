"""The vocabulary shard layout shared by the vocabulary-parallel losses, and their small collectives.

A vocabulary-parallel LM head gives each tensor-parallel rank a contiguous row range
`[vocab_start_index, vocab_end_index)` of the vocabulary. The losses need that range and the global
vocabulary size; both are checked once across the group so that a wrong layout fails on every rank with
the same message instead of producing a finite, wrong loss.

`None` as a group means "this dimension is absent" (never the world group), as DeepSpeed's losses read it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm

__all__ = ["AllReduceSum", "AllReduceSumOfPartials", "global_sp_sum", "is_parallel", "resolve_vocab_metadata"]

logger = logging.getLogger(__name__)


def is_parallel(group: ProcessGroup | None) -> bool:
    """Whether a collective over `group` does anything (`None`: the dimension is absent)."""
    return group is not None and ds_comm.get_world_size(group) > 1


def _world(group: ProcessGroup | None) -> int:
    return ds_comm.get_world_size(group) if group is not None else 1


def _rank(group: ProcessGroup | None) -> int:
    return ds_comm.get_rank(group) if group is not None else 0


def _check_bounds(local: int, start: int, end: int, tp_group: ProcessGroup | None, device: torch.device) -> int:
    """The global vocabulary size, after checking every rank's `[start, end)` tiles `[0, V)` in rank order."""
    world = _world(tp_group)
    if world == 1:
        if start != 0 or end != local:
            raise ValueError(
                f"vocab_start_index={start}, vocab_end_index={end}: without tensor parallelism the shard must be "
                f"the whole local vocabulary [0, {local})"
            )
        return end
    mine = torch.tensor([start, end, local], dtype=torch.long, device=device)
    every = torch.empty(world * 3, dtype=torch.long, device=device)
    ds_comm.all_gather_into_tensor(every, mine, group=tp_group)
    expected = 0
    for rank, (lo, hi, size) in enumerate(every.view(world, 3).tolist()):
        if size <= 0:
            raise ValueError(
                f"tensor-parallel rank {rank} holds an empty vocabulary shard: the vocabulary must have at least "
                f"as many entries as the {world} tensor-parallel ranks"
            )
        if hi - lo != size:
            raise ValueError(
                f"tensor-parallel rank {rank}: vocab_end_index - vocab_start_index = {hi - lo} but its logits "
                f"hold {size} vocabulary entries"
            )
        if lo != expected:
            raise ValueError(
                f"tensor-parallel rank {rank} starts its vocabulary shard at {lo}, expected {expected}: the shards "
                f"must tile [0, vocab) in rank order without gaps or overlaps"
            )
        expected = hi
    return expected


def resolve_vocab_metadata(
    local_vocab_size: int,
    vocab_start_index: int | None,
    vocab_end_index: int | None,
    tp_group: ProcessGroup | None,
    device: torch.device,
) -> tuple[int, int, int]:
    """`(start, end, global_vocab_size)` of this rank's shard, inferred for equal shards, checked collectively."""
    if vocab_start_index is None:
        world = _world(tp_group)
        if world > 1:
            sizes = torch.tensor([local_vocab_size, -local_vocab_size], dtype=torch.long, device=device)
            ds_comm.all_reduce(sizes, op=ds_comm.ReduceOp.MAX, group=tp_group)
            if int(sizes[0]) != -int(sizes[1]):
                raise ValueError(
                    "the tensor-parallel ranks hold vocabulary shards of different sizes: pass vocab_start_index "
                    "and vocab_end_index explicitly for uneven shards"
                )
        vocab_start_index = _rank(tp_group) * local_vocab_size
        vocab_end_index = vocab_start_index + local_vocab_size
    assert vocab_end_index is not None
    total = _check_bounds(local_vocab_size, vocab_start_index, vocab_end_index, tp_group, device)
    return vocab_start_index, vocab_end_index, total


def check_targets(target: torch.Tensor, ignore_index: int, global_vocab_size: int, what: str = "target") -> None:
    """Refuse ids outside `[0, V)` (other than `ignore_index`): they belong to no shard and would give a finite loss."""
    bad = (target != ignore_index) & ((target < 0) | (target >= global_vocab_size))
    if bool(bad.any()):
        raise ValueError(
            f"{what} holds ids outside [0, {global_vocab_size}) (e.g. {int(target[bad].flatten()[0])}); "
            f"ids must index the vocabulary or equal ignore_index={ignore_index}"
        )


class AllReduceSum(torch.autograd.Function):
    """Sum over `group` in forward; identity in backward.

    Every rank of the group back-propagates the same (replicated) loss, so the gradient of this rank's
    contribution is the upstream gradient itself: no collective is needed in backward.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = x.clone()
        if is_parallel(group):
            ds_comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class AllReduceSumOfPartials(torch.autograd.Function):
    """Sum over `group` in forward and in backward: for a statistic that each rank then uses in its own partial term.

    With `out = sum_r f_r(x_r, s)` and `s = sum_r g_r(x_r)`, the gradient reaching `s` on rank r covers only
    `f_r`; the true gradient of `s` is the sum over the ranks, which every `g_r` needs.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        if is_parallel(group):
            ds_comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        if is_parallel(ctx.group):
            ds_comm.all_reduce(total, group=ctx.group)
        return total, None


def global_sp_sum(local: torch.Tensor, sp_group: ProcessGroup | None) -> torch.Tensor:
    """The sum of `local` over the sequence-parallel ranks; the gradient flows to this rank's own term."""
    if not is_parallel(sp_group):
        return local
    return AllReduceSum.apply(local, sp_group)
