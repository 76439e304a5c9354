"""`check_lanes_routed_alike` on 2 gloo ranks (one tensor-parallel group): the folded dispatch's routing check.

Lanes that routed the same (sorted experts, tokens, weights) pass; a lane with one expert changed, one token
swapped, or one weight off by more than 1e-6 is caught on every rank.
"""

from __future__ import annotations

import pytest
import torch

from ds_comm.testing import run_ranks


def _routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    experts = torch.sort(torch.randint(0, 4, (12,), generator=g)).values
    tokens = torch.randperm(12, generator=g) // 2
    weights = torch.rand(12, 1, generator=g)
    return experts, tokens, weights


def _check(rank: int, world: int) -> dict[str, str]:
    import torch.distributed as dist

    from ds_parallel.autoep import check_lanes_routed_alike

    group = dist.new_group(list(range(world)))
    out = {}
    cases = {
        "same": lambda e, t, w: (e, t, w),
        "expert": lambda e, t, w: (torch.cat([e[:-1], e[-1:] + 1]), t, w),
        "token": lambda e, t, w: (e, t.flip(0), w),
        "weight": lambda e, t, w: (e, t, w + torch.tensor([[1e-3]] + [[0.0]] * 11)),
    }
    for name, change in cases.items():
        experts, tokens, weights = _routing()
        if rank == 1:
            experts, tokens, weights = change(experts, tokens, weights)
        try:
            check_lanes_routed_alike(experts, tokens, weights, group)
            out[name] = "passed"
        except RuntimeError as err:
            out[name] = str(err)
    return out


@pytest.mark.timeout(120)
def test_lanes_that_routed_differently_are_caught_on_every_rank() -> None:
    for result in run_ranks(2, _check, timeout_s=100):
        assert result["same"] == "passed"
        for name in ("expert", "token", "weight"):
            assert "lanes routed differently" in result[name], (name, result[name])
