"""Hangs become named errors: mismatched collectives, a failing rank, a silent death, a harness timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ds_comm
from ds_comm.testing import RankFailedError, RankTimeoutError, run_ranks


def _mismatched(rank: int, world: int) -> None:
    if rank == 0:
        ds_comm.all_reduce(torch.ones(4))
    else:
        ds_comm.broadcast(torch.ones(8), src=1)


def test_mismatched_collective_names_op_group_and_rank() -> None:
    start = time.monotonic()
    with pytest.raises(ds_comm.CollectiveError, match=r"(all_reduce|broadcast) on world group \(2 ranks\) .* rank \d"):
        run_ranks(2, _mismatched, timeout_s=40, collective_timeout_s=3)
    assert time.monotonic() - start < 40


def _one_rank_skips(rank: int, world: int) -> None:
    if rank == 0:
        ds_comm.all_reduce(torch.ones(4))
    else:
        time.sleep(8)  # stays alive but never joins: the classic hang


def test_abandoned_collective_times_out_with_named_op() -> None:
    with pytest.raises(
        ds_comm.CollectiveTimeoutError,
        match=r"all_reduce on world group \(2 ranks\) did not complete within 0:00:02 on rank 0",
    ):
        run_ranks(2, _one_rank_skips, timeout_s=40, collective_timeout_s=2)


def _raises_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("boom on one")
    time.sleep(30)


def test_failing_rank_reraised_with_traceback_and_others_killed() -> None:
    start = time.monotonic()
    with pytest.raises(KeyError, match="boom on one") as info:
        run_ranks(2, _raises_on_rank_one, timeout_s=60)
    assert time.monotonic() - start < 20, "rank 0 should have been killed, not waited for"
    assert "raised on rank 1" in "".join(info.value.__notes__)
    assert "_raises_on_rank_one" in str(info.value.__cause__)


def _dies(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(7)
    time.sleep(30)


def test_silent_death_is_reported() -> None:
    with pytest.raises(RankFailedError, match="rank 0 exited with code 7"):
        run_ranks(2, _dies, timeout_s=60)


def _sleeps(rank: int, world: int) -> None:
    time.sleep(60)


def test_harness_timeout_kills_the_job() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 4"):
        run_ranks(2, _sleeps, timeout_s=4)
    assert time.monotonic() - start < 15


def _start_a_child(rank: int, world: int) -> int:
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=time.sleep, args=(0.1,))
    child.start()
    child.join(timeout=30)
    return child.exitcode


def test_non_daemonic_ranks_may_start_processes() -> None:
    """A rank that runs a worker process of its own (ZenFlow's `overlap_step`) needs `daemonic=False`:
    Python refuses children to a daemonic process, which the default keeps."""
    assert run_ranks(2, _start_a_child, timeout_s=60, daemonic=False) == [0, 0]
    with pytest.raises(AssertionError, match="daemonic processes are not allowed to have children"):
        run_ranks(1, _start_a_child, timeout_s=60)
