"""ZeRO 1/2 with a param group partitioned over its own process group (how expert parameters are trained).

On 4 gloo ranks, an "expert" layer whose values depend on the rank pair {0,1} / {2,3} (the expert-parallel
position) is replicated over the strided groups {0,2} and {1,3}; its param group reduces over that group
while the dense group reduces over all 4 ranks. One SGD step (lr 1) must move every parameter by exactly
minus its averaged gradient: dense by the mean over 4 ranks, the expert's by the sum over its 2-rank group
divided by 4; with clipping, both scaled by the clip over the global norm that counts each expert once.
"""

from __future__ import annotations

import pytest
import torch

from ds_comm.testing import run_ranks


def _step(rank: int, world: int, stage: int, clip: float) -> dict[str, float]:
    import torch.distributed as dist
    from torch import nn

    from ds_zero import DeepSpeedZeroOptimizer, ZeroConfig

    ep_rank = rank % 2
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    edp = edp_groups[ep_rank]
    torch.manual_seed(0)
    dense = nn.Linear(5, 3)
    torch.manual_seed(10 + ep_rank)  # the expert this pair of ranks holds
    expert = nn.Linear(3, 2)
    model = nn.Sequential(dense, nn.Tanh(), expert)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)

    # the expected step, from plain autograd and collectives
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    h = torch.tanh(nn.functional.linear(x, ref["0.weight"], ref["0.bias"]))
    loss = nn.functional.mse_loss(nn.functional.linear(h, ref["2.weight"], ref["2.bias"]), y)
    loss.backward()
    want = {}
    for n, p in ref.items():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=None if n.startswith("0.") else edp)
        want[n] = grad / world
    dense_sq = sum(float(want[n].square().sum()) for n in want if n.startswith("0."))
    expert_sq = torch.tensor(sum(float(want[n].square().sum()) for n in want if n.startswith("2.")))
    dist.all_reduce(expert_sq)  # over all 4 ranks: each expert counted twice (once per replica)
    norm = (dense_sq + float(expert_sq) / 2) ** 0.5
    coef = min(clip / (norm + 1e-6), 1.0) if clip > 0 else 1.0

    base = torch.optim.SGD(
        [{"params": list(dense.parameters())}, {"params": list(expert.parameters()), "moe": True}], lr=1.0
    )
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=7, allgather_bucket_size=10, overlap_comm=stage == 2)
    opt = DeepSpeedZeroOptimizer(base, config=cfg, module=model, clip_grad=clip, partition_groups=[None, edp])
    out = model(x)
    opt.backward(nn.functional.mse_loss(out, y))
    opt.step()
    worst = max(float((before[n] - p.detach() - coef * want[n]).abs().max()) for n, p in model.named_parameters())
    return {"worst": worst, "norm": float(opt.global_grad_norm), "want_norm": norm}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stage", "clip"), [(1, 0.0), (2, 0.0), (1, 0.05), (2, 0.05)])
def test_expert_group_reduces_over_its_own_group_and_averages_over_the_world(stage: int, clip: float) -> None:
    for r in run_ranks(4, _step, stage, clip, timeout_s=200):
        assert r["worst"] <= 1e-6, r
        assert r["norm"] == pytest.approx(r["want_norm"], rel=1e-5), r
        if clip:
            assert r["want_norm"] > clip  # clipping was active


def _bad(rank: int, world: int) -> str:
    from torch import nn

    from ds_zero import DeepSpeedZeroOptimizer, ZeroConfig

    model = nn.Linear(2, 2)
    try:
        DeepSpeedZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), config=ZeroConfig(stage=1), partition_groups=[None, None]
        )
    except ValueError as err:
        return str(err)
    return "no error"


def test_partition_groups_must_match_the_param_groups() -> None:
    assert "partition_groups has 2 entries but the optimizer has 1" in run_ranks(2, _bad, timeout_s=60)[0]
