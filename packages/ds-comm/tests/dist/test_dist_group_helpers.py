"""get_world_group, get_all_ranks_from_group, list all_to_all and all_reduce_coalesced on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm.testing import run_ranks


def _helpers(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    out["world_is_default"] = ds_comm.get_world_group() is dist.group.WORLD
    out["world_ranks"] = ds_comm.get_all_ranks_from_group(ds_comm.get_world_group())
    odd = ds_comm.new_group([r for r in range(world) if r % 2 == 1])
    out["odd_ranks"] = ds_comm.get_all_ranks_from_group(odd) if rank % 2 == 1 else None
    # all_to_all: rank r sends (100 * r + j) to rank j, so rank r receives (100 * j + r) from each j.
    inputs = [torch.full((3,), float(100 * rank + j)) for j in range(world)]
    outputs = [torch.empty(3) for _ in range(world)]
    ds_comm.all_to_all(outputs, inputs)
    out["all_to_all"] = outputs
    # Mixed dtypes and shapes in one call: each comes back summed over ranks, in place, shape kept.
    coalesced = [
        torch.full((2, 3), float(rank + 1)),
        torch.arange(4, dtype=torch.float64) * (rank + 1),
        torch.full((5,), rank + 1, dtype=torch.int64),
    ]
    ds_comm.all_reduce_coalesced(coalesced)
    out["coalesced"] = coalesced
    try:
        ds_comm.all_to_all(outputs[:1], inputs)
    except ValueError as err:
        out["bad_lengths"] = str(err)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_group_helpers_match_a_local_reference(world: int) -> None:
    results = run_ranks(world, _helpers, timeout_s=90)
    total = sum(r + 1 for r in range(world))
    for rank, res in enumerate(results):
        assert res["world_is_default"] is True
        assert res["world_ranks"] == list(range(world))
        if rank % 2 == 1:
            assert res["odd_ranks"] == [r for r in range(world) if r % 2 == 1]
        for j, received in enumerate(res["all_to_all"]):
            torch.testing.assert_close(received, torch.full((3,), float(100 * j + rank)))
        first, second, third = res["coalesced"]
        torch.testing.assert_close(first, torch.full((2, 3), float(total)))
        torch.testing.assert_close(second, torch.arange(4, dtype=torch.float64) * total)
        torch.testing.assert_close(third, torch.full((5,), total, dtype=torch.int64))
        assert "output_tensor_list has 1 tensors" in res["bad_lengths"]


def test_world_group_before_init_names_the_fix() -> None:
    assert ds_comm.is_available() is True
    if ds_comm.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ds_comm.UsageError, match="init_distributed"):
        ds_comm.get_world_group()


def test_feature_queries_report_what_torch_has() -> None:
    assert ds_comm.has_all_gather_into_tensor() is True
    assert ds_comm.has_reduce_scatter_tensor() is True
    assert ds_comm.has_all_reduce_coalesced() is True
    assert ds_comm.has_coalescing_manager() == hasattr(dist, "_coalescing_manager")
