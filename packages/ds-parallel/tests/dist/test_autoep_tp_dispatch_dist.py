"""Folded dispatch over 2 and 3 TP lanes (gloo): each lane keeps its share of the assignments, the experts run
on it, and the restore equals the unpartitioned `combine_from_routed` on every lane, forward and backward (each
lane's loss differs, the reference is the sum of the lanes' losses); divergent routing is caught."""

from __future__ import annotations

import pytest
import torch

from ds_comm.testing import run_ranks


def _lanes(rank: int, world: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from test_autoep_tp_dispatch import routed_payload

    from ds_parallel.autoep import (
        assert_tp_payload_consistent,
        combine_from_routed,
        partition_assignments,
        restore_combined,
    )

    group = dist.group.WORLD
    payload, extra = routed_payload(num_tokens=9, num_experts=4, top_k=2, seed=3)
    expert_w = torch.randn(4, 5, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64)

    def expert_rows(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # each assignment through its expert
        return torch.einsum(
            "nh,nho->no", x.index_select(0, payload.token_indices[rows]), w[payload.expert_indices[rows]]
        )

    ref_w, ref_scores = expert_w.clone().requires_grad_(), extra["top_scores"].double().requires_grad_()
    ref = combine_from_routed(
        expert_rows(ref_w, torch.arange(18)), ref_scores, extra["order"], 2, "post", "weighted_sum", (1, 9, 5)
    )
    sum((ref * (r + 1)).square().sum() for r in range(world)).backward()

    w, scores = expert_w.clone().requires_grad_(), extra["top_scores"].double().requires_grad_()
    payload.combine_weights = scores.flatten()[extra["order"]]
    assert_tp_payload_consistent(payload, tp_group=group, tp_size=world)
    local, ctx = partition_assignments(payload, tp_group=group, tp_rank=rank, tp_size=world)
    out = restore_combined(expert_rows(w, ctx.local_indices), ctx, tp_group=group, validate_coverage=True)
    (out * (rank + 1)).square().sum().backward()
    grads = [w.grad.clone(), scores.grad.clone()]
    for g in grads:
        dist.all_reduce(g)
    diverged = "no"
    if rank == 1:
        payload.combine_weights = payload.combine_weights.detach() + 1e-3
    try:
        assert_tp_payload_consistent(payload, tp_group=group, tp_size=world)
    except RuntimeError as err:
        diverged = str(err)
    return {
        "out": out.detach(),
        "ref": ref.detach().reshape(9, 5),
        "w": grads[0],
        "ref_w": ref_w.grad,
        "s": grads[1],
        "ref_s": ref_scores.grad,
        "local": torch.tensor(local.token_indices.numel()),
        "diverged": diverged,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_restore_over_lanes_matches_the_unpartitioned_combine(world: int) -> None:
    results = run_ranks(world, _lanes, timeout_s=120, env={"PYTHONPATH": _here()})
    assert sum(int(r["local"]) for r in results) == 18  # every assignment sent by exactly one lane
    for r in results:
        torch.testing.assert_close(r["out"], r["ref"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["w"], r["ref_w"], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(r["s"], r["ref_s"], rtol=1e-10, atol=1e-10)
        assert "routing decisions differ across tensor-parallel lanes" in r["diverged"]


def _here() -> str:
    import os
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([tests, *sys.path])
