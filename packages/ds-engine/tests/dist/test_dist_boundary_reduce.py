"""At ZeRO stage 0 the backward that ends the accumulation window averages the gradients, as DeepSpeed's does.

Code between `backward` and `step` (a gradient read, a logged norm, a client's own clipping) then sees the
data-parallel average, not this rank's sum. Model: `(w * x).sum()` with w = ones(4), so each micro-batch's
gradient is its input; with 2 micro-batches per window the expected boundary gradient is the mean over ranks
of (x0 + x1) / 2, exactly representable in bf16 and fp32 for the integer inputs used. Before the boundary, and
inside `no_sync()`, the gradient stays this rank's own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks


class ScaleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def _config(precision: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True, "immediate_grad_update": False}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if precision == "bf16-zero1":  # DeepSpeed builds its BF16_Optimizer here (stage 1 with fp32 accumulation)
        config["bf16"] = {"enabled": True, "immediate_grad_update": False}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["zero_optimization"] = {"stage": 1}
    return config


def _inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    offset = 18 * rank
    return [torch.tensor([1.0, 3, 5, 7], dtype=dtype) + offset, torch.tensor([11.0, 13, 15, 17], dtype=dtype) + offset]


def _grad(engine: Any) -> torch.Tensor:
    from ds_engine.utils import safe_get_full_grad

    grad = safe_get_full_grad(engine.module.weight)
    assert grad is not None
    return grad.detach().float().clone()


def _boundary(rank: int, world_size: int, precision: str, no_sync: bool) -> dict[str, list[float]]:
    import ds_engine

    engine, *_ = ds_engine.initialize(model=ScaleModel(), config=_config(precision))
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    first, last = _inputs(rank, dtype)
    engine.backward(engine(first))
    after_first = _grad(engine)
    if no_sync:
        with engine.no_sync():
            engine.set_gradient_accumulation_boundary(True)
            engine.backward(engine(last))
    else:
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(last))
    after_boundary = _grad(engine)
    out = {"first": after_first.tolist(), "boundary": after_boundary.tolist()}
    if precision == "bf16":  # DeepSpeed's BF16_Optimizer name (ds's stage-0 16-bit wrapper)
        out["flat"] = engine.optimizer.fp32_groups_gradients_flat[0].float().tolist()
    engine.destroy()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-zero1"])
def test_boundary_backward_averages_the_gradients(precision: str) -> None:
    if precision == "bf16-zero1":
        pytest.importorskip("ds_zero", reason="ZeRO stage 1 needs ds-zero")
    results = run_ranks(2, _boundary, precision, False, timeout_s=150)
    expected = [15.0, 17.0, 19.0, 21.0]  # mean over ranks of (x0 + x1) / 2
    for rank, result in enumerate(results):
        if precision != "bf16-zero1":  # ZeRO's full-gradient read is a collective (an average) at any micro-step
            own_first = [v / 2 for v in _inputs(rank, torch.float32)[0].tolist()]
            assert result["first"] == own_first, f"rank {rank}: before the boundary the gradient is the rank's own"
        assert result["boundary"] == expected, f"rank {rank}"
        if "flat" in result:
            assert result["flat"] == expected, f"rank {rank}: fp32_groups_gradients_flat"


@pytest.mark.timeout(180)
def test_no_sync_leaves_the_reduction_to_later() -> None:
    results = run_ranks(2, _boundary, "fp32", True, timeout_s=150)
    for rank, result in enumerate(results):
        x0, x1 = (t.tolist() for t in _inputs(rank, torch.float32))
        assert result["boundary"] == [(a + b) / 2 for a, b in zip(x0, x1, strict=True)], f"rank {rank}"
