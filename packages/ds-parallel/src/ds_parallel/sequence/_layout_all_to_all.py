"""The Ulysses all-to-all addressed by layout (`single_all_to_all`, `_SeqAllToAll`), as `deepspeed.sequence.layer`
spells it: `[b, s, h, d]` (`batch_dim_idx=0`) or `[s, b, h, d]` (`batch_dim_idx=1`).

`scatter_idx >= 2` trades this rank's sequence slice for all of the sequence and its share of the heads;
`scatter_idx < 2` trades back. Both directions are `seq_all_to_all` with the dims and sizes worked out from
the layout, so uneven head counts split as `DistributedAttention` splits them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._all_to_all import _exchange

__all__ = ["single_all_to_all"]


def _heads(total: int, world: int) -> list[int]:
    """Heads per rank as `DistributedAttention` splits them: the first `total % world` ranks one more."""
    base, extra = divmod(total, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def _plan(
    t: torch.Tensor,
    scatter_idx: int,
    batch_dim_idx: int,
    group: ProcessGroup | None,
    world: int,
    me: int,
    num_heads: int | None,
) -> tuple[int, int, list[int], list[int]]:
    seq_dim = 1 - batch_dim_idx
    if scatter_idx >= 2:  # sequence -> heads
        heads = _heads(t.shape[2], world)
        return 2, seq_dim, heads, [t.shape[seq_dim]] * world
    if num_heads is not None:
        heads = _heads(num_heads, world)
        if heads[me] != t.shape[2]:
            raise ValueError(
                f"single_all_to_all: this rank holds {t.shape[2]} heads but num_kv_heads={num_heads} over {world} "
                f"ranks gives it {heads[me]}"
            )
    else:  # each rank says how many heads it holds (they may differ by one)
        counts = torch.zeros(world, dtype=torch.long, device=t.device)
        ds_comm.all_gather_into_tensor(
            counts, torch.tensor([t.shape[2]], dtype=torch.long, device=t.device), group=group
        )
        heads = [int(c) for c in counts.tolist()]
    if t.shape[seq_dim] % world:
        raise ValueError(f"single_all_to_all: sequence of {t.shape[seq_dim]} does not split over {world} ranks")
    return seq_dim, 2, [t.shape[seq_dim] // world] * world, heads


def single_all_to_all(
    input: torch.Tensor,  # noqa: A002 - DeepSpeed's argument name
    scatter_idx: int,
    gather_idx: int,
    batch_dim_idx: int,
    group: ProcessGroup | None,
    async_op: bool = False,
    handle: Any = None,
    type: Any = None,  # noqa: A002 - DeepSpeed's argument name
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """One all-to-all of a 4-D `[b, s, h, d]` / `[s, b, h, d]` tensor (no autograd; `_SeqAllToAll` has one).

    `num_kv_heads`: the total head count when trading back (without it the ranks tell each other theirs).
    `async_op`, `handle`, `type`: accepted; the exchange completes before returning.
    """
    world = ds_comm.get_world_size(group)
    if world == 1:
        return input
    me = ds_comm.get_rank(group)
    scatter, gather, s_sizes, g_sizes = _plan(input, scatter_idx, batch_dim_idx, group, world, me, num_kv_heads)
    return _exchange(input.contiguous(), group, scatter, gather, s_sizes, g_sizes)


class _SeqAllToAll(torch.autograd.Function):
    """`single_all_to_all` with autograd: backward is the exchange the other way."""

    @staticmethod
    def forward(
        ctx: Any,
        group: ProcessGroup | None,
        input: torch.Tensor,  # noqa: A002
        scatter_idx: int,
        gather_idx: int,
        batch_dim_idx: int,
        stream: Any = None,
        handle: Any = None,
        type: Any = None,  # noqa: A002
        is_fwd: bool = True,
        num_kv_heads: int | None = None,
    ) -> torch.Tensor:
        ctx.args = (group, gather_idx, scatter_idx, batch_dim_idx)
        ctx.total_heads = input.shape[2] if scatter_idx >= 2 else num_kv_heads
        return single_all_to_all(input, scatter_idx, gather_idx, batch_dim_idx, group, num_kv_heads=num_kv_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, scatter_idx, gather_idx, batch_dim_idx = ctx.args
        back = single_all_to_all(grad, scatter_idx, gather_idx, batch_dim_idx, group, num_kv_heads=ctx.total_heads)
        return (None, back, *([None] * 8))
