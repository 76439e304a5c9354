"""`deepspeed.runtime.utils.count_used_parameters_in_backward`: from a hook, count what this backward reaches."""

from __future__ import annotations

import pytest
import torch

from ds_engine.runtime.utils import count_used_parameters_in_backward


class _TwoBranches(torch.nn.Module):
    """`used` always feeds the output; `unused` only when `both=True`; `frozen` never requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(3, 3)
        self.unused = torch.nn.Linear(3, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        out = self.frozen(self.used(x))
        return out + self.unused(x) if both else out


def _count_during_backward(model: _TwoBranches, both: bool, **backward_kwargs: object) -> int:
    """Run one backward and return what a hook on `used.weight` counted over all of the model's parameters."""
    seen: list[int] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(count_used_parameters_in_backward(list(model.parameters())))
        return grad

    handle = model.used.weight.register_hook(hook)
    try:
        model(torch.randn(2, 3), both).sum().backward(**backward_kwargs)  # type: ignore[arg-type]
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def test_counts_only_parameters_the_backward_reaches() -> None:
    model = _TwoBranches()
    # used.{weight,bias} and unused.{weight,bias}; frozen's two never require grad
    assert _count_during_backward(model, both=True) == 4
    # the unused branch was not in this forward's graph
    assert _count_during_backward(model, both=False) == 2


def test_backward_inputs_prune_what_is_counted() -> None:
    model = _TwoBranches()
    assert _count_during_backward(model, both=True, inputs=[model.used.weight, model.unused.bias]) == 2


def test_a_parameter_listed_twice_counts_once() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    seen: list[int] = []
    weight.register_hook(lambda grad: seen.append(count_used_parameters_in_backward([weight, weight])))
    (weight * 3).sum().backward()
    assert seen == [1]


def test_outside_backward_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="must be called during backward"):
        count_used_parameters_in_backward([torch.nn.Parameter(torch.ones(1))])
