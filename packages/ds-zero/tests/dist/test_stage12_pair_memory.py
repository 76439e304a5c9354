"""ZeRO-1/2 on two ranks of one host read each other's flat buffers (`ds_zero._stage12.pair_memory`).

The same training runs with pair memory and with `DS_COMM_SHM=0` (the collectives through gloo): the
parameters must agree bit for bit after every step, at stage 1 (whose gradient buffer is pair memory too)
and stage 2 (whose buckets are staged there, with and without overlap, in many small buckets), with
gradient accumulation (a rank writes its gradient buffer again in the next micro-step only after its peer
has read it) and an uneven pace (one rank sleeps inside the window, so the waits must really wait).

Stage 2 writes a bucket's first sum over a partition `zero_grad()` left uncleared, and sums this rank's
own part straight from the gradients (BucketReducer's [Note: clearing by overwriting]), so the plans
also reach what no bucket writes: a step with no backward, a `zero_grad()` inside the window, and
micro-steps whose loss leaves some parameters without a gradient.
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


def _partial_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss through `emb` alone: `mid` and `head` get no gradient (counted as zero)."""
    return (torch.tanh(model.emb(x)).sum(dim=1, keepdim=True) - y).pow(2).mean()


def _train(
    rank: int, world: int, stage: int, gas: int, plan: str = "", **config: Any
) -> tuple[list[torch.Tensor], dict[str, Any]]:
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
            if plan == "no backward" and step == 2:
                continue  # the step after it reads partitions no reduction wrote since zero_grad()
            if plan == "partial" and step in (1, 2) and micro == 0:
                opt.backward(_partial_loss(model, x, y) / gas)
                continue
            opt.backward(loss_fn(model, x, y) / gas)
            if plan == "zero inside" and step == 1 and micro == 0:
                opt.zero_grad()  # this micro-step's sums must not reach the step
        opt.step()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    opt.close()
    return snapshots, used


def _both_ways(rank: int, world: int, stage: int, gas: int, config: dict[str, Any], plan: str) -> dict[str, Any]:
    shared, used = _train(rank, world, stage, gas, plan, **config)
    os.environ["DS_COMM_SHM"] = "0"
    try:
        plain, unused = _train(rank, world, stage, gas, plan, **config)
    finally:
        del os.environ["DS_COMM_SHM"]
    return {
        "equal": [torch.equal(a, b) for a, b in zip(shared, plain, strict=True)],
        "moved": not torch.equal(shared[0], shared[-1]),
        "used": used,
        "unused": unused,
    }


TINY = {"reduce_bucket_size": 40}  # many buckets, most straddling the partitions
UNUSED = {"ignore_unused_parameters": True}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("stage", "gas", "config", "plan"),
    [
        (1, 1, {}, ""),
        (1, 3, {}, ""),
        (2, 1, {}, ""),
        (2, 3, {"overlap_comm": True, **TINY}, ""),
        (2, 2, {"overlap_comm": False, **TINY}, ""),
        (2, 2, {"overlap_comm": True, **TINY, **UNUSED}, "partial"),
        (2, 1, {"overlap_comm": True, **TINY}, "no backward"),
        (2, 2, {"overlap_comm": True}, "zero inside"),
    ],
)
def test_pair_memory_gives_the_collectives_bits(stage: int, gas: int, config: dict[str, Any], plan: str) -> None:
    ranks = run_ranks(2, _both_ways, stage=stage, gas=gas, config=config, plan=plan, timeout_s=150)
    for rank, res in enumerate(ranks):
        assert res["equal"] == [True] * 4, f"rank {rank}: {res['equal']}"
        assert res["moved"], f"rank {rank}: the parameters never changed"
        for kind in ("params", "grads"):
            assert all(res["used"][kind]) and not any(res["unused"][kind]), res
