"""A module whose `__getattr__` delegates to the module it wraps trains under stage 3 like plain torch.

Such wrappers (PEFT/LoRA-style) answer attribute reads for names they lack from the wrapped module, so
per-module state that a hook looks up *on the module* could be the wrapped module's. ds's hooks take
their module as a bound argument and keep nothing on it, so wrapper and wrapped each get their own
hooks and the gather/release bookkeeping stays per module. Checked end to end: 5 steps of Adam, world
size 1, losses and final weights against the same model trained by plain torch (fp32, rtol 1e-5 /
atol 1e-6), every partitioned parameter released after each step.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import ds_zero
from ds_zero import GatheredParameters, ZeroParamStatus


class Delegating(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 12)
        self.wrapped = Delegating(nn.Sequential(nn.Linear(12, 12), nn.GELU(), Delegating(nn.Linear(12, 3))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapped(torch.tanh(self.first(x)))


def _train(model: nn.Module, zero: bool) -> list[float]:
    base = torch.optim.Adam(model.parameters(), lr=5e-3)
    opt = (
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config={"stage": 3, "stage3_param_persistence_threshold": 0})
        if zero
        else None
    )
    g = torch.Generator().manual_seed(9)
    losses = []
    for _ in range(5):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        if opt is None:
            loss.backward()
            base.step()
            base.zero_grad()
        else:
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        losses.append(loss.item())
    return losses


def test_delegating_wrappers_train_like_plain_torch() -> None:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ours = _train(model, zero=True)
    theirs = _train(ref, zero=False)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
    with GatheredParameters(list(model.parameters())):
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    wrapper, inner = model.wrapped, model.wrapped.inner
    assert len(wrapper._forward_pre_hooks) == len(inner._forward_pre_hooks) == 1
