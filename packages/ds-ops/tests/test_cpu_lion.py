"""DeepSpeedCPULion against Lion written with torch tensor ops, for 200 steps.

Sizes 0, 1, 7, 4097 and 1M+3 in three param groups with different lr/weight decay (on and off).
Tolerance: exact (rtol=0, atol=0). The kernel and the reference round each product to fp32 on its
own (no FMA), and the sign update is exact, so the bits agree.
"""

from __future__ import annotations

import torch
from _optim_cases import GROUPS, clone_groups, flat, lion_reference_step, param_groups, run_lockstep

from ds_ops import DeepSpeedCPULion


def test_matches_torch_lion_reference_over_200_steps() -> None:
    groups = param_groups(seed=20, hyper_extra={1: {"betas": (0.95, 0.98)}})
    ref_groups = clone_groups(groups)
    ours = DeepSpeedCPULion(groups, lr=1e-3)
    states: dict[int, torch.Tensor] = {}

    def reference(_: int) -> None:
        for index, group in enumerate(ref_groups):
            hyper = GROUPS[index]["hyper"]
            lion_reference_step(
                group["params"], states, hyper.get("lr", 1e-3), group.get("betas", (0.9, 0.999)), hyper["weight_decay"]
            )

    run_lockstep(ours, flat(groups), reference, flat(ref_groups))
    for mine, theirs in zip(flat(groups), flat(ref_groups), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        torch.testing.assert_close(ours.state[mine]["exp_avg"], states[id(theirs)], rtol=0, atol=0)


def test_deepspeed_signature_defaults() -> None:
    ours = DeepSpeedCPULion([torch.nn.Parameter(torch.zeros(2))])
    group = ours.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 0)
    assert ours.fp32_optimizer_states is True
