"""`max_reuse_distance` counts as DeepSpeed's does: a released parameter is kept only when it is needed again
before that many elements are gathered, so 0 keeps nothing, in one process.

The last layer of a chain is needed again right after its forward (its backward comes next, nothing gathered
in between: distance 0). Once the execution order is recorded (second iteration on), `max_reuse_distance=0`
releases it after its forward like every other layer (DeepSpeed's "never keep"), and 1 keeps it. Statuses are
read through `named_parameters()`, which does not gather.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero import ZeroParamStatus


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.after: list[list[ZeroParamStatus | None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = []
        for layer in self.layers:
            x = torch.tanh(layer(x))
            seen.append(getattr(next(iter(dict(layer.named_parameters()).values())), "ds_status", None))
        self.after.append(seen)
        return x.sum()


@pytest.mark.parametrize(("distance", "last_kept"), [(0, False), (1, True)])
def test_the_last_layer_is_kept_only_when_its_reuse_is_closer_than_the_distance(distance: int, last_kept: bool) -> None:
    torch.manual_seed(0)
    model = Chain()
    cfg = {"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": distance}
    ds_zero.DeepSpeedZeRoOffload(model, config=cfg)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x).backward()
    released, available = ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE
    assert model.after[0] == [released] * 3  # no recorded order yet: nothing is kept
    for seen in model.after[1:]:
        assert seen == [released, released, available if last_kept else released]
