"""Two linked ranks send point to point through a shared-memory ring: gloo's bytes, gloo's order, no blocking.

Small messages take the ring and larger ones gloo, interleaved on one pair; receives are posted early and
waited out of order; both ranks send more than the ring holds before either receives (as neighbouring
pipeline stages do), which only works if a full ring queues instead of blocking the send.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm import _shm_p2p
from ds_comm.testing import run_ranks

LARGE = _shm_p2p.SLOT_BYTES // 4 + 1  # fp32 elements: 4 bytes over a slot, so gloo carries it


def _messages(sender: int) -> list[torch.Tensor]:
    """What `sender` sends, in order: sizes on both sides of the slot, odd dtypes, an empty tensor."""
    g = torch.Generator().manual_seed(10 + sender)
    return [
        torch.randn(1, generator=g),
        torch.randn(32, 32, generator=g),
        torch.randn(LARGE, generator=g),  # gloo
        torch.empty(0),
        torch.randint(-(2**40), 2**40, (17,), generator=g),
        torch.randn(1000, generator=g).to(torch.bfloat16),
        torch.randn(_shm_p2p.SLOT_BYTES // 4, generator=g),  # exactly one slot: the ring
        torch.rand(5, generator=g) > 0.5,
        torch.randn(40, generator=g)[8:24],  # a view starting 32 bytes into its storage
    ]


def _round_trip(rank: int, world: int) -> dict[str, object]:
    peer = 1 - rank
    linked = ds_comm.open_shm_p2p(peer)
    mine, theirs = _messages(rank), _messages(peer)
    # both ranks send everything first (more messages than slots), then receive: a blocking send would hang
    rounds = 3 * _shm_p2p.SLOTS // len(mine) + 1
    sends = [ds_comm.isend(t, peer) for _ in range(rounds) for t in mine]
    dests = [torch.full_like(t, 7) if t.numel() else torch.empty_like(t) for _ in range(rounds) for t in theirs]
    handles = [ds_comm.irecv(d, peer) for d in dests]
    for h in reversed(handles):  # the last first: waiting on it takes out every earlier one
        h.wait()
    for h in sends:
        h.wait()
    with pytest.raises(ds_comm.CollectiveError, match="has to be contiguous"):  # as gloo refuses it
        ds_comm.isend(torch.zeros(8, 6).t(), peer)
    equal = [torch.equal(d, t) for d, t in zip(dests, theirs * rounds, strict=True)]
    # a blocking send/recv pair afterwards, and a message of another tag (gloo) between them
    tagged = torch.empty(3)
    if rank == 0:
        ds_comm.send(torch.arange(4.0), peer)
        ds_comm.isend(torch.ones(3), peer, tag=5).wait()
    else:
        got = torch.zeros(10)
        ds_comm.recv(got[3:7], peer)  # into a view: the bytes land where the view starts, nowhere else
        ds_comm.recv(tagged, peer, tag=5)
        expected = torch.cat([torch.zeros(3), torch.arange(4.0), torch.zeros(3)])
        equal.append(torch.equal(got, expected) and torch.equal(tagged, torch.ones(3)))
    link = _shm_p2p._links[dist.group.WORLD][peer]
    ring = (link.messages_sent, link.messages_received) if link is not None else None
    carries = [ds_comm.shm_p2p_carries(p, n) for p, n in ((peer, _shm_p2p.SLOT_BYTES), (peer, _shm_p2p.SLOT_BYTES + 1))]
    return {"linked": linked, "equal": equal, "ring": ring, "rounds": rounds, "carries": carries}


def test_ring_carries_small_messages_in_order_and_gloo_the_large() -> None:
    results = run_ranks(2, _round_trip, timeout_s=120)
    small = (len(_messages(0)) - 1) * results[0]["rounds"]  # every message but the large one, per round
    for rank, res in enumerate(results):
        assert all(res["equal"]), f"rank {rank}: mismatched messages at {res['equal'].index(False)}"
        assert res["linked"] is True
        # the blocking send of rank 0 took the ring too; the tagged one went to gloo
        assert res["ring"] == (small + (rank == 0), small + (rank == 1)), f"rank {rank}"
        assert res["carries"] == [True, False], "a slot's worth takes the ring, a byte more gloo"


def test_the_switch_on_one_rank_keeps_both_on_gloo() -> None:
    for rank, res in enumerate(run_ranks(2, _switched_off_on_rank_1, timeout_s=120)):
        assert all(res["equal"]), f"rank {rank}: mismatched messages at {res['equal'].index(False)}"
        assert res["linked"] is False and res["ring"] is None
        assert res["carries"] == [False, False]


def _switched_off_on_rank_1(rank: int, world: int) -> dict[str, object]:
    if rank == 1:
        os.environ["DS_COMM_SHM"] = "0"
    return _round_trip(rank, world)


def _batched(rank: int, world: int) -> list[bool]:
    """batch_isend_irecv on one side, isend/irecv on the other: both must pick the same transport."""
    peer = 1 - rank
    assert ds_comm.open_shm_p2p(peer)
    small, large = torch.arange(6.0) + rank, torch.arange(float(LARGE)) + rank
    got_small, got_large = torch.empty(6), torch.empty(LARGE)
    if rank == 0:
        ops = [
            ds_comm.P2POp(ds_comm.isend, small, peer),
            ds_comm.P2POp(ds_comm.irecv, got_small, peer),
            ds_comm.P2POp(ds_comm.isend, large, peer),
            ds_comm.P2POp(ds_comm.irecv, got_large, peer),
        ]
        handles = ds_comm.batch_isend_irecv(ops)
    else:
        handles = [ds_comm.irecv(got_small, peer), ds_comm.isend(small, peer)]
        handles += [ds_comm.irecv(got_large, peer), ds_comm.isend(large, peer)]
    for h in handles:
        h.wait()
    return [torch.equal(got_small, torch.arange(6.0) + peer), torch.equal(got_large, torch.arange(float(LARGE)) + peer)]


def test_batched_and_single_p2p_meet_on_the_same_transport() -> None:
    assert run_ranks(2, _batched, timeout_s=60, collective_timeout_s=20) == [[True, True], [True, True]]


def _mismatch(rank: int, world: int) -> None:
    assert ds_comm.open_shm_p2p(1 - rank)
    if rank == 0:
        ds_comm.isend(torch.ones(8), 1).wait()
    else:
        ds_comm.recv(torch.empty(4), 0)


def test_mismatched_sizes_name_both() -> None:
    with pytest.raises(RuntimeError, match=r"holds 32 bytes where the receive expects 16 \(a \(4,\) torch.float32"):
        run_ranks(2, _mismatch, timeout_s=60, collective_timeout_s=10)


def _never_sent(rank: int, world: int) -> None:
    assert ds_comm.open_shm_p2p(1 - rank)
    if rank == 1:
        ds_comm.recv(torch.empty(4), 0)
    dist.barrier()


def test_a_receive_nobody_sends_times_out_naming_the_op() -> None:
    with pytest.raises(ds_comm.CollectiveTimeoutError, match="recv"):
        run_ranks(2, _never_sent, timeout_s=60, collective_timeout_s=3)


def _segments(rank: int, world: int) -> tuple[bool, list[str]]:
    linked = ds_comm.open_shm_p2p(1 - rank)
    again = ds_comm.open_shm_p2p(1 - rank)  # once per pair: the second call does nothing
    dist.barrier()
    return linked and again, glob.glob("/dev/shm/ds_comm_p2p_*")


def test_the_segment_leaves_no_file_behind() -> None:
    results = run_ranks(2, _segments, timeout_s=60)
    assert all(linked for linked, _ in results)
    assert not any(paths for _, paths in results)  # unlinked as soon as both ranks mapped it


def _one_sided(rank: int, world: int) -> None:
    if rank == 0:
        ds_comm.open_shm_p2p(1)  # rank 1 never calls it
    else:
        time.sleep(6)


def test_a_peer_that_never_joins_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"open_shm_p2p: rank 1 did not answer while this rank 0 set up"):
        run_ranks(2, _one_sided, timeout_s=60, collective_timeout_s=3)


def _bad_peer(rank: int, world: int) -> str:
    with pytest.raises(ValueError, match="peer 5 is not another rank of the 2"):
        ds_comm.open_shm_p2p(5)
    with pytest.raises(ValueError, match=f"peer {rank} is not another rank"):
        ds_comm.open_shm_p2p(rank)
    return "ok"


def test_a_bad_peer_is_named() -> None:
    assert run_ranks(2, _bad_peer, timeout_s=60) == ["ok", "ok"]
