"""Overflow agreement and partitioned gradient norms across 2 gloo ranks."""

from __future__ import annotations

import math

import torch

from ds_comm.testing import run_ranks
from ds_ops.precision import global_grad_norm, has_overflow

FULL = torch.arange(-12.0, 12.0) / 3


def _check(rank: int, world: int) -> dict[str, object]:
    shard = FULL.chunk(world)[rank]
    grads = [torch.tensor([1.0, float("inf")])] if rank == 1 else [torch.ones(2)]
    return {
        "overflow_one_rank": has_overflow(grads),
        "overflow_none": has_overflow([torch.ones(2)]),
        "norm2": global_grad_norm([shard]),
        "norm_inf": global_grad_norm([shard], norm_type=math.inf),
        "replicated": global_grad_norm([FULL], partitioned=False),
    }


def test_overflow_on_one_rank_is_seen_by_all_and_norm_spans_partitions() -> None:
    results = run_ranks(2, _check, timeout_s=60)
    for r in results:
        assert r["overflow_one_rank"] is True and r["overflow_none"] is False
        torch.testing.assert_close(r["norm2"], FULL.norm(), rtol=1e-6, atol=0)
        torch.testing.assert_close(r["norm_inf"], FULL.abs().max(), rtol=0, atol=0)
        torch.testing.assert_close(r["replicated"], FULL.norm(), rtol=1e-6, atol=0)
