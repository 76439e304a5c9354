"""ParallelDims: degrees checked against the world size, every factor named in the error."""

from __future__ import annotations

import pytest

from ds_parallel import MESH_DIM_NAMES, ParallelDims


def test_dp_takes_the_rest() -> None:
    dims = ParallelDims(world_size=16, pp=2, sp=2, tp=2)
    assert dims.dp == 2
    assert dims.mesh_shape == (2, 2, 1, 2, 2)
    assert MESH_DIM_NAMES == ("pp", "edp", "ep", "sp", "tp")


def test_expert_parallel_splits_data_parallel() -> None:
    dims = ParallelDims(world_size=8, dp=4, ep=2, sp=2)
    assert dims.mesh_shape == (1, 2, 2, 2, 1)


def test_product_mismatch_names_every_factor() -> None:
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(2\) \* sp\(2\) \* tp\(1\) = 8 != world_size 4"):
        ParallelDims(world_size=4, pp=2, dp=2, sp=2)


def test_indivisible_world_names_factors() -> None:
    with pytest.raises(ValueError, match=r"world_size 6 is not divisible by pp\(1\) \* sp\(4\) \* tp\(1\) = 4"):
        ParallelDims(world_size=6, sp=4)


def test_ep_must_divide_dp() -> None:
    with pytest.raises(ValueError, match=r"ep\(3\) must divide dp\(4\)"):
        ParallelDims(world_size=4, ep=3)


@pytest.mark.parametrize("field", ["pp", "sp", "tp", "ep", "world_size"])
def test_non_positive_degree_is_named(field: str) -> None:
    kwargs = {"world_size": 4, field: 0}
    with pytest.raises(ValueError, match=f"{field} must be a positive int, got 0"):
        ParallelDims(**kwargs)


def test_dp_zero_refused() -> None:
    with pytest.raises(ValueError, match="dp must be a positive int or -1"):
        ParallelDims(world_size=4, dp=0)
