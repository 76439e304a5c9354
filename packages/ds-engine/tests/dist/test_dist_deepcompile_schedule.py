"""A DeepCompile pass schedule at ZeRO-3 (`engine.compile(schedule=...)`) on 2 gloo ranks against eager ZeRO-3.

The schedule `[(0, [zero3_compile]), (2, [zero3_compile, prefetch]), (4, [zero3_compile, prefetch,
selective_gather])]` runs 8 optimizer steps (gradient accumulation 2, clipping): blocking gathers in the
graphs for steps 0-1 (no asynchronous collective), bucketed asynchronous gathers from step 2, and at step 4
selective unsharding (with a headroom set for the test: the three biases fit) and a recompile without
their gathers. Per-micro-step losses and final weights must match the eager run to 1e-4, and
`engine.deepcompile_schedule` shows each step's passes with the graphs compiled under it. The graphs run
as Python (`backend="eager"`) to keep compile time short.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero")

TOL = 1e-4
STEPS = 8
GAS = 2
HEADROOM = 200  # bytes: the biases (16 + 64 + 64) fit, c.weight's 256 do not


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.tanh(self.b(h)) + h
        return nn.functional.mse_loss(self.c(h), y)


def _config(deepcompile: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "compile": {"deepcompile": deepcompile},
    }


def _schedule() -> list[tuple[int, list[Any]]]:
    from ds_engine.compile.passes import prefetch, selective_gather, zero3_compile

    # names and DeepSpeed's callables mixed, as DeepSpeed's scripts write them
    return [
        (0, [zero3_compile.add_z3_gather_release]),
        (2, ["zero3_compile", prefetch.schedule_prefetch]),
        (4, ["zero3_compile", "prefetch", selective_gather.selective_gather]),
    ]


def _run(rank: int, deepcompile: bool) -> dict[str, Any]:
    import ds_engine
    import ds_zero
    from ds_zero._compile import selective
    from ds_zero._compile.ops import stats

    torch._dynamo.reset()
    torch.manual_seed(0)
    engine, *_ = ds_engine.initialize(model=Net(), config=_config(deepcompile))
    if deepcompile:
        engine.compile(backend="eager", schedule=_schedule())
    stats.reset()
    g = torch.Generator().manual_seed(10 + rank)
    losses, per_step = [], []
    measured = selective.memory_headroom
    selective.memory_headroom = lambda *_: HEADROOM
    try:
        for _ in range(STEPS):
            for _ in range(GAS):
                x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            per_step.append(dataclasses.replace(stats))
    finally:
        selective.memory_headroom = measured
    params = list(engine.module.parameters())
    with ds_zero.GatheredParameters(params):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        "losses": losses,
        "weights": weights,
        "schedule": engine.deepcompile_schedule,
        "collectives": [s.collectives for s in per_step],  # cumulative, after each optimizer step
        "gathers": [s.gathers for s in per_step],
        "whole": sorted(n for n, p in engine.module.named_parameters() if p.ds_persist),
        "active": engine.is_deepcompile_active(),
    }


def _job(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return _run(rank, False), _run(rank, True)


@pytest.mark.timeout(600)
def test_zero3_schedule_trains_as_eager_and_applies_each_step() -> None:
    for eager, dc in run_ranks(2, _job, timeout_s=560):
        assert len(dc["losses"]) == STEPS * GAS
        for i, (x, y) in enumerate(zip(dc["losses"], eager["losses"], strict=True)):
            assert abs(x - y) <= TOL, f"micro-step {i}: {x} vs {y}"
        for name, w in eager["weights"].items():
            torch.testing.assert_close(dc["weights"][name], w, atol=TOL, rtol=0, msg=name)
        assert dc["active"]
        # steps 0-1: every gather a blocking collective in place; from step 2 the buckets start ahead
        assert dc["collectives"][:2] == [0, 0] and dc["collectives"][2] > 0
        assert dc["gathers"][1] == 8 * 2 * GAS  # 6 in each forward, 2 in each backward
        # from step 4 only the weights are gathered (the biases are whole): 3 in the forward, 2 in the backward
        assert dc["gathers"][-1] - dc["gathers"][3] == 5 * (STEPS - 4) * GAS
        assert dc["whole"] == ["a.bias", "b.bias", "c.bias"]
        lines = dc["schedule"]
        heads = [i for i, line in enumerate(lines) if line.startswith("step ")]
        assert [lines[i] for i in heads] == [
            "step 0: zero3_compile",
            "step 2: zero3_compile, prefetch",
            "step 4: zero3_compile, prefetch, selective_gather",
        ]
        step0, step2, step4 = ("\n".join(lines[a:b]) for a, b in zip(heads, [*heads[1:], len(lines)], strict=True))
        assert "forward 0: 6 gathers, 6 releases, 0 asynchronous collectives" in step0, step0
        assert "backward 0: 2 gathers, 2 releases, 0 asynchronous collectives" in step0, step0
        assert " prefetch " not in step0
        assert "forward 1: 6 gathers, 6 releases, 3 asynchronous collectives" in step2, step2
        assert "backward 1: 2 gathers, 2 releases, 2 asynchronous collectives" in step2, step2
        assert "forward 2: 3 gathers, 3 releases" in step4 and "backward 2: 2 gathers, 2 releases" in step4, step4
        assert lines[-1].startswith("selective unsharding: 3 of 6 partitioned parameters kept whole"), lines
