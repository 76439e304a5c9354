"""`stage3_module_granularity_threshold`: which modules become ZeRO-3 leaves, and training through them.

Granularity is subtree elements per layer (the module itself, plus every parameter-holding layer below
it; containers and torch leaf modules count their layers but are never made leaves). Parents are tried
first. A model managed with a threshold gathers each fine-grained block as one unit and its gradients
still equal plain torch's (fp32, 1e-6).
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero._schedule.granularity import module_granularity, set_leaves_by_granularity


class Block(nn.Module):
    """Two 4x4 linears: 40 elements over 3 layers (itself and both linears) -> granularity 13."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.act = nn.Tanh()  # no parameters: not a layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


class Model(nn.Module):
    """Root: 80 + 320 elements over 8 layers -> granularity 50."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def test_granularity_counts_elements_per_layer() -> None:
    model = Model()
    g = module_granularity(model)
    assert g[model] == 400 // 8
    assert all(g[b] == 40 // 3 for b in model.blocks)
    assert g[model.blocks] == math.inf  # a container
    assert g[model.head] == math.inf and g[model.blocks[0].a] == math.inf  # torch leaf modules
    assert g[model.blocks[0].act] == math.inf  # no parameters


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [(0, []), (13, ["blocks.0", "blocks.1"]), (49, ["blocks.0", "blocks.1"]), (50, [""]), (10**6, [""])],
)
def test_outermost_modules_at_or_below_the_threshold_become_leaves(threshold: int, expected: list[str]) -> None:
    model = Model()
    names = {id(m): n for n, m in model.named_modules()}
    leaves = set_leaves_by_granularity(model, threshold)
    assert [names[id(m)] for m in leaves] == expected
    assert [n for n, m in model.named_modules() if ds_zero.z3_leaf_module(m)] == expected


def test_a_threshold_below_every_granularity_warns_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model = Model()
    with caplog.at_level(logging.WARNING, logger="ds_zero._schedule.granularity"):
        assert set_leaves_by_granularity(model, 12) == []
    assert ds_zero.get_z3_leaf_modules(model) == []
    assert "stage3_module_granularity_threshold=12 makes no module a leaf" in caplog.text
    assert "Block with granularity 13" in caplog.text


@pytest.mark.parametrize(("threshold", "leaf_root"), [(20, False), (10**6, True)])
def test_managed_model_uses_the_leaves_and_matches_torch(threshold: int, leaf_root: bool) -> None:
    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    cfg = {"stage": 3, "param_persistence_threshold": 0, "stage3_module_granularity_threshold": threshold}
    ds_zero.DeepSpeedZeRoOffload(model, config=cfg)
    assert ds_zero.z3_leaf_module(model) is leaf_root
    assert all(ds_zero.z3_leaf_module(b) is not leaf_root for b in model.blocks)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        ref(x).backward()
    params = list(model.parameters())
    with ds_zero.GatheredParameters(params):
        for p, r in zip(params, ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)
