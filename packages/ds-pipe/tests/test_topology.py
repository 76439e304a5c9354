"""Topologies: rank <-> coordinate maps, axis lists, comm lists and rank tags, with exact expected values."""

from __future__ import annotations

import itertools

import pytest

from ds_pipe import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology


def test_pipe_data_layout_is_row_major() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data"] and topo.world_size() == 4
    assert [tuple(topo.get_coord(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert topo.get_coord(3).pipe == 1 and topo.get_coord(3).data == 1
    assert topo.get_rank(pipe=1, data=0) == 2
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("model") == []
    assert topo.filter_match(pipe=1) == [2, 3]
    assert topo.filter_match(pipe=0, data=1) == [1]
    assert topo.get_axis_list("data", 0) == [0, 2]
    assert topo.get_axis_list("model", 0) == []
    assert topo.get_dim("pipe") == 2 and topo.get_dim("model") == 0
    assert topo.get_rank_repr(3) == ""


def test_pipe_model_data_argument_order_quirk() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.dims == [2, 3, 2] and topo.world_size() == 12
    assert tuple(topo.get_coord(7)) == (1, 0, 1)
    assert topo.get_rank(pipe=1, data=2, model=0) == 10
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert topo.get_axis_comm_lists("data") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert topo.filter_match(data=1, model=1) == [3, 9]
    assert topo.get_rank_repr(7) == "model_01"
    assert topo.get_rank_repr(7, omit_axes=[]) == "pipe_01-data_00-model_01"
    assert topo.get_rank_repr(7, omit_axes=["data"], inner_sep="=", outer_sep="/") == "pipe=01/model=01"


@pytest.mark.parametrize("dims", [[1], [3], [2, 2], [1, 4], [2, 3, 2], [3, 1, 2], [2, 2, 2, 2]])
def test_exhaustive_round_trips(dims: list[int]) -> None:
    axes = ["pipe", "data", "model", "extra"][: len(dims)]
    topo = ProcessTopology(axes, dims)
    world = topo.world_size()
    coords = list(itertools.product(*(range(d) for d in dims)))
    assert [tuple(topo.get_coord(r)) for r in range(world)] == coords
    for rank, coord in enumerate(coords):
        assert topo.get_rank(**dict(zip(axes, coord, strict=False))) == rank
    for axis in axes:
        lists = topo.get_axis_comm_lists(axis)
        assert sorted(r for group in lists for r in group) == list(range(world))
        assert all(len(group) == topo.get_dim(axis) for group in lists)
        for group in lists:
            first = topo.get_coord(group[0])
            varying = {a for a in axes for r in group[1:] if getattr(topo.get_coord(r), a) != getattr(first, a)}
            assert varying <= {axis}
            assert [getattr(topo.get_coord(r), axis) for r in group] == list(range(topo.get_dim(axis)))
        for idx in range(topo.get_dim(axis)):
            assert topo.get_axis_list(axis, idx) == topo.filter_match(**{axis: idx})


@pytest.mark.parametrize(
    ("axes", "dims", "message"),
    [
        (["pipe", "data"], [2], "must have the same length"),
        ([], [], "at least one axis"),
        (["pipe", "pipe"], [2, 2], "must be unique"),
        (["pipe", "data"], [2, 0], "dim of axis 'data' must be an int >= 1, got 0"),
    ],
)
def test_bad_topology_is_named(axes: list[str], dims: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProcessTopology(axes, dims)


def test_bad_queries_are_named() -> None:
    topo = PipeDataParallelTopology(2, 2)
    with pytest.raises(ValueError, match=r"needs exactly the axes \['pipe', 'data'\]"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match=r"data=2 is out of range \[0, 2\)"):
        topo.get_rank(pipe=0, data=2)
    with pytest.raises(ValueError, match=r"rank 4 is out of range \[0, 4\)"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match=r"unknown axes \['model'\]"):
        topo.filter_match(model=0)
