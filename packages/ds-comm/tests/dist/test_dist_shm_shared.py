"""Two ranks each own a tensor in shared memory and read the other's between barriers.

Each round both ranks write their own tensor, meet at a barrier, read the peer's in place and meet again;
the values of every round must be the peer's of that round, which holds only if the barrier really waits
(a rank that ran ahead would overwrite what its peer is still reading, or read before the peer wrote).
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch

import ds_comm
from ds_comm.testing import run_ranks

NUMEL = 3 * 2**20 + 5  # more than a page, not a multiple of one


def _rounds(rank: int, world: int) -> list[bool]:
    shared = ds_comm.pair_shared_tensor(NUMEL, torch.float32)
    assert shared is not None
    assert torch.count_nonzero(shared.mine) == 0  # zero-filled
    seen = []
    for step in range(6):
        if rank == 1 and step % 2:
            time.sleep(0.05)  # one rank late every other round: the other must wait, not read early
        shared.mine.fill_(float(10 * step + rank))
        shared.barrier()
        seen.append(bool((shared.peer == float(10 * step + 1 - rank)).all()))
        shared.barrier()
    return seen


def test_each_round_reads_the_peers_values_of_that_round() -> None:
    assert run_ranks(2, _rounds, timeout_s=60) == [[True] * 6, [True] * 6]


def _counters(rank: int, world: int) -> list[bool]:
    shared = ds_comm.pair_shared_tensor(8, torch.float32)
    assert shared is not None
    seen = [shared.peer_reached(1, 1)]  # before the barrier no rank has posted anything
    shared.barrier()
    if rank == 0:
        shared.post(1, 1)
    else:
        shared.wait_for(1, 1, "post 1")
        seen += [shared.peer_reached(1, 1), shared.peer_reached(1, 2)]  # rank 0 is held at the barrier
    shared.barrier()
    return seen


def test_peer_reached_reads_the_peers_counter_without_waiting() -> None:
    assert run_ranks(2, _counters, timeout_s=60) == [[False], [False, True, False]]


def _switched_off(rank: int, world: int) -> tuple[bool, list[str]]:
    if rank == 1:
        os.environ["DS_COMM_SHM"] = "0"
    shared = ds_comm.pair_shared_tensor(16, torch.bfloat16)
    return shared is None, glob.glob(f"/dev/shm/ds_comm_shared_{os.getpid()}_*")


def test_the_switch_on_one_rank_gives_none_to_both_and_leaves_no_file() -> None:
    assert run_ranks(2, _switched_off, timeout_s=60) == [(True, []), (True, [])]


def _files(rank: int, world: int) -> tuple[tuple[torch.dtype, int], list[str]]:
    shared = ds_comm.pair_shared_tensor(100, torch.int64)
    assert shared is not None
    return (shared.mine.dtype, shared.peer.numel()), glob.glob(f"/dev/shm/ds_comm_shared_{os.getpid()}_*")


def test_the_segments_leave_no_file_behind() -> None:
    assert run_ranks(2, _files, timeout_s=60) == [((torch.int64, 100), [])] * 2


def _mismatch(rank: int, world: int) -> None:
    ds_comm.pair_shared_tensor(10 + rank, torch.float32)


def test_different_sizes_are_named() -> None:
    with pytest.raises(Exception, match="this rank asked for 4[04] bytes and its peer for 4[04]"):
        run_ranks(2, _mismatch, timeout_s=60)


def _one_misses_a_barrier(rank: int, world: int) -> None:
    from datetime import timedelta

    shared = ds_comm.pair_shared_tensor(8, torch.float32)
    assert shared is not None
    if rank == 0:
        shared.barrier(timeout=timedelta(seconds=2))


def test_a_barrier_the_peer_never_reaches_times_out_or_names_the_gone_peer() -> None:
    with pytest.raises(Exception, match="timed out waiting for the peer to reach barrier 1|peer process .* exited"):
        run_ranks(2, _one_misses_a_barrier, timeout_s=60)


def _three(rank: int, world: int) -> bool:
    return ds_comm.pair_shared_tensor(4, torch.float32) is None


def test_a_group_of_three_gets_none() -> None:
    assert run_ranks(3, _three, timeout_s=60) == [True] * 3
