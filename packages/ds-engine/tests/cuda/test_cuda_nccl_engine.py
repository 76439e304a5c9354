"""The engine over a real nccl process group of one rank (one GPU): ZeRO-2 and ZeRO-3 train as without a group.

A one-GPU machine cannot run two nccl ranks, but it can run the engine the way a launcher starts it:
`initialize()` finds the group `ds_comm.testing.run_ranks` created, the data-parallel group is nccl's,
and ZeRO's collectives run through it. Losses and weights equal the same run with no process group
(`dist_init_required=False`) to 1e-6.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_cuda_zero_engine import _config, _model, _tokens, _train_engine, _weights

from ds_comm.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKEND, DEVICE = "nccl", "cuda"


def _ranked(rank: int, world: int, stage: int) -> dict[str, Any]:
    import torch.distributed as dist

    import ds_engine

    engine, *_ = ds_engine.initialize(model=_model(), config=copy.deepcopy(_config(stage)))
    tokens, losses = _tokens(6), []
    for micro in range(6):
        idx = tokens[micro].to(DEVICE)
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "backend": str(dist.get_backend()),
        "losses": torch.tensor(losses),
        "weights": _weights(engine),
        "device": engine.device.type,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_over_a_one_rank_nccl_group_matches_no_group(stage: int) -> None:
    (result,) = run_ranks(1, _ranked, stage=stage, backend=BACKEND, timeout_s=180)
    assert result["backend"] == BACKEND and result["device"] == DEVICE
    losses, weights, _ = _train_engine(_config(stage), steps=6)
    torch.testing.assert_close(result["losses"], losses, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(result["weights"], weights, rtol=1e-6, atol=1e-6)
