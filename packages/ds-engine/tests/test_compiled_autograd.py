"""`engine.compile(compiled_autograd_enabled=True)`: each `engine.backward` runs under torch's compiled autograd
(its autograd graph captured and compiled), training exactly like eager, at ZeRO stages 0 and 1; refused naming
the stage at 2 and 3 (their gradient hooks queue autograd callbacks); with DeepCompile it is ignored with a
warning, as DeepSpeed does."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_comm.testing import run_ranks

needs_zero = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero (ZeRO configs)")


def _train(config: dict[str, Any], *, compiled_autograd: bool, rank: int = 0) -> tuple[list[float], int]:
    """Losses of 6 steps, and how many backward graphs compiled autograd captured meanwhile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    engine = make_engine(tiny_net(0), config)
    if compiled_autograd:
        engine.compile(backend="aot_eager", compiled_autograd_enabled=True)
    before = counters["compiled_autograd"]["captures"]
    losses = []
    for x, y in batches(6, 4, seed=1 + rank):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, counters["compiled_autograd"]["captures"] - before


def test_stage0_backward_is_captured_and_trains_like_eager() -> None:
    eager, none = _train(base_config(), compiled_autograd=False)
    compiled, captures = _train(base_config(), compiled_autograd=True)
    assert none == 0 and captures >= 1
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


def _zero(rank: int, world: int, stage: int) -> dict[str, Any]:
    del world
    config = base_config(zero_optimization={"stage": stage}, gradient_clipping=0.5)
    eager, _ = _train(config, compiled_autograd=False, rank=rank)
    compiled, captures = _train(config, compiled_autograd=True, rank=rank)
    return {"eager": eager, "compiled": compiled, "captures": captures}


@needs_zero
@pytest.mark.timeout(300)
def test_zero1_trains_like_eager_under_compiled_autograd() -> None:
    for r in run_ranks(2, _zero, 1, timeout_s=260):
        assert r["captures"] >= 1, r
        assert r["compiled"] == pytest.approx(r["eager"], rel=1e-5, abs=1e-6), r


def _refusal(rank: int, world: int, stage: int) -> str:
    del rank, world
    engine = make_engine(tiny_net(0), base_config(zero_optimization={"stage": stage}))
    try:
        engine.compile(backend="aot_eager", compiled_autograd_enabled=True)
    except ValueError as err:
        return f"{err} | compiled={engine.is_compiled}"
    return "not refused"


@needs_zero
@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_3_refuse_it_naming_the_stage_before_compiling(stage: int) -> None:
    for message in run_ranks(2, _refusal, stage, timeout_s=160):
        assert f"zero_optimization.stage={stage}" in message and "compiled=False" in message, message


def test_with_deepcompile_it_is_ignored_with_a_warning() -> None:
    engine = make_engine(tiny_net(0), base_config(compile={"deepcompile": True}))
    with pytest.warns(UserWarning, match="compiled_autograd_enabled=True. is ignored: DeepCompile"):
        engine.compile(backend="aot_eager", compiled_autograd_enabled=True)
    assert engine.is_compiled and engine._autograd_compiler is None
