"""DeepCompile (`compile.deepcompile: true` + `engine.compile()`) on 2 gloo ranks against the same job eager.

ZeRO-3: the gathers and releases the passes place run inside the compiled forward and backward graphs
(the FX graphs run as Python, `backend="eager"`, to keep compile time short; `test_zero3_inductor` is the
same check through inductor's CPU code, skipped unless DS_TEST_INDUCTOR=1). Each job trains 10 steps with
gradient accumulation 2 and clipping; per-micro-step losses and final weights must match the eager run to
1e-4. Also: bf16 with torch's (non-reentrant) activation checkpointing, ZeRO 1 and 2, the schedule (every
gather has its release), a graph break (DeepSpeed's reentrant checkpointing) falling back to the eager
hooks with a warning naming the place, and a checkpoint saved by a DeepCompile run resuming exactly.

Dynamo's first compile in a process costs most of the time (about a minute on a loaded 2-core host), so
every case runs in one pair of rank processes (`results`, module scope) and the tests read its parts.
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings
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
    def __init__(self, checkpointing: str | None = None) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def _middle(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(h)) + h

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.checkpointing == "torch":
            h = torch.utils.checkpoint.checkpoint(self._middle, h, use_reentrant=False)
        elif self.checkpointing == "deepspeed":  # reentrant: Dynamo cannot capture it (a graph break)
            from ds_engine import checkpointing

            h = checkpointing.checkpoint(self._middle, h)
        else:
            h = self._middle(h)
        return nn.functional.mse_loss(self.c(h).float(), y)


def _config(stage: int, deepcompile: bool, bf16: bool = False) -> dict[str, Any]:
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
        "bf16": {"enabled": bf16},
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


def _run(stage: int, deepcompile: bool, backend: str, rank: int, checkpointing: str | None, bf16: bool) -> Any:
    import ds_engine
    from ds_zero._compile.ops import stats

    torch._dynamo.reset()  # each engine compiles its own backend; a fresh cache keeps under the recompile limit
    torch.manual_seed(0)
    engine, *_ = ds_engine.initialize(model=Net(checkpointing), config=_config(stage, deepcompile, bf16))
    engine.compile(backend=backend)
    stats.reset()
    batches = [(x.bfloat16() if bf16 else x, y) for x, y in _batches(rank, STEPS)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(engine, batches)
    return {
        "losses": losses,
        "weights": _weights(engine),
        "schedule": engine.deepcompile_schedule,
        "held": {}
        if engine._dc_backend is None
        else {name: engine._dc_backend.schedule.max_gathered(name) for name in engine._dc_backend.schedule.graphs},
        "active": engine.is_deepcompile_active(),
        "gathers": stats.gathers,
        "releases": stats.releases,
        "collectives": stats.collectives,
        "max_inflight": stats.max_inflight,
        "warnings": [str(w.message) for w in caught if "DeepCompile" in str(w.message)],
    }


#: name -> (stage, backend, activation checkpointing, bf16)
CASES = {
    "zero3": (3, "eager", None, False),
    "zero3_bf16_checkpointing": (3, "eager", "torch", True),
    "zero3_graph_break": (3, "eager", "deepspeed", False),
    "zero2": (2, "aot_eager", None, False),
    "zero1": (1, "eager", None, False),
}


def _pair(rank: int, case: tuple[int, str, str | None, bool]) -> tuple[Any, Any]:
    stage, backend, checkpointing, bf16 = case
    eager = _run(stage, False, "eager", rank, checkpointing, bf16)
    return eager, _run(stage, True, backend, rank, checkpointing, bf16)


def _resume(rank: int, path: str) -> tuple[list[float], list[float]]:
    import ds_engine

    batches = _batches(rank, STEPS)
    half = len(batches) // 2

    def fresh() -> Any:
        torch._dynamo.reset()
        torch.manual_seed(0)
        engine, *_ = ds_engine.initialize(model=Net(), config=_config(3, True))
        engine.compile(backend="eager")
        return engine

    full = _train(fresh(), batches)
    first = fresh()
    _train(first, batches[:half])
    first.save_checkpoint(path, tag="half")
    second = fresh()
    second.load_checkpoint(path, tag="half")
    return full[half:], _train(second, batches[half:])


def _job(rank: int, world: int, cases: dict[str, Any], path: str | None) -> dict[str, Any]:
    """Every case's eager job and DeepCompile job, one after the other in the same ranks (one warm-up)."""
    out: dict[str, Any] = {name: _pair(rank, case) for name, case in cases.items()}
    if path is not None:
        out["resume"] = _resume(rank, path)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("deepcompile_ckpt"))
    return run_ranks(2, _job, CASES, path, timeout_s=560)


def _close(a: dict[str, Any], b: dict[str, Any], tol: float = TOL) -> None:
    assert len(a["losses"]) == len(b["losses"]) == STEPS * GAS
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        assert abs(x - y) <= tol, f"micro-step {i}: {x} vs {y}"
    for name, w in a["weights"].items():
        torch.testing.assert_close(w.float(), b["weights"][name].float(), atol=tol, rtol=0, msg=name)


@pytest.mark.timeout(600)
def test_zero3_deepcompile_matches_eager(results: list[dict[str, Any]]) -> None:
    for rank in results:
        eager, dc = rank["zero3"]
        _close(dc, eager)
        assert dc["active"] and not dc["warnings"]
        # every parameter is gathered in the forward graph and released in it; the backward re-gathers
        # the two weights it needs for input gradients; the ops ran that often, every micro-step
        schedule = "\n".join(dc["schedule"])
        # each Linear's weight and bias travel in one collective (3 in the forward, 2 in the backward)
        assert "forward 0: 6 gathers, 6 releases, 3 asynchronous collectives" in schedule, schedule
        assert "backward 0: 2 gathers, 2 releases, 2 asynchronous collectives" in schedule, schedule
        # b's bucket is started one bucket ahead: right after a.weight is complete, before a is used
        assert re.search(
            r"gather  a.weight .* before t\n.*prefetch b.weight .* after allgather_wait_default\n"
            r".*prefetch b.bias .*\n.*gather  a.bias .* before addmm\n",
            schedule,
        ), schedule
        assert re.search(r"gather  b.weight .* before t_1\n(.*\n){3}.*release b.weight .* after addmm_1", schedule)
        assert dc["gathers"] == dc["releases"] == 8 * STEPS * GAS
        assert dc["collectives"] == 5 * STEPS * GAS
        assert dc["max_inflight"] == 2  # the bucket in use and the one ahead, never more
        # memory: the forward holds one layer's weight and bias plus the next layer's (eager ZeRO-3 holds
        # one module's, with its prefetch the next one's), the backward one weight plus the next
        assert dc["held"] == {"forward 0": 4, "backward 0": 2}
        assert eager["gathers"] == 0  # the eager run never used the graph ops


@pytest.mark.timeout(600)
def test_zero3_bf16_with_activation_checkpointing(results: list[dict[str, Any]]) -> None:
    for rank in results:
        eager, dc = rank["zero3_bf16_checkpointing"]
        _close(dc, eager)
        assert dc["active"] and not dc["warnings"] and dc["gathers"] == dc["releases"] > 0


@pytest.mark.timeout(600)
def test_graph_break_falls_back_with_warning(results: list[dict[str, Any]]) -> None:
    for rank in results:
        eager, dc = rank["zero3_graph_break"]
        _close(dc, eager)
        assert not dc["active"] and dc["gathers"] == 0
        (message,) = dc["warnings"]
        assert "eager hooks" in message
        assert "checkpointing.py" in message, message  # names where the graph breaks


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_deepcompile_matches_eager(results: list[dict[str, Any]], stage: int) -> None:
    for rank in results:
        eager, dc = rank[f"zero{stage}"]
        _close(dc, eager)
        assert dc["active"] and not dc["schedule"]


@pytest.mark.timeout(600)
def test_zero3_deepcompile_checkpoint_resume(results: list[dict[str, Any]]) -> None:
    for rank in results:
        straight, resumed = rank["resume"]
        assert resumed == pytest.approx(straight, abs=TOL)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("DS_TEST_INDUCTOR"), reason="slow (inductor compiles C++); DS_TEST_INDUCTOR=1")
def test_zero3_inductor() -> None:
    for rank in run_ranks(2, _job, {"zero3": CASES["zero3"][:1] + ("inductor", None, False)}, None, timeout_s=580):
        eager, dc = rank["zero3"]
        _close(dc, eager)
        assert dc["gathers"] == dc["releases"] == 8 * STEPS * GAS
