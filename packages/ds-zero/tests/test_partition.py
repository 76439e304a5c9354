"""Partition arithmetic: padding, owner ranges, parameter fragments of a partition."""

from __future__ import annotations

import pytest

from ds_zero._partition import Fragment, ParamSlot, fragments_in_range, owner_pieces, padded_numel


def test_padding_is_less_than_the_number_of_partitions() -> None:
    assert padded_numel(10, 4) == 12
    assert padded_numel(12, 4) == 12
    assert padded_numel(0, 4) == 0
    assert all(0 <= padded_numel(n, w) - n < w for n in range(50) for w in range(1, 9))
    with pytest.raises(ValueError, match="num_partitions must be >= 1"):
        padded_numel(3, 0)


def test_fragments_split_a_parameter_at_partition_boundaries() -> None:
    slots = [ParamSlot("a", (2, 3), 0, 6), ParamSlot("b", (5,), 6, 5)]  # 11 elements, 2 ranks of 6
    assert fragments_in_range(slots, 0, 6) == [Fragment("a", 0, 6, 0)]
    assert fragments_in_range(slots, 6, 12) == [Fragment("b", 0, 5, 0)]
    # 3 ranks of 4: "a" straddles ranks 0/1, "b" straddles ranks 1/2
    assert fragments_in_range(slots, 4, 8) == [Fragment("a", 4, 2, 0), Fragment("b", 0, 2, 2)]
    assert fragments_in_range(slots, 8, 12) == [Fragment("b", 2, 3, 0)]


def test_fragment_encoding_roundtrips_plain_types() -> None:
    f = Fragment("w", 3, 4, 5)
    assert f.to_list() == ["w", 3, 4, 5]
    assert Fragment.from_list(f.to_list()) == f


def test_owner_pieces_cut_a_range_by_owning_rank() -> None:
    assert owner_pieces(0, 4, 4) == [(0, 0, 4)]
    assert owner_pieces(2, 11, 4) == [(0, 2, 4), (1, 4, 8), (2, 8, 11)]
    assert owner_pieces(5, 5, 4) == []
