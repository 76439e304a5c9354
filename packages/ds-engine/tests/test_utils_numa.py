"""`deepspeed.utils.numa.parse_range_list`: DeepSpeed's strict `--bind_core_list` syntax."""

from __future__ import annotations

import pytest

from ds_engine.utils import numa


@pytest.mark.parametrize(
    ("text", "cores"),
    [("5", [5]), ("0-3", [0, 1, 2, 3]), ("1,3-4,10-11", [1, 3, 4, 10, 11]), (" 2 , 4-5 ", [2, 4, 5]), ("7-7", [7])],
)
def test_parse_range_list(text: str, cores: list[int]) -> None:
    assert numa.parse_range_list(text) == cores


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0-4,3-6", "overlaps or comes before core 4"),
        ("6,1-2", "overlaps or comes before core 6"),
        ("2,2", "overlaps or comes before core 2"),
        ("3-1", "runs backwards; write it as '1-3'"),
        ("1,,2", "'' is not a core id"),
        ("a-3", "'a-3' is not a core id"),
        ("-1", "'-1' is not a core id"),
    ],
)
def test_parse_range_list_rejects(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        numa.parse_range_list(text)


def test_reachable_by_deepspeed_path() -> None:
    import ds_engine.utils

    assert ds_engine.utils.numa is numa
