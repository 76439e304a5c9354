"""Stage 3's DeepSpeed-named sub-group views: `fp16_groups` and `fp32_partitioned_groups_flat`.

Scripts written for DeepSpeed read the base optimizer's per-sub-group state through them
(`optimizer.state[fp32_partitioned_groups_flat[i]]["step"]`); they must name the same tensors the base
optimizer steps, cover every trainable parameter once, and follow `sub_group_size`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_zero


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    net[0].bias.requires_grad_(False)  # frozen: in no sub-group
    return net


@pytest.mark.parametrize(("sub_group_size", "num_groups"), [(1_000_000, 1), (20, 3)])
def test_views_name_the_stepped_sub_groups(sub_group_size: int, num_groups: int) -> None:
    model = _model()
    base = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": sub_group_size}
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=cfg)
    flats, groups = opt.fp32_partitioned_groups_flat, opt.fp16_groups
    assert len(flats) == len(groups) == num_groups
    assert [id(f) for f in flats] == [id(p) for g in opt.optimizer.param_groups for p in g["params"]]
    assert all(f.dtype == torch.float32 for f in flats)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sorted(id(p) for g in groups for p in g) == sorted(id(p) for p in trainable)
    for step in range(1, 4):
        opt.backward(model(torch.randn(2, 6)).square().mean())
        opt.step()
        opt.zero_grad()
        assert [int(opt.optimizer.state[f]["step"]) for f in flats] == [step] * num_groups
