"""`_get_expert_parallel_ranks`: DeepSpeed's E + M + D rank layout, computed without process groups."""

from __future__ import annotations

import itertools

import pytest

from ds_parallel.groups import _get_expert_parallel_ranks


def test_tensor_parallel_world_of_sixteen() -> None:
    ep, edp = _get_expert_parallel_ranks(world_size=16, tensor_parallel_size_=2, expert_parallel_size_=4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]


def test_plain_data_parallel_matches_consecutive_expert_groups() -> None:
    # tp = pp = 1: expert groups are consecutive ranks, as ds-parallel's MoE groups are built.
    ep, edp = _get_expert_parallel_ranks(world_size=4, tensor_parallel_size_=1, expert_parallel_size_=2)
    assert ep == [[0, 1], [2, 3]]
    assert edp == [[0, 2], [1, 3]]


@pytest.mark.parametrize(("world", "tp", "ep_size", "pp"), [(8, 1, 2, 2), (24, 2, 3, 2), (16, 4, 1, 1), (8, 1, 8, 1)])
def test_every_rank_once_and_within_its_data_parallel_group(world: int, tp: int, ep_size: int, pp: int) -> None:
    ep, edp = _get_expert_parallel_ranks(world, tp, ep_size, pp)
    assert sorted(itertools.chain(*ep)) == list(range(world))
    assert sorted(itertools.chain(*edp)) == list(range(world))
    stage = world // pp
    for group in ep:
        assert len(group) == ep_size
        # one pipeline stage, one tensor-parallel index
        assert len({r // stage for r in group}) == 1 and len({r % tp for r in group}) == 1
    for group in edp:
        assert len(group) == world // (tp * pp * ep_size)


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size_"):
        _get_expert_parallel_ranks(10, 4, 1)
    with pytest.raises(ValueError, match="not divisible by expert_parallel_size_ 3"):
        _get_expert_parallel_ranks(8, 2, 3)


def test_data_before_expert_layout() -> None:
    # DeepSpeed's D + M + E example: world 16, tp 2, ep 2 -> the data-parallel lane [0, 2, ..., 14] splits
    # into two expert-data-parallel blocks, expert-parallel groups take one rank of each.
    ep, edp = _get_expert_parallel_ranks(16, 2, 2, use_data_before_expert_parallel_=True)
    assert ep[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    assert edp[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert ep[4] == [1, 9] and edp[2] == [1, 3, 5, 7]


def test_layouts_of_experts_that_are_not_tensor_parallel() -> None:
    """DeepSpeed's `_create_expert_and_data_parallel` lists (world 8, ep 2, and a 2-stage pipeline)."""
    from ds_parallel.moe._layouts import expert_rank_lists

    assert expert_rank_lists(8, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert expert_rank_lists(8, 2, data_before_expert=True) == (
        [[0, 4], [1, 5], [2, 6], [3, 7]],
        [[0, 1, 2, 3], [4, 5, 6, 7]],
    )
    # a tensor-parallel model does not change it (peers split tokens, any exchange sees each slice once)
    assert expert_rank_lists(8, 2, tp_size=2) == expert_rank_lists(8, 2)
    assert expert_rank_lists(8, 2, pp_size=2, data_before_expert=True) == (
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 1], [2, 3], [4, 5], [6, 7]],
    )
    with pytest.raises(ValueError, match="expert_parallel_size 3 does not divide the 8 ranks"):
        expert_rank_lists(8, 3)
