"""ZenFlow checkpoints through the engine (`save_checkpoint` / `load_checkpoint`) at ZeRO 1, 2 and 3 on 2 gloo ranks.

Each run of `zenflow_case` is trained for `k` micro steps, saved, and resumed in a fresh engine whose model
starts from other weights; its remaining losses and final weights must equal the uninterrupted run's
exactly (tolerance 0: the same operations on the same values). The `k`s stop mid-window (accumulated CPU
gradients and selective moments live) and right after a CPU update. A save that fails leaves the last good
checkpoint in place: the engine's atomic writer publishes a tag only when every file was written.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import zenflow_case as case
from torch import nn

import ds_engine
from ds_comm.testing import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero")

ZF = case.RUNS["z2_w2_warmup"][2]
#: (name, zero stage, zenflow section, k, bf16): z2/z3 update every 2 after 3 warm-up steps and reselect every 4,
#: so k=6 stops mid-window and k=5 right after an update; z1 updates every 3 (k=4: mid-window). The bf16
#: runs check that a save changes nothing: the masters' fp32 values outside the selection are kept. The
#: "auto" runs resume the adaptive window's sums too (and the engine takes its boundaries from the optimizer).
CASES: list[tuple[str, int, dict[str, Any], int, bool]] = [
    ("z1_mid_window", 1, case.RUNS["z1_w2"][2], 4, False),
    ("z2_mid_window", 2, ZF, 6, False),
    ("z2_bf16_host_moments", 2, dict(ZF, offload=True), 6, True),
    ("z3_mid_window", 3, ZF, 6, False),
    ("z3_after_update", 3, ZF, 5, False),
    ("z3_bf16_host_moments", 3, dict(ZF, offload=True), 6, True),
    ("z2_auto_update", 2, dict(ZF, update_interval="auto", auto_ratio=1.0), 5, False),
    ("z3_auto_update", 3, dict(ZF, update_interval="auto", auto_ratio=1.0), 5, False),
]


def _engine(world: int, stage: int, zenflow: dict[str, Any], seed: int, bf16: bool) -> Any:
    torch.manual_seed(seed)
    model = case.Net()
    config = case.config(world, stage, zenflow)
    config["zero_optimization"]["overlap_comm"] = True
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = ds_engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(engine(x.to(engine.module.fc1.weight.dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _weights(engine: Any) -> list[torch.Tensor]:
    if engine.zero_optimization_stage() == 3:
        import ds_zero

        with ds_zero.GatheredParameters(list(engine.module.parameters())):
            return [p.detach().clone() for p in engine.module.parameters()]
    return [p.detach().clone() for p in engine.module.parameters()]


def _failed_save_keeps_the_last_good_one(engine: Any, root: str) -> None:
    """A save whose optimizer state cannot be taken (on every rank) raises and publishes nothing."""

    def broken() -> dict[str, Any]:
        raise RuntimeError("the optimizer state could not be taken")

    engine.optimizer.state_dict = broken
    with pytest.raises(RuntimeError, match="could not be taken"):
        engine.save_checkpoint(root, tag="bad")
    del engine.optimizer.state_dict
    assert (Path(root) / "latest").read_text().strip() == "k"


def _gaps(rank: int, world: int, root: str) -> dict[str, tuple[float, float]]:
    batches = case.batches(rank)
    out = {}
    for name, stage, zenflow, k, bf16 in CASES:
        whole = _engine(world, stage, zenflow, 1234, bf16)
        whole_losses = _train(whole, batches)
        whole_weights = _weights(whole)
        whole.destroy()
        first = _engine(world, stage, zenflow, 1234, bf16)
        _train(first, batches[:k])
        first.save_checkpoint(f"{root}/{name}", tag="k")
        _failed_save_keeps_the_last_good_one(first, f"{root}/{name}")
        first.destroy()
        resumed = _engine(world, stage, zenflow, 99, bf16)  # other weights: all of it must come from the checkpoint
        path, _ = resumed.load_checkpoint(f"{root}/{name}")  # `latest`: still "k"
        assert path is not None and resumed.micro_steps == k
        assert type(resumed.optimizer).__name__.startswith("ZenFlowZeroOptimizer")
        losses = _train(resumed, batches[k:])
        loss_gap = max(abs(a - b) for a, b in zip(losses, whole_losses[k:], strict=True))
        weight_gap = max(float((a - b).abs().max()) for a, b in zip(_weights(resumed), whole_weights, strict=True))
        resumed.destroy()
        out[name] = (loss_gap, weight_gap)
        if name == "z3_mid_window":  # the weights alone: ZenFlow's schedule goes on from the engine's count
            fresh = _engine(world, stage, zenflow, 99, bf16)
            fresh.load_checkpoint(f"{root}/{name}", load_optimizer_states=False)
            assert fresh.micro_steps == k and fresh.optimizer.micro_step == k - 1
            assert all(math.isfinite(loss) for loss in _train(fresh, batches[k:]))
            fresh.destroy()
    return out


def test_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    results = run_ranks(2, _gaps, str(tmp_path), timeout_s=480)
    for rank, gaps in enumerate(results):
        for name, (loss_gap, weight_gap) in gaps.items():
            assert loss_gap == 0.0 and weight_gap == 0.0, f"{name} rank {rank}: {loss_gap:.2e} {weight_gap:.2e}"
