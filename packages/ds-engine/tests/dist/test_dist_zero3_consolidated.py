"""The engine's `_zero3_consolidated_16bit_state_dict()` and `zero_gather_16bit_weights_on_model_save()`.

Accelerate's `get_state_dict` (HF Trainer's `save_model` at ZeRO-3) calls both.

2 ranks, ZeRO stage 3, a few AdamW steps from the same weights as a plain model trained on the same
full batch: rank 0's consolidated state_dict has the plain model's keys and values (1e-6), rank 1 gets
None (as in DeepSpeed), the parameters stay partitioned, and a stage-2 engine refuses the call by name.
Needs ds-zero (the `ds-engine[all]` session).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO stage 3 through the engine needs ds-zero: pip install 'ds-engine[zero]'")

LR = 1e-2


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    net.register_buffer("scale", torch.full((3,), 0.5))
    return net


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _config(stage: int, gather: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": gather,
        },
    }


def _train_and_consolidate(rank: int, world: int) -> dict[str, Any]:
    import ds_engine as deepspeed

    x, y = _batch()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    engine, *_ = deepspeed.initialize(model=_net(), config=_config(3, gather=True))
    for _ in range(3):
        loss = nn.functional.mse_loss(engine(xs), ys)
        engine.backward(loss)
        engine.step()
    state = engine._zero3_consolidated_16bit_state_dict()
    partitioned = all(p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters())
    no_gather, *_ = deepspeed.initialize(model=_net(), config=_config(3, gather=False))
    stage2, *_ = deepspeed.initialize(model=_net(), config=_config(2, gather=True))
    try:
        stage2._zero3_consolidated_16bit_state_dict()
        refused = "<not refused>"
    except ValueError as err:
        refused = str(err)
    return {
        "state": state,
        "partitioned": partitioned,
        "gather": engine.zero_gather_16bit_weights_on_model_save(),
        "no_gather": no_gather.zero_gather_16bit_weights_on_model_save(),
        "refused": refused,
    }


def test_zero3_consolidated_state_dict_matches_plain_training() -> None:
    reference = _net()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    x, y = _batch()
    for _ in range(3):
        # each rank's loss is the mean over its half; the data-parallel average is the full-batch mean
        loss = nn.functional.mse_loss(reference(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    expected = copy.deepcopy(reference.state_dict())

    results = run_ranks(2, _train_and_consolidate, timeout_s=120)
    state = results[0]["state"]
    assert list(state) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)
        assert state[key].device.type == "cpu"
    assert results[1]["state"] is None
    for r in results:
        assert r["partitioned"] and r["gather"] is True and r["no_gather"] is False
        assert "needs ZeRO stage 3 (this engine is at stage 2)" in r["refused"], r["refused"]
