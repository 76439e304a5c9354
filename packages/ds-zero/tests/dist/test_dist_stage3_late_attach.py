"""A submodule attached after the stage-3 optimizer was built, on 2 gloo ranks, against plain PyTorch.

The late module holds its own (unpartitioned) projection and *shares* a partitioned parameter of the
model (`late.tied is model.body.weight`), registered in its plain-dict `_parameters`. It has no hooks:
the next forward converts its `_parameters` to a `ZeroParamDict`, so reading `self.tied` gathers the
shared weight (without that it would read the released placeholder: NaN). Training runs 4 steps; the
optimizer holds the parameters it was built with (the late module's own projection is not among them,
as in DeepSpeed, where the optimizer is fixed at initialize), so the reference updates the same set.

Reference: one process, the same weights, both ranks' batches, the mean of the two losses (ZeRO
averages gradients over the ranks), SGD. Tolerance: fp32, rtol 1e-5 / atol 1e-6 on every loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks

STEPS, LR = 4, 0.2


class Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.body = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(torch.tanh(self.embed(x))))
        late = self._modules.get("late")
        return h if late is None else late(h)


class Readout(nn.Module):
    """Built after the model was wrapped: its own projection, plus a weight it shares with the model."""

    def __init__(self, tied: nn.Parameter) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 3)
        self.tied = tied

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(h @ self.tied.t()))


def _model() -> Trunk:
    torch.manual_seed(5)
    return Trunk()


def _late(tied: nn.Parameter) -> Readout:
    torch.manual_seed(6)
    return Readout(tied)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _reference(world: int) -> list[list[float]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # before the late module: its projection stays fixed
    model.late = _late(model.body.weight)
    losses = []
    for step in range(STEPS):
        per_rank = []
        for r in range(world):
            x, y = _batch(r, step)
            per_rank.append(nn.functional.mse_loss(model(x), y))
        (sum(per_rank) / world).backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return losses


def _train(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.SGD(model.parameters(), lr=LR), config={"stage": 3, "stage3_param_persistence_threshold": 0}
    )
    model.late = _late(model.body.weight)
    plain = type(model.late._parameters) is dict
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "plain_before": plain,
        "converted": isinstance(model.late._parameters, ds_zero.ZeROOrderedDict),
        "released": model.body.weight.ds_status is ds_zero.ZeroParamStatus.NOT_AVAILABLE,
    }


def test_late_submodule_sharing_a_partitioned_weight_trains_like_plain_pytorch() -> None:
    reference = _reference(2)
    for rank, out in enumerate(run_ranks(2, _train, timeout_s=180)):
        expected = [step[rank] for step in reference]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        assert out["plain_before"] and out["converted"] and out["released"]
