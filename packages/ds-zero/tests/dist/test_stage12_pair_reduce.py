"""ZeRO-1/2's two-rank reduction to owners (`ds_zero._stage12.reduce`, [Note: two ranks sum as they receive]).

Each rank regenerates its peer's gradient from the peer's seed, so the expected sums are computed locally and
compared bit for bit: an fp32 bucket's piece becomes `(own + peer) * 1/2` (an all-reduce then the division,
DDP's result), added once into a separate fp32 partition; a bf16 bucket is added into the fp32 partition one
rank's piece at a time, so nothing rounds in bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

NUMEL = 6000
PART = NUMEL // 2
BUCKETS = [(0, 2500), (2500, 4100), (4100, NUMEL)]  # the middle one spans both partitions


def _grads(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)


def _reduce(rank: int, world: int) -> dict[str, Any]:
    from ds_zero._stage12.reduce import RangeReducer

    reducer = RangeReducer(None, use_reduce_scatter=True, predivide_factor=1.0)
    mine = slice(rank * PART, (rank + 1) * PART)
    start_values = torch.linspace(-1.0, 1.0, PART)
    out: dict[str, Any] = {"summed": {}, "owns": [lo < mine.stop and mine.start < hi for lo, hi in BUCKETS]}
    for name, dtype, in_place in (
        ("fp32 in place", torch.float32, True),
        ("fp32", torch.float32, False),
        ("bf16", torch.bfloat16, False),
    ):
        grads = _grads(rank, dtype)
        acc = grads[mine] if in_place else start_values.clone()
        launched = [reducer.launch(grads[lo:hi], lo, hi, PART) for lo, hi in BUCKETS]
        out["summed"][name] = [item.summed for item in launched]
        for item in launched:
            reducer.complete(item, acc, PART, in_place=in_place)
        own, peer = _grads(rank, dtype)[mine], _grads(1 - rank, dtype)[mine]
        if dtype == torch.float32:
            expect = (own + peer) * 0.5
            if not in_place:
                expect = start_values + expect
        else:  # bucket by bucket, the own piece then the peer's, each scaled, into the fp32 partition
            expect = start_values.clone()
            for lo, hi in BUCKETS:
                lo, hi = max(lo, mine.start), min(hi, mine.stop)
                if lo < hi:
                    piece = slice(lo - mine.start, hi - mine.start)
                    expect[piece] = expect[piece] + own[piece].float() * 0.5
                    expect[piece] = expect[piece] + peer[piece].float() * 0.5
        out[name] = float((acc.float() - expect.float()).abs().max())
    return out


@pytest.mark.timeout(120)
def test_two_rank_reduction_sums_fp32_as_it_receives_and_keeps_bf16_sums_in_fp32() -> None:
    for r in run_ranks(2, _reduce, timeout_s=90):
        assert r["fp32 in place"] == 0.0 and r["fp32"] == 0.0 and r["bf16"] == 0.0, r
        owns = r["owns"]  # a bucket wholly in the peer's partition is only sent: nothing received to sum
        assert r["summed"]["fp32"] == owns and r["summed"]["fp32 in place"] == owns and any(owns), r
        assert not any(r["summed"]["bf16"]), r["summed"]
