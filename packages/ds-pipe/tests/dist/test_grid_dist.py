"""Grid and partitioning on 4 gloo ranks: group members per axis, stage lookup, layer ownership per method."""

from __future__ import annotations

from typing import Any

import pipe_models
import pytest
import torch.distributed as dist
from torch import nn

from ds_comm.testing import run_ranks
from ds_pipe import (
    LayerSpec,
    PartitionMethodError,
    PipeDataParallelTopology,
    PipelineModule,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
)


def _members(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def _grids(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pd = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    out["pd"] = (
        pd.get_stage_id(),
        pd.get_data_parallel_rank(),
        _members(pd.get_data_parallel_group()),
        _members(pd.get_pipe_parallel_group()),
        _members(pd.get_model_parallel_group()),
        pd.get_model_parallel_rank(),
        pd.get_slice_parallel_world_size(),
        pd.stage_to_global(1),
        pd.is_first_stage,
        pd.is_last_stage,
    )
    out["valid"] = pd._is_grid_valid()
    pd._topo = PipeDataParallelTopology(num_pp=2, num_dp=1)  # a mesh that no longer spans the 4 ranks
    out["valid_after_shrink"] = pd._is_grid_valid()
    pm = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    out["pm"] = (
        pm.get_stage_id(),
        pm.get_slice_parallel_rank(),
        _members(pm.get_slice_parallel_group()),
        _members(pm.get_pipe_parallel_group()),
        _members(pm.get_data_parallel_group()),
        pm.get_model_parallel_world_size(),
        pm.stage_to_global(0, model=0),
    )
    try:
        PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=1))
    except ValueError as err:
        out["bad"] = str(err)
    layers = pipe_models.specs()
    out["parts"] = {}
    for method in ["uniform", "parameters", "type:block", [0, 1, 1, 5, 11]]:
        module = PipelineModule(layers, num_stages=4, partition_method=method)
        out["parts"][str(method)] = (module.partitions(), sorted(n for n, _ in module.named_parameters()))
    try:
        PipelineModule(layers, num_stages=4, partition_method="type:Conv")
    except PartitionMethodError as err:
        out["no_match"] = str(err)
    try:
        PipelineModule([LayerSpec(nn.Linear, 2, 2)] * 3, num_stages=3)
    except ValueError as err:
        out["indivisible"] = str(err)
    return out


def test_grid_groups_and_partitions_on_four_ranks() -> None:
    results = run_ranks(4, _grids, timeout_s=120)
    assert [r["pd"] for r in results] == [
        (0, 0, [0, 1], [0, 2], [0, 2], 0, 1, 2, True, False),
        (0, 1, [0, 1], [1, 3], [1, 3], 0, 1, 3, True, False),
        (1, 0, [2, 3], [0, 2], [0, 2], 1, 1, 2, False, True),
        (1, 1, [2, 3], [1, 3], [1, 3], 1, 1, 3, False, True),
    ]
    assert [r["pm"] for r in results] == [
        (0, 0, [0, 1], [0, 2], [0], 4, 0),
        (0, 1, [0, 1], [1, 3], [1], 4, 0),
        (1, 0, [2, 3], [0, 2], [2], 4, 0),
        (1, 1, [2, 3], [1, 3], [3], 4, 0),
    ]
    assert all(r["valid"] and not r["valid_after_shrink"] for r in results)
    assert "has 2 ranks but the world has 4; choose dims whose product is 4" in results[0]["bad"]
    parts = [r["parts"] for r in results]
    # 11 layers: Embed (56 params), tied (64), 3 Blocks (72 each), a function, 3 Blocks, tied (64), Head (27).
    assert parts[0]["uniform"][0] == [0, 3, 6, 9, 11]
    assert parts[0]["parameters"][0] == [0, 3, 6, 8, 11]  # loads 192, 144, 144, 163
    assert parts[0]["type:block"][0] == [0, 4, 7, 8, 11]  # blocks per stage 2, 2, 1, 1
    assert parts[0]["[0, 1, 1, 5, 11]"][0] == [0, 1, 1, 5, 11]
    assert parts[0]["uniform"][1] == [
        "0.lin.bias",
        "0.lin.weight",
        "2.lin.bias",
        "2.lin.weight",
        "tied_modules.proj.weight",
    ]
    assert parts[1]["[0, 1, 1, 5, 11]"][1] == []  # an empty stage passes its input through
    assert parts[3]["uniform"][1] == ["10.lin.bias", "10.lin.weight", "tied_modules.proj.weight"]
    assert (
        "partition_method 'type:Conv' matches no layer; layer types are ['Block', 'Embed', 'Head', "
        "'Linear', 'scale_half']" in results[0]["no_match"]
    )
    assert "num_stages=3 must be an int >= 1 dividing the world size 4" in results[0]["indivisible"]


def test_single_process_grid_has_no_groups() -> None:
    grid = PipelineParallelGrid()
    assert (grid.get_stage_id(), grid.get_pipe_parallel_world_size(), grid.get_data_parallel_world_size()) == (0, 1, 1)
    assert grid.get_data_parallel_group() is None and grid.is_first_stage and grid.is_last_stage
    with pytest.raises(ValueError, match="has 2 ranks but the world has 1"):
        PipelineParallelGrid(PipeDataParallelTopology(2, 1))
