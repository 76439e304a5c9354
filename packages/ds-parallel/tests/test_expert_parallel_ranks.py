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
    with pytest.raises(NotImplementedError, match="D\\+E"):
        _get_expert_parallel_ranks(8, 1, 2, use_data_before_expert_parallel_=True)
