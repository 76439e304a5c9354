"""`FlatParamGroup.use_buffer`: swapping a ZeRO-1/2 group's flat buffer (ZenFlow's overlapped update does it at
each window's end) re-points every parameter at the new buffer, with or without views kept by the caller."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_zero._stage12.flat_buffer import FlatParamGroup


def _group() -> tuple[nn.Module, FlatParamGroup]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    params = list(model.parameters())
    return model, FlatParamGroup(params, [f"p{i}" for i in range(len(params))], num_partitions=2, rank=1)


@pytest.mark.parametrize("kept_views", [False, True])
def test_use_buffer_repoints_every_parameter(kept_views: bool) -> None:
    model, flat = _group()
    x = torch.randn(4, 5)
    before = model(x)
    other = flat.flat.clone()
    views = flat.param_views(other) if kept_views else None
    flat.use_buffer(other, views)
    flat.check_views()
    assert flat.flat is other and flat.own_partition.data_ptr() == other[flat.own_start :].data_ptr()
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    other.mul_(2.0)  # the model now reads the new buffer
    assert torch.equal(model[0].weight, flat.slot_view(other, flat.slots[0]))
    assert not torch.equal(model(x), before)


def test_a_buffer_that_does_not_fit_is_refused() -> None:
    _model, flat = _group()
    with pytest.raises(
        ValueError, match="flat buffer of 26 torch.float32 elements on cpu is needed, got \\(26,\\) torch.float64"
    ):
        flat.use_buffer(torch.zeros(flat.padded_numel, dtype=torch.float64))
    with pytest.raises(ValueError, match="got \\(25,\\)"):
        flat.param_views(torch.zeros(flat.padded_numel - 1))


@pytest.mark.parametrize(
    ("partitions", "dtype", "swapped"),
    [(1, torch.float32, True), (2, torch.float32, False), (2, torch.bfloat16, True), (4, torch.bfloat16, False)],
)
def test_zenflow_swaps_only_where_the_twin_costs_no_more_than_the_copy(
    partitions: int, dtype: torch.dtype, swapped: bool
) -> None:
    """The twin is a whole flat buffer in the model's dtype, the stale copy it replaces one fp32 partition."""
    from ds_zero._zenflow.results import result_slots

    model = nn.Linear(8, 8).to(dtype)
    params = list(model.parameters())
    flat = FlatParamGroup(params, ["w", "b"], num_partitions=partitions, rank=0)
    master = torch.zeros(flat.partition_numel, dtype=torch.float32)
    slots = result_slots([flat], [master])
    assert (type(slots).__name__ == "SwappedBuffers") is swapped
