"""The split plan over 3 expert-parallel ranks (gloo): one count exchange gives every rank the splits and
per-expert counts a full all-gather of every rank's histogram implies."""

from __future__ import annotations

import torch

from ds_comm.testing import run_ranks


def _plan(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from ds_parallel.autoep import compute_split_plan

    experts = torch.randint(0, 6, (11, 2), generator=torch.Generator().manual_seed(rank))
    plan = compute_split_plan(experts, num_experts=6, ep_size=world, num_local_experts=2, ep_group=dist.group.WORLD)
    mine = torch.bincount(experts.flatten(), minlength=6)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    by_source = torch.stack([h.view(world, 2)[rank] for h in every])  # the reference, from all histograms
    ref = (mine.view(world, 2).sum(1).tolist(), by_source.sum(1).tolist(), by_source.sum(0).tolist())
    got = (plan.input_splits, plan.output_splits, plan.local_counts.tolist())
    return {"plan": (*got, plan.local_counts_by_source.tolist()), "ref": (*ref, by_source.tolist())}


def test_one_exchange_gives_the_plan_the_histograms_imply() -> None:
    for result in run_ranks(3, _plan, timeout_s=90):
        assert result["plan"] == result["ref"]
