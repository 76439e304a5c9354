"""`single_rank_group_error`: when `Init` must refuse the group it found (see `ds_zero._construct.launcher_world`).

Only a one-rank group that `Init` resolved itself, under a launcher `WORLD_SIZE` above one, is an error;
`Init`'s refusal of it in a real process group is checked in `test_stage3_handles_and_init.py`.
"""

from __future__ import annotations

import pytest

from ds_zero import single_rank_group_error


def test_one_rank_group_under_a_larger_launch_is_an_error_naming_sizes_and_fix() -> None:
    message = single_rank_group_error(1, None, env={"WORLD_SIZE": "4"})
    assert message is not None
    assert "WORLD_SIZE=4" in message
    assert "1 rank" in message
    assert "init_distributed()" in message and "data_parallel_group=" in message


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": "0"}])
def test_a_single_process_launch_is_fine(env: dict[str, str]) -> None:
    assert single_rank_group_error(1, None, env=env) is None


def test_a_group_that_shards_is_fine() -> None:
    assert single_rank_group_error(4, None, env={"WORLD_SIZE": "4"}) is None
    # a data-parallel group smaller than the world (model parallelism) still shards
    assert single_rank_group_error(2, None, env={"WORLD_SIZE": "8"}) is None


def test_an_explicit_one_rank_group_is_taken_as_intended() -> None:
    assert single_rank_group_error(1, object(), env={"WORLD_SIZE": "8"}) is None


@pytest.mark.parametrize("value", ["", "eight", None])
def test_an_unreadable_world_size_is_not_an_error(value: str | None) -> None:
    assert single_rank_group_error(1, None, env={"WORLD_SIZE": value}) is None


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "WORLD_SIZE=3" in (single_rank_group_error(1, None) or "")
    monkeypatch.delenv("WORLD_SIZE")
    assert single_rank_group_error(1, None) is None
