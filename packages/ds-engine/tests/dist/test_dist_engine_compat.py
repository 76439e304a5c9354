"""On 2 gloo ranks: engine.compile() at ZeRO stages 0-3 gives the eager losses; allreduce_gradients() reduces
once (the step does not reduce again); the process-layout attributes libraries read."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 24)
        self.b = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 10, generator=g), torch.randn(4, 5, generator=g)) for _ in range(6)]


def _compiled_vs_eager(rank: int, world: int, stage: int) -> tuple[list[float], list[float]]:
    import ds_engine as deepspeed

    def run(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        with deepspeed.zero.Init() if stage == 3 else contextlib.nullcontext():
            model = Net()
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        if compiled:
            engine.compile(backend="aot_eager")
        losses = []
        for x, y in _data(rank):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    torch._dynamo.reset()
    return run(True), run(False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_module_trains_as_eager(stage: int) -> None:
    pytest.importorskip("ds_zero")
    for compiled, eager in run_ranks(2, _compiled_vs_eager, stage=stage, timeout_s=240):
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)


def _allreduce(rank: int, world: int, explicit: bool) -> dict[str, object]:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
        "gradient_allreduce_op": "sum",  # a second reduction of summed gradients doubles them: visible
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    grads = []
    for x, y in _data(rank):
        engine.backward(engine(x, y))
        if explicit:
            boundary = engine.is_gradient_accumulation_boundary()
            engine.allreduce_gradients()
            if boundary:
                grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        engine.step()
    layout = {
        "group_is_world": engine.data_parallel_group is torch.distributed.group.WORLD,
        "backend": engine.dist_backend,
        "dp": engine.dp_world_size,
    }
    return {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "grads": grads, **layout}


def test_allreduce_gradients_reduces_once() -> None:
    explicit = run_ranks(2, _allreduce, explicit=True, timeout_s=120)
    implicit = run_ranks(2, _allreduce, explicit=False, timeout_s=120)
    for rank in range(2):
        # the step after an explicit reduction must not reduce again
        assert torch.equal(explicit[rank]["weights"], implicit[rank]["weights"])
        assert explicit[rank]["group_is_world"] and explicit[rank]["backend"] == "gloo" and explicit[rank]["dp"] == 2
    assert len(explicit[0]["grads"]) == 3
    for g0, g1 in zip(explicit[0]["grads"], explicit[1]["grads"], strict=True):
        assert torch.equal(g0, g1)  # every rank holds the reduced gradient right after the call
