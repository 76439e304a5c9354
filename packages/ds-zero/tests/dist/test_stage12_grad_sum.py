"""`gradient_average=False` (`gradient_allreduce_op: "sum"`): ZeRO 1/2 step on the plain sum of the ranks' gradients.

The reference is plain PyTorch: each rank's autograd gradients all-reduced with SUM (what DDP does, without its
division by the world size), then the same SGD step. SGD, not Adam: Adam's update hardly changes when every
gradient doubles, so it would not tell a sum from a mean. `gradient_predivide_factor` must have no effect on a
sum (DeepSpeed divides by neither it nor the world size then).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from zero_dist_cases import batch, flat_params, loss_fn, make_model, param_groups, train_zero, zero_config

import ds_zero
from ds_comm.testing import run_ranks

STEPS = 4
TOL = 1e-5
CASES = [
    {"name": "s1-reduce-scatter", "stage": 1},
    {"name": "s1-allreduce-predivide", "stage": 1, "reduce_scatter": False, "gradient_predivide_factor": 2.0},
    {"name": "s2-gas2-overlap", "stage": 2, "gas": 2, "overlap_comm": True},
    {
        "name": "s2-gas2-allreduce-predivide",
        "stage": 2,
        "gas": 2,
        "reduce_scatter": False,
        "gradient_predivide_factor": 2.0,
    },
]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups(model, lr_a=0.05, lr_b=0.02))


def _reference(rank: int, world: int, gas: int, average: bool) -> torch.Tensor:
    model = make_model()
    opt = _sgd(model)
    for step in range(STEPS):
        for micro in range(gas):
            x, y = batch(step, micro, rank, world)
            (loss_fn(model, x, y) / gas).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                if average:
                    p.grad /= world
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def _rank(rank: int, world: int) -> dict[str, tuple[float, float]]:
    results = {}
    for case in CASES:
        case = dict(case)
        name, stage, gas = case.pop("name"), case.pop("stage"), case.pop("gas", 1)
        predivide = case.pop("gradient_predivide_factor", 1.0)
        model = make_model()
        opt = ds_zero.DeepSpeedZeroOptimizer(
            _sgd(model),
            config=zero_config(stage, **case),
            module=model,
            gradient_average=False,
            gradient_predivide_factor=predivide,
        )
        assert opt.gradient_average is False
        train_zero(opt, model, rank, world, range(STEPS), gas=gas, global_loss=False)
        params = flat_params(model)
        opt.close()
        summed, averaged = _reference(rank, world, gas, False), _reference(rank, world, gas, True)
        results[name] = (float((params - summed).abs().max()), float((params - averaged).abs().max()))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_zero12_sum_matches_a_summing_reference(world: int) -> None:
    for rank, per_case in enumerate(run_ranks(world, _rank, timeout_s=150)):
        for name, (to_sum, to_mean) in per_case.items():
            assert to_sum <= TOL, f"rank {rank}, {name}: params differ from the summing reference by {to_sum}"
            # The check can tell a sum from a mean: the averaging reference is far off.
            assert to_mean > 100 * TOL, f"rank {rank}, {name}: a mean would have passed too ({to_mean})"
