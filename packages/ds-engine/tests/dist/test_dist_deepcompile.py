"""DeepCompile (`compile.deepcompile: true` + `engine.compile()`) on 2 gloo ranks against the same job eager.

ZeRO-3: the gathers and releases the passes place run inside the compiled forward and backward graphs
(the FX graphs run as Python, `backend="eager"`, to keep compile time short; `test_zero3_inductor` is the
same check through inductor's CPU code, skipped unless DS_TEST_INDUCTOR=1). Each job trains 10 steps with
gradient accumulation 2 and clipping; per-micro-step losses and final weights must match the eager run to
1e-4. Also: bf16 with torch's (non-reentrant) activation checkpointing, the schedule (every
gather has its release), a graph break (DeepSpeed's reentrant checkpointing) falling back to the eager
hooks with a warning naming the place, and a checkpoint saved by a DeepCompile run resuming exactly.
Selective unsharding after the 5 warm-up steps: with the host's headroom every parameter is kept whole
and the last 5 steps gather nothing; with a headroom set for the test, the smallest parameters that fit
(the three biases) are kept whole and only the weights are gathered; with none, nothing changes.

ZeRO 1 and 2: `test_dist_deepcompile_z12.py`.

Dynamo's first compile in a process costs most of the time (about a minute on a loaded 2-core host), so
every case runs in one pair of rank processes (`results`, module scope) and the tests read its parts.
"""

from __future__ import annotations

import dataclasses
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
WARMUP = 5  # DeepSpeed's warm-up steps before selective unsharding


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


def _run(
    stage: int,
    deepcompile: bool,
    backend: str,
    rank: int,
    checkpointing: str | None,
    bf16: bool,
    headroom: int | None = None,
    evaluate: bool = False,
) -> Any:
    import ds_engine
    from ds_zero._compile import selective
    from ds_zero._compile.ops import stats

    torch._dynamo.reset()  # each engine compiles its own backend; a fresh cache keeps under the recompile limit
    torch.manual_seed(0)
    engine, *_ = ds_engine.initialize(model=Net(checkpointing), config=_config(stage, deepcompile, bf16))
    engine.compile(backend=backend)
    stats.reset()
    batches = [(x.bfloat16() if bf16 else x, y) for x, y in _batches(rank, STEPS)]
    measured = selective.memory_headroom
    if headroom is not None:  # the test's budget in place of this host's memory
        selective.memory_headroom = lambda *_: headroom
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _train(engine, batches[: WARMUP * GAS])
            warmup = dataclasses.replace(stats)
            if evaluate:  # an evaluation forward (no grad) does not make the choice: some ranks may skip it
                with torch.no_grad():
                    engine(*batches[0])
                evaluated_before_choice = engine._dc_unshard_plan is None
            losses += _train(engine, batches[WARMUP * GAS :])
    finally:
        selective.memory_headroom = measured
    return {
        "losses": losses,
        "warmup_gathers": warmup.gathers,
        "evaluated_before_choice": evaluated_before_choice if evaluate else None,
        "warmup_collectives": warmup.collectives,
        "whole": [n for n, p in engine.module.named_parameters() if getattr(p, "ds_persist", False)],
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


#: name -> (stage, backend, activation checkpointing, bf16[, selective unsharding's headroom in bytes,
#: an evaluation forward after the warm-up])
CASES = {
    "zero3": (3, "eager", None, False),
    "zero3_biases_whole": (3, "eager", None, False, 200),  # 16 + 64 + 64 bytes fit; c.weight's 256 do not
    "zero3_no_headroom": (3, "eager", None, False, 0, True),  # and an evaluation forward after the warm-up
    "zero3_bf16_checkpointing": (3, "eager", "torch", True),
    "zero3_graph_break": (3, "eager", "deepspeed", False),
}


def _pair(rank: int, case: tuple[Any, ...]) -> tuple[Any, Any]:
    stage, backend, checkpointing, bf16, *headroom = case
    eager = _run(stage, False, "eager", rank, checkpointing, bf16)
    return eager, _run(stage, True, backend, rank, checkpointing, bf16, *headroom)


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
        assert dc["warmup_gathers"] == 8 * WARMUP * GAS
        assert dc["warmup_collectives"] == 5 * WARMUP * GAS
        assert dc["max_inflight"] == 2  # the bucket in use and the one ahead, never more
        # selective unsharding: this host has room for the whole model, so after the warm-up every parameter
        # is kept whole, the module is compiled again without gathers, and nothing more is gathered
        assert sorted(dc["whole"]) == sorted(dc["weights"]), dc["whole"]
        assert dc["gathers"] == dc["releases"] == dc["warmup_gathers"]
        assert "forward 1: 0 gathers, 0 releases" in schedule and "backward 1: 0 gathers, 0 releases" in schedule
        assert dc["schedule"][-1].startswith("selective unsharding: 6 of 6 partitioned parameters kept whole"), schedule
        # memory: the forward holds one layer's weight and bias plus the next layer's (eager ZeRO-3 holds
        # one module's, with its prefetch the next one's), the backward one weight plus the next
        assert dc["held"] == {"forward 0": 4, "backward 0": 2, "forward 1": 0, "backward 1": 0}
        assert eager["gathers"] == 0  # the eager run never used the graph ops


@pytest.mark.timeout(600)
def test_selective_unsharding_keeps_the_smallest_that_fit(results: list[dict[str, Any]]) -> None:
    for rank in results:
        eager = rank["zero3"][0]
        dc = rank["zero3_biases_whole"][1]
        _close(dc, eager)
        assert sorted(dc["whole"]) == ["a.bias", "b.bias", "c.bias"]
        schedule = "\n".join(dc["schedule"])
        assert "selective unsharding: 3 of 6 partitioned parameters kept whole" in schedule, schedule
        # after the warm-up the forward gathers the three weights, the backward b's and c's weights
        assert "forward 1: 3 gathers, 3 releases" in schedule and "backward 1: 2 gathers, 2 releases" in schedule
        assert dc["gathers"] - dc["warmup_gathers"] == 5 * (STEPS - WARMUP) * GAS

        none = rank["zero3_no_headroom"][1]
        _close(none, eager)
        assert none["evaluated_before_choice"] is True
        assert none["whole"] == [] and none["gathers"] == 8 * STEPS * GAS + 6  # the evaluation gathered 6
        assert none["schedule"][-1].startswith("selective unsharding: 0 of 6"), none["schedule"]
        assert not any(line.startswith("backward 1") for line in none["schedule"])  # not compiled again


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
        assert dc["warmup_gathers"] == 8 * WARMUP * GAS and dc["gathers"] == dc["releases"] == dc["warmup_gathers"]
