"""Process groups on 2 gloo ranks: destroyed groups leave no cached backend; errors after a timeout are named right."""

from __future__ import annotations

import time

import torch

import ds_comm
from ds_comm import _group_cache
from ds_comm.testing import run_ranks


def _destroy_and_recreate(rank: int, world: int) -> list[float]:
    sums = []
    for _ in range(3):
        group = ds_comm.new_group([0, 1])
        t = torch.ones(1)
        ds_comm.all_reduce(t, group=group)
        sums.append(float(t))
        assert group in _group_cache._waits_on_cpu
        ds_comm.destroy_process_group(group)
        assert group not in _group_cache._waits_on_cpu, "a destroyed group's backend is still cached"
        del group
    return sums


def test_destroyed_groups_are_forgotten_and_new_ones_work() -> None:
    assert run_ranks(2, _destroy_and_recreate, timeout_s=60) == [[2.0] * 3] * 2


def _timeout_then_retry(rank: int, world: int) -> list[str]:
    if rank == 1:
        time.sleep(6)  # never joins
        return []
    seen = []
    for _ in range(2):
        start = time.monotonic()
        try:
            ds_comm.all_reduce(torch.ones(1))
        except ds_comm.CollectiveError as err:
            seen.append(f"{type(err).__name__} {time.monotonic() - start:.1f}s: {err}")
    return seen


def test_the_failure_after_a_timeout_is_not_reported_as_another_timeout() -> None:
    first, second = run_ranks(2, _timeout_then_retry, timeout_s=60, collective_timeout_s=2)[0]
    assert first.startswith("CollectiveTimeoutError") and "did not complete within 0:00:02" in first, first
    # gloo closed the connections when the first op timed out; the next op fails at once, with
    # "timeout" in torch's message. That is a failure, not a second 2 s timeout.
    assert second.startswith("CollectiveError") and " failed on rank 0" in second, second
