"""Data-parallel gradient averaging in flat buckets (one all-reduce per bucket instead of per tensor)."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

import ds_comm

logger = logging.getLogger(__name__)

#: Elements per all-reduce bucket (100 MB of fp32): large enough to amortise latency.
DEFAULT_BUCKET_NUMEL = 25_000_000


def _buckets(grads: list[torch.Tensor], bucket_numel: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if buckets[-1] and size + g.numel() > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel()
    return [b for b in buckets if b]


def allreduce_mean_grads(
    params: Iterable[torch.nn.Parameter],
    group: ProcessGroup | None,
    world_size: int,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> None:
    """Average `.grad` of every trainable parameter over `group` (a missing gradient counts as zero).

    Gradients are grouped by dtype and device, flattened into buckets of at most `bucket_numel`
    elements, all-reduced (sum) on `group`, divided by `world_size` and copied back.
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_kind[(p.grad.dtype, p.grad.device)].append(p.grad)
    for grads in by_kind.values():
        for bucket in _buckets(grads, bucket_numel):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            ds_comm.all_reduce(flat, group=group)
            flat.div_(world_size)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
