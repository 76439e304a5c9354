"""DeepCompile at ZeRO stages 1 and 2 on 2 gloo ranks: gradient reduction placed in the backward graph.

Each DeepCompile job trains 10 steps (gradient accumulation 2, clipping 0.5) against the same job eager;
per-micro-step losses and final weights must match to 1e-4, in fp32 and in bf16. The backward graph
hands every trainable parameter's gradient to ZeRO's reducer once (`engine.deepcompile_schedule` lists
one reduction per parameter, each after the node producing its gradient): the reducer is entered once
per parameter per micro-step (stage 2 counts its bucket copies, both paths go through one method), the
graph op ran as often, and the gradients the reducer holds at the first boundary equal the eager
ones (a second reduction would double them). A graph break met later (a recompile) falls back to the eager
hooks with a warning naming where, hands every parameter back to its hook, and trains on unchanged; a
checkpoint saved by a DeepCompile run resumes exactly. The graphs run as Python (backends "eager" and
"aot_eager") to keep compile time short; all cases run in one pair of rank processes.
"""

from __future__ import annotations

import importlib.util
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
BREAK_AT = 3  # the graph-break case breaks the graph from this optimizer step on
NUM_PARAMS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.graph_break = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.graph_break:  # a guard on the attribute: Dynamo recompiles and meets the break
            torch._dynamo.graph_break()
        h = torch.tanh(self.b(h)) + h
        return nn.functional.mse_loss(self.c(h).float(), y)


def _config(stage: int, deepcompile: bool, bf16: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},  # several buckets
        "compile": {"deepcompile": deepcompile},
        "bf16": {"enabled": bf16},
    }


def _batches(rank: int, bf16: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    out = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(STEPS * GAS)]
    return [(x.bfloat16() if bf16 else x, y) for x, y in out]


def _engine(stage: int, deepcompile: bool, bf16: bool, backend: str) -> Any:
    import ds_engine

    torch._dynamo.reset()
    torch.manual_seed(0)
    engine, *_ = ds_engine.initialize(model=Net(), config=_config(stage, deepcompile, bf16))
    if deepcompile:
        engine.compile(backend=backend)
    return engine


def _held_grads(engine: Any) -> list[torch.Tensor]:
    """What the reducer holds at the boundary before `step()`: stage 1 the local flat gradients (reduced in
    `step()`), stage 2 the reduced gradient partitions."""
    grads = engine.optimizer._grads
    held = grads.flat_grads if engine.zero_optimization_stage() == 1 else grads.accumulators
    return [g.detach().float().clone() for g in held]


def _train(engine: Any, batches: list[Any], *, break_at: int | None = None) -> dict[str, Any]:
    from ds_zero._compile.reduce_ops import reduce_stats

    reducer = engine.optimizer._grads
    entered = {"n": 0}
    method = "_take_grad" if engine.zero_optimization_stage() == 2 else "accept_graph_grad"
    original = getattr(reducer, method)

    def counted(*args: Any, **kwargs: Any) -> None:
        entered["n"] += 1
        original(*args, **kwargs)

    setattr(reducer, method, counted)
    reduce_stats.reset()
    losses, held, before_break = [], None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches):
            if break_at is not None and i == break_at * GAS:
                before_break = reduce_stats.reductions
                engine.module.graph_break = True
            loss = engine(x, y)
            engine.backward(loss)
            if i == GAS - 1:
                held = _held_grads(engine)
            engine.step()
            losses.append(float(loss))
    return {
        "losses": losses,
        "weights": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        "held": held,
        "entered": entered["n"],
        "reductions": reduce_stats.reductions,
        "before_break": before_break,
        "schedule": engine.deepcompile_schedule,
        "active": engine.is_deepcompile_active(),
        "owned": [n for n, p in engine.module.named_parameters() if reducer.owned_by_graph(p)],
        "warnings": [str(w.message) for w in caught if "DeepCompile" in str(w.message)],
    }


def _resume(stage: int, rank: int, path: str) -> list[float]:
    batches = _batches(rank, False)
    half = len(batches) // 2
    first = _engine(stage, True, False, "eager")
    _train(first, batches[:half])
    first.save_checkpoint(path, tag=f"z{stage}")
    second = _engine(stage, True, False, "eager")
    second.load_checkpoint(path, tag=f"z{stage}")
    return _train(second, batches[half:])["losses"]


def _job(rank: int, world: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage, backend in ((1, "eager"), (2, "aot_eager")):
        for bf16 in (False, True):
            batches = _batches(rank, bf16)
            eager = _train(_engine(stage, False, bf16, backend), batches)
            out[(stage, bf16)] = eager, _train(_engine(stage, True, bf16, backend), batches)
        out[(stage, "break")] = _train(_engine(stage, True, False, backend), _batches(rank, False), break_at=BREAK_AT)
        out[(stage, "resume")] = _resume(stage, rank, path)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_ranks(2, _job, str(tmp_path_factory.mktemp("dc_z12_ckpt")), timeout_s=580)


def _close(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert len(a["losses"]) == len(b["losses"]) == STEPS * GAS
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        assert abs(x - y) <= TOL, f"micro-step {i}: {x} vs {y}"
    for name, w in a["weights"].items():
        torch.testing.assert_close(w, b["weights"][name], atol=TOL, rtol=0, msg=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_deepcompile_trains_as_eager(results: list[dict[Any, Any]], stage: int, bf16: bool) -> None:
    for rank in results:
        eager, dc = rank[(stage, bf16)]
        _close(dc, eager)
        assert dc["active"] and not dc["warnings"] and dc["owned"] == list(eager["weights"])
        # each gradient reaches the reducer once per micro-step, from the graph (eager: from the hooks)
        assert dc["reductions"] == dc["entered"] == NUM_PARAMS * STEPS * GAS
        # stage 2's hooks enter the same method (stage 1's hooks only mark a backward, autograd accumulates)
        assert eager["entered"] == (NUM_PARAMS * STEPS * GAS if stage == 2 else 0)
        assert eager["reductions"] == 0
        for ours, ref in zip(dc["held"], eager["held"], strict=True):
            torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2])
def test_schedule_lists_one_reduction_per_parameter(results: list[dict[Any, Any]], stage: int) -> None:
    for rank in results:
        lines = rank[(stage, False)][1]["schedule"]
        assert lines[0] == f"step 0: zero{stage}_compile", lines
        assert lines[1] == f"backward 0: {NUM_PARAMS} gradient reductions", lines
        placed = [line.split()[2] for line in lines[2:]]
        assert sorted(placed) == sorted(rank[(stage, False)][0]["weights"]), lines
        # each right after the node producing its gradient
        assert all(" reduce  " in line and " after " in line for line in lines[2:]), lines
        positions = [int(line.split()[0]) for line in lines[2:]]
        assert positions == sorted(positions) and len(set(positions)) == NUM_PARAMS


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2])
def test_graph_break_falls_back_to_the_hooks(results: list[dict[Any, Any]], stage: int) -> None:
    for rank in results:
        eager = rank[(stage, False)][0]
        broken = rank[(stage, "break")]
        _close(broken, eager)
        (message,) = broken["warnings"]
        assert f"ZeRO-{stage} runs with its eager hooks" in message, message
        assert "graph_break" in message, message  # names where
        assert not broken["active"] and broken["owned"] == [] and broken["schedule"] == []
        # the graph reduced until the break, the hooks from then on; every gradient entered once
        assert broken["reductions"] == broken["before_break"] == NUM_PARAMS * BREAK_AT * GAS
        assert broken["entered"] == NUM_PARAMS * (STEPS if stage == 2 else BREAK_AT) * GAS


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_resume(results: list[dict[Any, Any]], stage: int) -> None:
    for rank in results:
        straight = rank[(stage, False)][1]["losses"]
        assert rank[(stage, "resume")] == pytest.approx(straight[len(straight) // 2 :], abs=TOL)
