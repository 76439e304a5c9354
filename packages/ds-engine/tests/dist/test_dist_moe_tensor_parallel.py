"""MoE inside a tensor-parallel model through `initialize(mpu=...)` on 2 gloo ranks (tp 2), against one process.

Both tensor-parallel ranks feed the same batch. Cases: experts whole on each rank with ep 1 (each rank
sends only its half of every expert's slots; expert gradients are summed over the expert-data-parallel
group) and ep 2 (the two tensor-parallel peers exchange slots by all-to-all; top-2 without dropping, so
the capacity is padded to a multiple of tp); and tensor-parallel experts (`enable_expert_tensor_parallelism`,
each rank holds half of every expert's hidden units), at ZeRO 0 and 2. Losses of two SGD steps and the gradients of the
first (lr 1: the weight change) must equal the plain model's on one process to 1e-5.

Needs ds-parallel (the `ds-engine[all]` session); skipped without it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="MoE needs ds-parallel: pip install 'ds-engine[parallel]'")

HIDDEN, FFN = 8, 16


class _TensorParallelExpert(nn.Module):
    """A two-layer MLP whose hidden units are split over the model's tensor-parallel group (column then row
    parallel: one all-reduce forward, one backward)."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN // tp)
        self.fc2 = nn.Linear(FFN // tp, HIDDEN, bias=False)
        self.bias2 = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ds_parallel import groups
        from ds_parallel.tensor._regions import copy_to_tp_region, reduce_from_tp_region

        _, group, _ = groups._tensor_parallel()
        h = torch.relu(self.fc1(copy_to_tp_region(x, group, True)))
        return reduce_from_tp_region(self.fc2(h), group, True) + self.bias2


class _Whole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.bias2 = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) + self.bias2


class _Net(nn.Module):
    def __init__(self, ep: int, k: int, drop: bool, expert_tp: bool, tp: int) -> None:
        from ds_parallel.moe import MoE

        super().__init__()
        self.inp = nn.Linear(4, HIDDEN)
        expert = _TensorParallelExpert(tp) if expert_tp else _Whole()
        self.moe = MoE(
            HIDDEN, expert, num_experts=2, ep_size=ep, k=k, min_capacity=2, drop_tokens=drop, use_rts=False,
            enable_expert_tensor_parallelism=expert_tp, top2_2nd_expert_sampling=False,
        )  # fmt: skip
        self.out = nn.Linear(HIDDEN, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(self.inp(x))
        return nn.functional.mse_loss(self.out(h), y) + 0.01 * l_aux


class _Mpu:
    """A Megatron-style mpu: the whole world is one tensor-parallel group, one data-parallel replica."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.world = dist.group.WORLD
        self.dp = dist.new_group([dist.get_rank()])

    def get_model_parallel_group(self) -> Any:
        return self.world

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def get_data_parallel_group(self) -> Any:
        return self.dp

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0


def _shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The tensor-parallel expert's slice of the whole expert's `full` (fc1 rows, fc2 columns); tp 1: `full`."""
    if tp == 1:
        return full
    if ".fc1." in name:
        return full.chunk(tp, dim=0)[rank]
    if ".fc2." in name:
        return full.chunk(tp, dim=1)[rank]
    return full


def _local_to_global(name: str, ep_rank: int, num_local: int) -> str:
    head, _, tail = name.partition(".deepspeed_experts.")
    if not tail:
        return name
    index, _, rest = tail.partition(".")
    return f"{head}.deepspeed_experts.{ep_rank * num_local + int(index)}.{rest}"


def _case(rank: int, ep: int, k: int, drop: bool, expert_tp: bool, stage: int = 0) -> dict[str, float]:
    import ds_engine as deepspeed
    from ds_parallel import groups
    from ds_parallel.moe import split_params_into_different_moe_groups_for_optimizer

    groups.reset_mesh()
    torch.manual_seed(0)
    full = _Net(1, k, drop, False, 1)
    x, y = torch.randn(4, 6, 4), torch.randn(4, 6, 3)
    initial = {n: p.detach().clone() for n, p in full.named_parameters()}
    ref_opt = torch.optim.SGD(full.parameters(), lr=1.0)
    ref_loss0 = full(x, y)
    ref_loss0.backward()
    ref_grads = {n: p.grad.clone() for n, p in full.named_parameters()}
    ref_opt.step()
    ref_loss1 = float(full(x, y).detach())

    model = _Net(ep, k, drop, expert_tp, 2)
    num_local = 2 // ep
    tp = 2 if expert_tp else 1  # how the expert weights are split
    ep_rank = rank if ep == 2 else 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_shard(name, initial[_local_to_global(name, ep_rank, num_local)], rank, tp))
    param_groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all"}
    )
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(param_groups, lr=1.0),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        },
        mpu=_Mpu(),
    )
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    loss0 = engine(x, y)
    engine.backward(loss0)
    engine.step()
    loss1 = float(engine(x, y).detach())
    grad_err = 0.0
    for name, p in engine.module.named_parameters():
        ref = _shard(name, ref_grads[_local_to_global(name, ep_rank, num_local)], rank, tp)
        grad_err = max(grad_err, float(((before[name] - p.detach()) - ref).abs().max()))
    return {
        "loss0": abs(float(loss0) - float(ref_loss0)),
        "loss1": abs(loss1 - ref_loss1),
        "grad": grad_err,
        "grad_scale": float(max(g.abs().max() for g in ref_grads.values())),
        "expert_tp": float(groups._get_expert_model_parallel_world_size()),
    }


def _run(rank: int, world: int) -> dict[str, dict[str, float]]:
    return {
        "whole_ep1": _case(rank, ep=1, k=1, drop=True, expert_tp=False),
        "whole_ep2_top2_nodrop": _case(rank, ep=2, k=2, drop=False, expert_tp=False),
        "tp_experts": _case(rank, ep=1, k=1, drop=True, expert_tp=True),
        "tp_experts_zero2": _case(rank, ep=1, k=1, drop=True, expert_tp=True, stage=2),
    }


@pytest.mark.timeout(200)
def test_moe_in_a_tensor_parallel_model_matches_one_process() -> None:
    for result in run_ranks(2, _run, timeout_s=180):
        for case, errors in result.items():
            assert errors["loss0"] <= 1e-5 and errors["loss1"] <= 1e-5, (case, errors)
            assert errors["grad"] <= 1e-5 and errors["grad_scale"] > 1e-3, (case, errors)
            assert errors["expert_tp"] == (2.0 if case.startswith("tp_experts") else 1.0), (case, errors)
