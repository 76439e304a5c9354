"""Partitioning: exact boundaries for small cases, and optimality of the balanced split against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from ds_pipe import partition_balanced, partition_uniform, prefix_sum_inc


@pytest.mark.parametrize(
    ("items", "parts", "expected"),
    [
        (10, 4, [0, 3, 6, 8, 10]),
        (8, 4, [0, 2, 4, 6, 8]),
        (7, 3, [0, 3, 5, 7]),
        (5, 1, [0, 5]),
        (2, 4, [0, 1, 2, 2, 2]),
        (0, 2, [0, 0, 0]),
        (4, 4, [0, 1, 2, 3, 4]),
    ],
)
def test_partition_uniform(items: int, parts: int, expected: list[int]) -> None:
    assert partition_uniform(items, parts) == expected


def test_partition_uniform_exhaustive_sizes_differ_by_at_most_one() -> None:
    for items in range(0, 20):
        for parts in range(1, 9):
            bounds = partition_uniform(items, parts)
            sizes = [b - a for a, b in itertools.pairwise(bounds)]
            assert bounds[0] == 0 and bounds[-1] == items and len(sizes) == parts
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(
    ("weights", "parts", "expected"),
    [
        ([1] * 9 + [10], 3, [0, 5, 9, 10]),  # the bottleneck is 10; the rest split evenly
        ([10, 0, 10, 0], 2, [0, 2, 4]),  # zero-weight layers stay with the layer before
        ([0, 1, 1, 1, 1, 0], 2, [0, 3, 6]),  # type:Block-style binary weights
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [0, 5, 7, 9]),
        ([5, 5, 5, 5], 4, [0, 1, 2, 3, 4]),
        ([3, 1, 1, 1], 2, [0, 1, 4]),
        ([1, 1], 3, [0, 1, 2, 2]),  # fewer items than parts: uniform
        ([0, 0, 0, 0], 2, [0, 2, 4]),  # all zero: uniform
        ([7], 1, [0, 1]),
    ],
)
def test_partition_balanced_exact(weights: list[float], parts: int, expected: list[int]) -> None:
    assert partition_balanced(weights, parts) == expected


def _all_splits(n: int, parts: int) -> list[list[int]]:
    return [[0, *cuts, n] for cuts in itertools.combinations(range(1, n), parts - 1)]


def test_partition_balanced_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n, parts = rng.randint(2, 9), rng.randint(1, 5)
        if n <= parts:
            continue
        weights = [rng.choice([0, 1, 2, 3, 5, 8, 13, 100]) for _ in range(n)]
        if sum(weights) == 0:
            continue
        got = partition_balanced(weights, parts)
        loads = [sum(weights[a:b]) for a, b in itertools.pairwise(got)]
        assert all(b > a for a, b in itertools.pairwise(got)), "every part is non-empty"
        best = min(max(sum(weights[a:b]) for a, b in itertools.pairwise(s)) for s in _all_splits(n, parts))
        assert max(loads) == best, (weights, parts, got)
        tied = [s for s in _all_splits(n, parts) if max(sum(weights[a:b]) for a, b in itertools.pairwise(s)) == best]
        least_squares = min(sum(sum(weights[a:b]) ** 2 for a, b in itertools.pairwise(s)) for s in tied)
        assert sum(x * x for x in loads) == least_squares, (weights, parts, got)


def test_prefix_sum_inc() -> None:
    assert prefix_sum_inc([1, 2, 3]) == [1, 3, 6]
    assert prefix_sum_inc([]) == []


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="num_parts must be an int >= 1, got 0"):
        partition_uniform(3, 0)
    with pytest.raises(ValueError, match="num_items must be an int >= 0, got -1"):
        partition_uniform(-1, 2)
    with pytest.raises(ValueError, match="weights must be >= 0; item 1 has -2.0"):
        partition_balanced([1, -2, 3], 2)
