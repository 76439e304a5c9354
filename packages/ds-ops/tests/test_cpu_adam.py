"""DeepSpeedCPUAdam against torch.optim.Adam / AdamW for 200 steps.

Sizes 0, 1, 7, 4097 and 1M+3 in three param groups with different lr/weight decay (on and off).
Tolerance on parameters and both moments: rtol=1e-5, atol=1e-6. The kernel computes in fp32 in
torch's order without fused multiply-adds; torch's vectorized lerp uses FMA, so some elements
differ by a few ulps (observed max 5e-7 after 200 steps).
"""

from __future__ import annotations

import pytest
import torch
from _optim_cases import clone_groups, flat, param_groups, run_lockstep

from ds_ops import DeepSpeedCPUAdam

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _compare_state(
    ours: torch.optim.Optimizer,
    ref: torch.optim.Optimizer,
    ours_params: list[torch.Tensor],
    ref_params: list[torch.Tensor],
) -> None:
    for mine, theirs in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[mine][key], ref.state[theirs][key], **TOL)
        assert ours.state[mine]["step"] == int(ref.state[theirs]["step"])


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_matches_torch_adam_over_200_steps(adamw_mode: bool) -> None:
    groups = param_groups(seed=0, hyper_extra={1: {"betas": (0.8, 0.99), "eps": 1e-6}})
    if not adamw_mode:  # the L2 path is the same code at every size: skip the 1M group to save time
        groups = groups[:2]
    ref_groups = clone_groups(groups)
    ours = DeepSpeedCPUAdam(groups, lr=1e-3, adamw_mode=adamw_mode)
    reference_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = reference_class(ref_groups, lr=1e-3, weight_decay=0.0, foreach=False)
    run_lockstep(ours, flat(groups), lambda _: ref.step(), flat(ref_groups))
    _compare_state(ours, ref, flat(groups), flat(ref_groups))
    assert flat(groups)[0].numel() == 0 and ours.state[flat(groups)[0]]["step"] == 200


def _adam_no_bias_correction(
    params: list[torch.Tensor],
    states: dict[int, list[torch.Tensor]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """Adam without bias correction (DeepSpeed's bias_correction=False), decoupled decay, in torch ops."""
    with torch.no_grad():
        for p in params:
            m, v = states.setdefault(id(p), [torch.zeros_like(p), torch.zeros_like(p)])
            p.mul_(1 - lr * weight_decay)
            m.lerp_(p.grad, 1 - betas[0])
            v.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
            p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)


def test_bias_correction_off_matches_reference() -> None:
    params = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n))) for n in (7, 4097)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = DeepSpeedCPUAdam(params, lr=1e-3, bias_correction=False, weight_decay=0.05)
    states: dict[int, list[torch.Tensor]] = {}
    run_lockstep(
        ours,
        params,
        lambda _: _adam_no_bias_correction(ref_params, states, 1e-3, (0.9, 0.999), 1e-8, 0.05),
        ref_params,
        steps=50,
    )
    for mine, theirs in zip(params, ref_params, strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)


def test_deepspeed_signature_defaults() -> None:
    ours = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2))])
    group = ours.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["bias_correction"]) == (
        1e-3,
        (0.9, 0.999),
        1e-8,
        0,
        True,
    )
    assert ours.adam_w_mode is True and ours.fp32_optimizer_states is True
    assert isinstance(ours, torch.optim.Optimizer)


def test_amsgrad_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match="amsgrad=True is not supported; use amsgrad=False"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)


def test_sparse_gradient_is_rejected() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    ours = DeepSpeedCPUAdam([param])
    param.grad = torch.zeros(4).to_sparse()
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\] has a sparse gradient"):
        ours.step()
