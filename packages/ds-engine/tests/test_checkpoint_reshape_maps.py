"""`deepspeed.checkpoint.model_3d_desc` and `reshape_meg_2d_parallel`: rank maps worked out by hand.

Source model-parallel ranks are numbered pp-major (rank = stage * tp + slice); ZeRO file index
= dp * (pp * tp) + mp. A reshape first merges tp slices within a stage into contiguous runs, then
stages within each slice, then lists every dp shard of each merged model-parallel rank and cuts that
list into the target dp's contiguous runs.

4x2x2 -> 2x1x1 (pp x tp x dp): mp ranks 0..7, stage s holds [2s, 2s+1].
    tp 2 -> 1: stage cells [0,1] [2,3] [4,5] [6,7]
    pp 4 -> 2: slice 0 column [0..7] cut in two: stage 0 [0,1,2,3], stage 1 [4,5,6,7]
    dp (mp size 8, 2 shards each): stage 0 [0,8,1,9,2,10,3,11], stage 1 [4,12,5,13,6,14,7,15]; one target dp rank.
1x4x2 -> 1x2x1: mp ranks 0..3 on one stage.
    tp 4 -> 2: [0,1] [2,3]; pp unchanged
    dp (mp size 4): slice 0 [0,4,1,5], slice 1 [2,6,3,7]; one target dp rank.
2x2x4 -> 1x2x2: mp ranks 0..3.
    tp unchanged; pp 2 -> 1: slice 0 [0,2], slice 1 [1,3]
    dp (mp size 4, 4 shards): slice 0 [0,4,8,12,2,6,10,14] cut in two -> dp 0 [0,4,8,12], dp 1 [2,6,10,14];
    slice 1 likewise [1,5,9,13] / [3,7,11,15].
"""

from __future__ import annotations

import pytest

from ds_engine.checkpoint import model_3d_desc, reshape_meg_2d_parallel
from ds_engine.checkpoint.reshape_meg_2d import meg_2d_parallel_map
from ds_engine.checkpoint.reshape_utils import partition_data


def _cells(grid: meg_2d_parallel_map) -> dict[tuple[int, int], list[int]]:
    return {(p, t): grid.get_data(p, t) for p in range(grid.pp_degree) for t in range(grid.tp_degree)}


def test_4x2x2_to_2x1x1() -> None:
    maps = model_3d_desc(4, 2, 2).reshape(model_3d_desc(2, 1, 1))
    assert [_cells(m) for m in maps] == [{(0, 0): [0, 8, 1, 9, 2, 10, 3, 11], (1, 0): [4, 12, 5, 13, 6, 14, 7, 15]}]


def test_1x4x2_to_1x2x1() -> None:
    maps = model_3d_desc(1, 4, 2).reshape(model_3d_desc(1, 2, 1))
    assert [_cells(m) for m in maps] == [{(0, 0): [0, 4, 1, 5], (0, 1): [2, 6, 3, 7]}]


def test_2x2x4_to_1x2x2() -> None:
    maps = model_3d_desc(2, 2, 4).reshape(model_3d_desc(1, 2, 2))
    assert [_cells(m) for m in maps] == [
        {(0, 0): [0, 4, 8, 12], (0, 1): [1, 5, 9, 13]},
        {(0, 0): [2, 6, 10, 14], (0, 1): [3, 7, 11, 15]},
    ]


def test_same_layout_is_the_identity() -> None:
    """Each target rank reads exactly its own file: index dp * 6 + stage * 2 + slice."""
    maps = model_3d_desc(3, 2, 2).reshape(model_3d_desc(3, 2, 2))
    for dp, grid in enumerate(maps):
        assert _cells(grid) == {(p, t): [dp * 6 + p * 2 + t] for p in range(3) for t in range(2)}


def test_every_source_file_is_read_exactly_once() -> None:
    src = model_3d_desc(4, 4, 2)
    for target in (model_3d_desc(2, 2, 2), model_3d_desc(1, 4, 1), model_3d_desc(4, 1, 2), model_3d_desc(1, 1, 1)):
        read = [i for grid in src.reshape(target) for i in grid.get_data()]
        assert sorted(read) == list(range(src.world_size()))


def test_2d_map_pp_then_tp() -> None:
    """3x4 -> 3x2: stage s reads slices [4s, 4s+1] and [4s+2, 4s+3]; then 3x2 -> 1x2 stacks the stages."""
    assert _cells(reshape_meg_2d_parallel(3, 4, 3, 2)) == {
        (s, t): [4 * s + 2 * t, 4 * s + 2 * t + 1] for s in range(3) for t in range(2)
    }
    assert _cells(reshape_meg_2d_parallel(3, 4, 1, 2)) == {(0, 0): [0, 1, 4, 5, 8, 9], (0, 1): [2, 3, 6, 7, 10, 11]}


@pytest.mark.parametrize(
    ("source", "target", "messages"),
    [
        ((2, 2, 2), (4, 1, 1), ["Expansion reshape not supported - PP: 2 ---> 4"]),
        ((3, 1, 1), (2, 1, 1), ["Uneven reshape not supported - PP: 2 does not divide 3"]),
        ((2, 6, 1), (2, 4, 1), ["Uneven reshape not supported - TP: 4 does not divide 6"]),
        (
            (2, 2, 3),
            (1, 4, 2),
            [
                "Expansion reshape not supported - TP: 2 ---> 4",
                "Uneven reshape not supported - DP: 2 does not divide 3",
            ],
        ),
    ],
)
def test_refusals_name_every_dimension(
    source: tuple[int, int, int], target: tuple[int, int, int], messages: list[str]
) -> None:
    src, tgt = model_3d_desc(*source), model_3d_desc(*target)
    assert src.can_reshape(tgt) == (False, messages)
    with pytest.raises(ValueError, match="cannot reshape PP,TP,DP = ") as err:
        src.reshape(tgt)
    assert all(m in str(err.value) for m in messages)


@pytest.mark.parametrize(("old", "new"), [((3, 1), (2, 1)), ((2, 6), (2, 4)), ((2, 2), (2, 4)), ((2, 2), (0, 1))])
def test_2d_refusals(old: tuple[int, int], new: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="the target must be >= 1 and divide the source"):
        reshape_meg_2d_parallel(*old, *new)


def test_descriptor_accessors_and_bad_degrees() -> None:
    desc = model_3d_desc(pp_degree=2, tp_degree=3, dp_degree=4)
    assert desc.world_size() == 24 and desc.get_desc() == "PP,TP,DP = (2, 3, 4)"
    assert desc.is_valid(1, 2, 3) == (True, [])
    assert desc.is_valid(2, 0, 4) == (
        False,
        ["PP indexing error: index 2 >= degree 2", "DP indexing error: index 4 >= degree 4"],
    )
    assert desc == model_3d_desc(2, 3, 4) and desc != model_3d_desc(2, 3, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp_degree must be a positive integer"):
            model_3d_desc(1, bad, 1)  # type: ignore[arg-type]


def test_2d_map_cells_and_indices() -> None:
    grid = meg_2d_parallel_map(2, 2)
    grid.simple_init()
    assert (
        grid.get_data() == [0, 1, 2, 3] and grid.get_data(pp_index=1) == [2, 3] and grid.get_data(tp_index=1) == [1, 3]
    )
    grid.add_data(0, 1, [7])
    assert grid.get_data(0, 1) == [1, 7]
    with pytest.raises(IndexError, match="tp_index 2 outside tp_degree 2"):
        grid.get_data(0, 2)
    with pytest.raises(TypeError, match="must be a list"):
        grid.add_data(0, 0, (1,))  # type: ignore[arg-type]


def test_partition_data() -> None:
    assert partition_data(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="cannot split 6 entries into 4 equal partitions"):
        partition_data(list(range(6)), 4)
