"""`param.ds_active_sub_modules` and `param.is_external_param`, in one process.

The view names who holds a partitioned parameter's full values (the module whose forward runs, an
open `GatheredParameters` block) and is empty, with every parameter released, after a backward, including
one through a non-reentrant activation checkpoint that replays frozen layers; the gradients still equal
plain torch's (fp32, 1e-6). A parameter a forward returns to its caller is flagged external for good.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ds_zero
from ds_zero import ZeroParamStatus

CFG = {"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": 0}


class Recorder(nn.Linear):
    """Records what its weight's view says while its own forward runs."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.seen: list[set[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = getattr(self.weight, "ds_active_sub_modules", None)  # None in the plain-torch reference
        if view is not None:
            self.seen.append(set(view))
        return F.linear(x, self.weight, self.bias)


class Net(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.frozen = nn.Linear(n, n).requires_grad_(False)
        self.rec = Recorder(n)
        self.head = nn.Linear(n, 1)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.rec(torch.tanh(self.frozen(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False)).sum()


def _managed(model: nn.Module) -> nn.Module:
    ds_zero.DeepSpeedZeRoOffload(model, config=CFG)
    return model


def _assert_idle(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert len(p.ds_active_sub_modules) == 0 and not p.ds_active_sub_modules, (name, p.ds_active_sub_modules)
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE, name


def test_view_names_the_running_module_and_empties_after_a_checkpointed_backward() -> None:
    torch.manual_seed(0)
    ref = Net()
    model = _managed(copy.deepcopy(ref))
    _assert_idle(model)
    for step in range(2):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step), requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        model(x).backward()
        ref(x_ref).backward()
        _assert_idle(model)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        with ds_zero.GatheredParameters(list(model.rec.parameters())):
            torch.testing.assert_close(model.rec.weight.grad, ref.rec.weight.grad, rtol=1e-6, atol=1e-6)
    # per step: the forward, then the checkpoint's replay, which runs inside rec's backward
    fwd, replay = {"module 'rec' (forward)"}, {"module 'rec' (forward)", "module 'rec' (backward)"}
    assert model.rec.seen == [fwd, replay, fwd, replay]


def test_view_counts_a_gathered_parameters_block_and_cannot_be_written() -> None:
    model = _managed(Net())
    w = model.head.weight
    with ds_zero.GatheredParameters([w]):
        assert len(w.ds_active_sub_modules) == 1
        assert list(w.ds_active_sub_modules) == ["GatheredParameters block or on-demand read"]
    assert not w.ds_active_sub_modules
    with pytest.raises(AttributeError):
        w.ds_active_sub_modules.add("x")  # a read-only view


class ReturnsBias(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:  # type: ignore[override]
        return F.linear(x, self.weight), self.bias


class UsesReturnedBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.producer = ReturnsBias(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.producer(x)
        return self.head(torch.tanh(out + bias)).sum()


def test_a_returned_parameter_becomes_external_and_trains_like_torch() -> None:
    torch.manual_seed(1)
    ref = UsesReturnedBias()
    model = _managed(copy.deepcopy(ref))
    assert not any(p.is_external_param for p in model.parameters())
    for step in range(2):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + step))
        model(x).backward()
        ref(x).backward()
        assert model.producer.bias.is_external_param
        assert not model.producer.weight.is_external_param and not model.head.weight.is_external_param
        assert all(not p.ds_active_sub_modules for p in model.parameters())
    with ds_zero.GatheredParameters([model.producer.bias]):
        torch.testing.assert_close(model.producer.bias.grad, ref.producer.bias.grad, rtol=1e-6, atol=1e-6)


class RaisesInReplay(Net):
    """The checkpoint's replay (inside backward) raises once."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_replay = True

    def block(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.frozen(x))
        if self.fail_replay and torch._C._current_graph_task_id() != -1:
            self.fail_replay = False
            raise RuntimeError("replay failed")
        return self.rec(y)


def test_a_backward_that_raised_is_drained_by_the_next_forward(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(2)
    ref = RaisesInReplay()
    model = _managed(copy.deepcopy(ref))
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    for net in (model, ref):
        with pytest.raises(RuntimeError, match="replay failed"):
            net(x).backward()
    assert any(model.rec.weight.ds_active_sub_modules)  # rec's backward claim, never released by autograd
    with caplog.at_level("WARNING", logger="ds_zero._schedule.coordinator"):
        model(x).backward()
    ref(x).backward()
    assert "the previous backward did not finish" in caplog.text
    _assert_idle(model)
    params = list(model.parameters())
    with ds_zero.GatheredParameters(params):
        for p, r in zip(params, ref.parameters(), strict=True):
            if r.grad is not None:
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)
    # the next iteration is an ordinary one
    model(x).backward()
    _assert_idle(model)
