"""DeepCompile (`compile.deepcompile: true` + `engine.compile()`) on 2 gloo ranks against the same job eager.

ZeRO-3: the gathers and releases the passes place run inside the compiled forward and backward graphs
(the FX graphs run as Python, `backend="eager"`, to keep compile time short; `test_inductor` is the
same check through inductor's CPU code and is marked slow). Each job trains 10 steps with gradient
accumulation 2 and clipping; the per-step losses must match the eager ZeRO-3 run to 1e-4 and the final
weights to 1e-4. Also: the schedule is visible and balanced (every gather has a release in its graph),
a graph break falls back to the eager hooks with a warning that names the place, ZeRO-2 with
DeepCompile trains like eager, and a ZeRO-3 checkpoint saved by a DeepCompile run resumes exactly.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero")

TOL = 1e-4
STEPS = 10
GAS = 2


class Net(nn.Module):
    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.graph_break = graph_break
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        h = torch.tanh(self.b(h)) + h
        return nn.functional.mse_loss(self.c(h), y)


def _config(stage: int, deepcompile: bool, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        "compile": {"deepcompile": deepcompile, "debug_log": deepcompile},
        **extra,
    }


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(steps * GAS)]


def _train(engine: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    import ds_zero

    params = list(engine.module.parameters())
    with ds_zero.GatheredParameters(params) if engine.zero_optimization_stage() == 3 else _null():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _run(stage: int, deepcompile: bool, backend: str, rank: int, graph_break: bool) -> dict[str, Any]:
    import ds_engine
    from ds_zero._compile.ops import stats

    torch.manual_seed(0)
    engine, *_ = ds_engine.initialize(model=Net(graph_break), config=_config(stage, deepcompile))
    engine.compile(backend=backend)
    stats.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(engine, _batches(rank, STEPS))
    return {
        "losses": losses,
        "weights": _weights(engine),
        "schedule": engine.deepcompile_schedule,
        "active": engine.is_deepcompile_active(),
        "gathers": stats.gathers,
        "releases": stats.releases,
        "warnings": [str(w.message) for w in caught if "DeepCompile" in str(w.message)],
    }


def _job(rank: int, world: int, stage: int, backend: str, graph_break: bool = False) -> Any:
    """The eager job and the DeepCompile job, one after the other in the same ranks (one start-up)."""
    eager = _run(stage, False, "eager", rank, graph_break)
    return eager, _run(stage, True, backend, rank, graph_break)


def _close(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert len(a["losses"]) == len(b["losses"]) == STEPS * GAS
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        assert abs(x - y) <= TOL, f"micro-step {i}: {x} vs {y}"
    for name, w in a["weights"].items():
        torch.testing.assert_close(w, b["weights"][name], atol=TOL, rtol=0, msg=name)


@pytest.mark.timeout(300)
def test_zero3_deepcompile_matches_eager() -> None:
    for eager, dc in run_ranks(2, _job, 3, "eager", timeout_s=280):
        _close(dc, eager)
        assert dc["active"] and not dc["warnings"]
        # every parameter is gathered in the forward graph and released in it; the backward re-gathers
        # the two weights it needs for input gradients; the ops ran that often, every micro-step
        schedule = "\n".join(dc["schedule"])
        assert "forward 0: 6 gathers, 6 releases" in schedule, schedule
        assert "backward 0: 2 gathers, 2 releases" in schedule, schedule
        assert dc["gathers"] == dc["releases"] == 8 * STEPS * GAS
        assert eager["gathers"] == 0  # the eager run never used the graph ops


@pytest.mark.timeout(300)
def test_graph_break_falls_back_with_warning() -> None:
    for eager, dc in run_ranks(2, _job, 3, "eager", True, timeout_s=280):
        _close(dc, eager)
        assert not dc["active"] and dc["gathers"] == 0
        (message,) = dc["warnings"]
        assert "eager hooks" in message
        assert "test_dist_deepcompile.py" in message, message  # names where the graph breaks


@pytest.mark.timeout(300)
def test_zero2_deepcompile_matches_eager() -> None:
    for eager, dc in run_ranks(2, _job, 2, "aot_eager", timeout_s=280):
        _close(dc, eager)
        assert dc["active"]


@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("DS_TEST_INDUCTOR"), reason="slow (inductor compiles C++); DS_TEST_INDUCTOR=1")
def test_zero3_deepcompile_inductor() -> None:
    for eager, dc in run_ranks(2, _job, 3, "inductor", timeout_s=580):
        _close(dc, eager)
        assert dc["gathers"] == dc["releases"] == 8 * STEPS * GAS


def _resume_job(rank: int, world: int, path: str) -> Any:
    import ds_engine

    batches = _batches(rank, STEPS)
    half = len(batches) // 2

    def fresh() -> Any:
        torch.manual_seed(0)
        engine, *_ = ds_engine.initialize(model=Net(), config=_config(3, True))
        engine.compile(backend="eager")
        return engine

    straight = fresh()
    full = _train(straight, batches)
    first = fresh()
    _train(first, batches[:half])
    first.save_checkpoint(path, tag="half")
    second = fresh()
    second.load_checkpoint(path, tag="half")
    rest = _train(second, batches[half:])
    return full[half:], rest


@pytest.mark.timeout(300)
def test_zero3_deepcompile_checkpoint_resume(tmp_path: Path) -> None:
    for straight, resumed in run_ranks(2, _resume_job, str(tmp_path), timeout_s=280):
        assert resumed == pytest.approx(straight, abs=TOL)
