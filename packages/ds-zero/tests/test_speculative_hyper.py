"""`SpeculativeSteps` updates with the hyper-parameters of the moment a unit was submitted, whatever the caller's
thread does to the param group before the worker gets to it (the race an lr set between the backward and
`step()` used to lose or win by timing)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import torch

from ds_zero._speculative import SpeculativeSteps
from ds_zero._stage3.superoffload import _private_view


def test_update_uses_the_lr_of_submit_even_when_the_worker_runs_after_a_change() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    base = torch.optim.SGD([param], lr=0.5)
    release = threading.Event()
    seen: list[float] = []

    def step(key: Hashable, grad: torch.Tensor, hyper: dict[str, Any]) -> None:
        release.wait(timeout=30)  # the caller changes the lr first
        seen.append(hyper["lr"])
        view = _private_view(base, 0, param, hyper)
        param.grad = grad
        view.step()
        param.grad = None

    steps = SpeculativeSteps(base, step, keep_undo=False)
    try:
        steps.submit("unit", param, 0, torch.full((4,), 2.0))
        base.param_groups[0]["lr"] = 0.1  # after the backward, before step(): the worker has not run yet
        release.set()
        steps.wait()
        assert seen == [0.5]
        assert torch.equal(param.detach(), torch.full((4,), 1.0 - 0.5 * 2.0))  # the old lr's update, exactly
        assert steps.changed_hyper() == ["unit"]  # and the change is noticed (SuperOffload warns or redoes)
        assert not steps.restorable("unit")
        assert base.param_groups[0]["lr"] == 0.1 and base.param_groups[0]["params"] == [param]
    finally:
        release.set()
        steps.close()


def test_private_view_steps_one_parameter_and_shares_the_state() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    base = torch.optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.2}], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1)  # wraps base.step on the instance
    reference = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.3)
    reference.param_groups[0]["params"][0].grad = torch.full((3,), 0.5)
    reference.step()
    b.grad = torch.full((3,), 0.5)
    view = _private_view(base, 1, b, {**{k: v for k, v in base.param_groups[1].items() if k != "params"}, "lr": 0.3})
    view.step()
    assert torch.equal(b.detach(), reference.param_groups[0]["params"][0].detach())
    assert torch.equal(a.detach(), torch.ones(3)) and a not in base.state
    assert base.state[b]["step"] == 1  # the view's state is base's
    assert base.param_groups[1]["lr"] == 0.2 and base.param_groups[1]["params"] == [b]
    del scheduler
