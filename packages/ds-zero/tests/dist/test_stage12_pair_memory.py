"""ZeRO-1/2 on two ranks of one host read each other's flat buffers (`ds_zero._stage12.pair_memory`).

The same training runs with pair memory and with `DS_COMM_SHM=0` (the collectives through gloo): the
parameters must agree bit for bit after every step, at stage 1 (whose gradient buffer is pair memory too)
and stage 2 (whose buckets are staged there, with and without overlap, in many small buckets), with
gradient accumulation (a rank writes its gradient buffer again in the next micro-step only after its peer
has read it) and an uneven pace (one rank sleeps inside the window, so the waits must really wait).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from zero_dist_cases import batch, loss_fn, make_model, make_optimizer, zero_config

import ds_zero
from ds_comm.testing import run_ranks


def _train(rank: int, world: int, stage: int, gas: int, **config: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    model = make_model()
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=zero_config(stage, **config), module=model)
    grads = opt._grads.shared if stage == 1 else opt._grads.pairs  # stage 1: the flat buffer; 2: the staging
    used = {"params": [f.shared is not None for f in opt.flats], "grads": [s is not None for s in grads]}
    snapshots = []
    for step in range(4):
        for micro in range(gas):
            if rank == 1 and step % 2:
                time.sleep(0.05)  # this rank lags: its peer must wait at the barriers, not read early
            x, y = batch(step, micro, rank, world)
            opt.backward(loss_fn(model, x, y) / gas)
        opt.step()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    opt.close()
    return snapshots, used


def _both_ways(rank: int, world: int, stage: int, gas: int, config: dict[str, Any]) -> dict[str, Any]:
    shared, used = _train(rank, world, stage, gas, **config)
    os.environ["DS_COMM_SHM"] = "0"
    try:
        plain, unused = _train(rank, world, stage, gas, **config)
    finally:
        del os.environ["DS_COMM_SHM"]
    return {
        "equal": [torch.equal(a, b) for a, b in zip(shared, plain, strict=True)],
        "moved": not torch.equal(shared[0], shared[-1]),
        "used": used,
        "unused": unused,
    }


TINY = {"reduce_bucket_size": 40}  # many buckets, most straddling the partitions


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("stage", "gas", "config"),
    [
        (1, 1, {}),
        (1, 3, {}),
        (2, 1, {}),
        (2, 3, {"overlap_comm": True, **TINY}),
        (2, 2, {"overlap_comm": False, **TINY}),
    ],
)
def test_pair_memory_gives_the_collectives_bits(stage: int, gas: int, config: dict[str, Any]) -> None:
    for rank, res in enumerate(run_ranks(2, _both_ways, stage=stage, gas=gas, config=config, timeout_s=150)):
        assert res["equal"] == [True] * 4, f"rank {rank}: {res['equal']}"
        assert res["moved"], f"rank {rank}: the parameters never changed"
        for kind in ("params", "grads"):
            assert all(res["used"][kind]) and not any(res["unused"][kind]), res
