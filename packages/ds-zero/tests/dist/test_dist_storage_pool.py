"""The released-storage pool at 2 gloo ranks: gathers all-gather straight into pooled memory.

At more than one rank a gathered parameter's full storage is the all-gather's destination, and the pool hands
that storage the bytes a released parameter of the same size gave up (`ds_zero._params.storage_pool`). A tower
of 16 MiB fp32 weights (above the pool's 8 MiB floor) trains 4 steps with and without the pool: the gathers
were served from it, and losses and weights are the same bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero._params import partitioned_param
from ds_zero._params.storage_pool import ReleasedStoragePool
from ds_zero._schedule import coordinator

WIDTH, LAYERS, STEPS = 2048, 4, 4


def _train(rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    with ds_zero.Init():
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2 * WIDTH * WIDTH}
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        loss = torch.tanh(model(torch.randn(4, WIDTH, generator=g))).pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.float() for k, v in ds_zero.consolidated_16bit_state_dict(model, rank0_only=False).items()}
    return losses, state


def _with_and_without(rank: int, world: int) -> dict[str, Any]:
    off = ReleasedStoragePool()  # capacity stays 0: nothing is pooled
    off.reserve = lambda nbytes: None  # type: ignore[method-assign]
    partitioned_param.released_storages = coordinator.released_storages = off
    losses_off, state_off = _train(rank)
    on = ReleasedStoragePool()
    partitioned_param.released_storages = coordinator.released_storages = on
    losses_on, state_on = _train(rank)
    same = all(torch.equal(state_on[k], state_off[k]) for k in state_off)
    return {"off": (losses_off, off.hits), "on": (losses_on, on.hits), "same_weights": same}


def test_gathers_into_pooled_memory_train_exactly_as_without_the_pool() -> None:
    for res in run_ranks(2, _with_and_without, timeout_s=180):
        losses_off, hits_off = res["off"]
        losses_on, hits_on = res["on"]
        assert hits_off == 0 and hits_on > 0
        assert losses_on == losses_off
        assert res["same_weights"]
