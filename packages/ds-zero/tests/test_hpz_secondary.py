"""hpZ secondary slices in one process: the layout, zero padding, `Init._partition_param_sec`, bad sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero._params.partitioned_param import ZeroParamStatus
from ds_zero._params.secondary import write_secondary


def _param(values: list[float], dtype: torch.dtype = torch.float32) -> nn.Parameter:
    p = nn.Parameter(torch.tensor(values, dtype=dtype))
    p.ds_numel = p.numel()
    p.ds_secondary_tensor = None
    return p


def test_slice_of_the_padded_layout_with_zero_padding() -> None:
    # 5 elements padded to 8, blocks of 2: block rank 0 holds [0, 4), block rank 1 [4, 8) = (5.0, 0, 0, 0)
    p = _param([1.0, 2.0, 3.0, 4.0, 5.0])
    for rank, expected in ((0, [1.0, 2.0, 3.0, 4.0]), (1, [5.0, 0.0, 0.0, 0.0])):
        p.ds_secondary_tensor = None
        sec = write_secondary(p, p.data, aligned_numel=8, group_size=2, rank_in_group=rank, device="cpu")
        assert sec is p.ds_secondary_tensor and sec.requires_grad is False and sec.ds_numel == 4
        assert torch.equal(sec, torch.tensor(expected))


def test_a_slice_wholly_past_the_values_is_zero_and_stale_values_are_cleared() -> None:
    p = _param([7.0, 8.0], dtype=torch.bfloat16)
    p.ds_secondary_tensor = torch.full((3,), -1.0, dtype=torch.bfloat16)
    sec = write_secondary(p, p.data, aligned_numel=6, group_size=2, rank_in_group=1, device="cpu")
    assert sec is p.ds_secondary_tensor  # the buffer is reused
    assert torch.equal(sec, torch.zeros(3, dtype=torch.bfloat16))


def test_init_partition_param_sec_uses_the_config_layout() -> None:
    model = nn.Linear(4, 2, bias=False)  # 8 elements; one process: blocks of 2 -> this rank's slice is [0, 4)
    init = ds_zero.Init(module=model, config_dict_or_path={"zero_optimization": {"zero_hpz_partition_size": 2}})
    assert (init.num_ranks_in_param_group, init.rank_in_group, init.dp_world_size) == (2, 0, 1)
    w = model.weight
    with ds_zero.GatheredParameters([w]):
        full = w.detach().reshape(-1).clone()
        init._partition_param_sec(w)
        first = w.ds_secondary_tensor
        assert torch.equal(first, full[:4])
        with torch.no_grad():
            w.mul_(2)
        init._partition_param_sec(w)  # already there and not updated: kept as it was
        assert torch.equal(w.ds_secondary_tensor, full[:4])
        init._partition_param_sec(w, has_been_updated=True)
        assert w.ds_secondary_tensor is first and torch.equal(first, 2 * full[:4])
    assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE
    before = w.ds_secondary_tensor.clone()
    init._partition_param_sec(w, has_been_updated=True)  # released: nothing to slice
    assert torch.equal(w.ds_secondary_tensor, before)


def test_block_size_must_divide_the_data_parallel_world() -> None:
    with pytest.raises(ValueError, match="zero_hpz_partition_size=2 must divide the data-parallel world size 1"):
        ds_zero.DeepSpeedZeRoOffload(nn.Linear(2, 2), config={"stage": 3, "zero_hpz_partition_size": 2})
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):
        ds_zero.ZeroConfig(stage=3, zero_hpz_partition_size=0)


def test_without_hpz_there_is_no_secondary_slice() -> None:
    model = nn.Linear(4, 4)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 3})
    opt.backward(model(torch.ones(1, 4)).sum())
    opt.step()
    assert all(p.ds_secondary_tensor is None for p in model.parameters())
    assert opt.parameter_offload.num_block_param_gathers == 0
