"""`finish_step` on 2 gloo ranks: partitioned norm and clip equal one rank's full gradient; one bad rank skips all."""

from __future__ import annotations

import math

import pytest
import torch

from ds_comm.testing import run_ranks
from ds_ops.precision import DynamicLossScaler, LossScaler, finish_step

FULL = torch.linspace(-3.0, 5.0, 24)


def _partitioned(rank: int, world: int) -> dict[str, object]:
    scale = 8.0
    shard = (FULL.chunk(world)[rank] * scale).clone()
    clean = finish_step([shard], scaler=LossScaler(scale), clip=1.0, partitioned=True)
    bad = (FULL.chunk(world)[rank] * scale).clone()
    if rank == 1:
        bad[0] = math.nan
    scaler = DynamicLossScaler(init_scale=scale, delayed_shift=1)
    # no norm wanted: the flag alone travels
    skipped = finish_step([bad], scaler=scaler, clip=0.0, compute_norm=False, partitioned=True)
    # a replicated caller handed a skip flag agreed elsewhere: no collective, the flag decides
    told = finish_step([FULL.clone()], scaler=None, check_overflow=False, skip=torch.ones(1), partitioned=False)
    return {"clean": clean, "shard": shard, "skipped": skipped, "scale": scaler.cur_scale, "told": told}


def test_partitioned_step_agrees_and_matches_the_full_gradient() -> None:
    results = run_ranks(2, _partitioned, timeout_s=60)
    param = torch.nn.Parameter(torch.zeros(24))
    param.grad = FULL.clone()
    ref_norm = float(torch.nn.utils.clip_grad_norm_([param], 1.0))
    ref = param.grad
    got = torch.cat([r["shard"] for r in results])
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    for r in results:
        assert r["clean"].applied and r["clean"].grad_norm == pytest.approx(ref_norm, rel=1e-6)
        assert not r["skipped"].applied and r["skipped"].grad_norm is None and r["scale"] == 4.0
        assert not r["told"].applied
