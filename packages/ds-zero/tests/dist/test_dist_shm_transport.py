"""ZeRO over ds_comm's shared-memory pair transport trains to the same bits as over gloo's TCP.

Two gloo ranks on one host exchange their gathers, reduce-scatters and all-reduces through a shared
segment (ds_comm's `DS_COMM_SHM`, on by default); `DS_COMM_SHM=0` keeps them on gloo. The same training
in both ways must give identical losses and weights: the transport moves bits, it does not round.
A 4 KiB slot (`DS_COMM_SHM_SLOT_MB`) makes most messages several chunks long.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from stage3_cases import train_stage3
from zero_dist_cases import make_model, make_optimizer, train_zero, zero_config

import ds_zero
from ds_comm.testing import run_ranks

TINY_SLOT = "0.00390625"


def _segments() -> int:
    """How many shared segments this process has mapped (their names are unlinked: `(deleted)`)."""
    with open("/proc/self/maps") as f:
        return len({line.split()[-2] for line in f if "ds_comm_pair_" in line})


def _stage3(rank: int, world: int, dtype: torch.dtype) -> dict[str, Any]:
    out = train_stage3(rank, world, steps=4, gas=2, dtype=dtype, config={"overlap_comm": True})
    out["segments"] = _segments()
    return out


def _stage12(rank: int, world: int, stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_model()
    cfg = zero_config(stage, overlap_comm=stage == 2, reduce_bucket_size=500, allgather_bucket_size=700)
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=cfg, module=model, clip_grad=1.0)
    losses = train_zero(opt, model, rank, world, range(4), gas=2)
    opt.close()
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "segments": _segments(),
    }


def _both(fn: Any, *args: Any, slot: str | None = None) -> tuple[list[dict], list[dict]]:
    shm_env = {"DS_COMM_SHM": "1", **({"DS_COMM_SHM_SLOT_MB": slot} if slot else {})}
    shm = run_ranks(2, fn, *args, timeout_s=240, env=shm_env)
    tcp = run_ranks(2, fn, *args, timeout_s=240, env={"DS_COMM_SHM": "0"})
    return shm, tcp


def _assert_identical(shm: list[dict], tcp: list[dict]) -> None:
    for rank in range(2):
        assert shm[rank]["segments"] >= 1 and tcp[rank]["segments"] == 0  # each run took the path it was given
        assert shm[rank]["losses"] == tcp[rank]["losses"]
        assert shm[rank]["state"].keys() == tcp[rank]["state"].keys()
        for key, value in tcp[rank]["state"].items():
            assert torch.equal(shm[rank]["state"][key], value), key


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dtype", "slot"), [(torch.float32, TINY_SLOT), (torch.bfloat16, None)])
def test_stage3_shared_memory_equals_gloo(dtype: torch.dtype, slot: str | None) -> None:
    _assert_identical(*_both(_stage3, dtype, slot=slot))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_shared_memory_equals_gloo(stage: int) -> None:
    _assert_identical(*_both(_stage12, stage, slot=TINY_SLOT))
