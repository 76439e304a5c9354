"""Stage 3 `_get_norm_groups()` with the optimizer on NVMe: the gradients live in swap files, and the
per-group norms come from the terms recorded as they were written. One process; they must equal the norms
of a plain torch model's gradients per param group (1e-6 relative: fp32 sums tile by tile)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import ds_zero


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 4))


def _group_params(model: nn.Sequential) -> list[list[nn.Parameter]]:
    return [list(model[0].parameters()), [*model[2].parameters(), *model[4].parameters()]]


def test_nvme_norm_groups_equal_the_plain_gradient_norms(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 32, generator=g), torch.randn(6, 4, generator=g)
    ref = _model()
    nn.functional.mse_loss(ref(x), y).backward()
    expected = [torch.cat([p.grad.reshape(-1) for p in ps if p.grad is not None]).norm() for ps in _group_params(ref)]

    model = _model()
    config = {
        "stage": 3,
        "sub_group_size": 1000,  # several tiles per group
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
    }
    base = torch.optim.AdamW([{"params": ps} for ps in _group_params(model)], lr=1e-2)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config)
    assert opt.optimizer_swapper is not None and len(opt.tiles) > 2
    opt.backward(nn.functional.mse_loss(model(x), y))
    norms = opt._get_norm_groups()
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected), rtol=1e-6, atol=0)
    assert opt.step()
    assert opt._global_grad_norm is not None
    assert abs(opt._global_grad_norm - float(torch.stack(expected).norm())) <= 1e-6 * opt._global_grad_norm
