"""Two ranks on one host exchange through a shared-memory segment: the same bits as gloo's collectives.

Each case runs gloo's own collective (torch.distributed, which never takes the segment) on the same inputs
as ds_comm's, which takes it, and compares bitwise. A tiny slot (`DS_COMM_SHM_SLOT_MB`, 4 KiB) cuts the
larger messages into many chunks, so chunking, slot reuse and waits on a peer that is behind all run.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm._shm_pair import ENV, SLOT_ENV, shm_channel
from ds_comm.testing import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 1000, 5003)  # 5003 fp32 halves: 20 KB, five 4 KiB chunks
TINY_SLOT = {SLOT_ENV: "0.00390625"}  # 4 KiB


def _mapped_segments() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-2] for line in f if "ds_comm_pair_" in line})


def _collectives(rank: int, world: int) -> dict[str, object]:
    group = dist.new_group([0, 1])  # a group of its own: the segment is the group's, not the world's
    me = dist.get_rank(group)
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict[str, object] = {}
    for dtype in DTYPES:
        for n in SIZES:
            key = f"{dtype}_{n}"
            full = (torch.randn(2 * n, generator=gen) * 3).to(dtype)
            # reduce-scatter: plain, async, in place (the output is this rank's own slice of the input)
            ref = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_single(ref, full.clone(), group=group)
            got = torch.empty(n, dtype=dtype)
            ds_comm.reduce_scatter_tensor(got, full, group=group)
            h = ds_comm.reduce_scatter_tensor(a_got := torch.empty(n, dtype=dtype), full, group=group, async_op=True)
            assert h is not None
            h.wait()
            inplace = full.clone()
            ds_comm.reduce_scatter_tensor(inplace[n * me : n * (me + 1)], inplace, group=group)
            out[f"rs_{key}"] = [torch.equal(x, ref) for x in (got, a_got, inplace[n * me : n * (me + 1)])]
            # all-gather: plain and in place
            shard = full[:n].clone()
            ref_g = torch.empty(2 * n, dtype=dtype)
            dist.all_gather_single(ref_g, shard, group=group)
            got_g = torch.full((2 * n,), 7, dtype=dtype)
            ds_comm.all_gather_into_tensor(got_g, shard, group=group)
            inplace_g = torch.zeros(2 * n, dtype=dtype)
            inplace_g[n * me : n * (me + 1)].copy_(shard)
            ds_comm.all_gather_into_tensor(inplace_g, inplace_g[n * me : n * (me + 1)], group=group)
            out[f"ag_{key}"] = [torch.equal(got_g, ref_g), torch.equal(inplace_g, ref_g)]
            # all-reduce: in place, and on a non-contiguous view
            ref_r = full.clone()
            dist.all_reduce(ref_r, group=group)
            got_r = full.clone()
            ds_comm.all_reduce(got_r, group=group)
            strided = full.clone().view(2, n).t()  # (n, 2), not contiguous
            ds_comm.all_reduce(strided, group=group)
            out[f"ar_{key}"] = [torch.equal(got_r, ref_r), torch.equal(strided.t().reshape(-1), ref_r)]
            # broadcast from each rank, also into a non-contiguous view
            for root in (0, 1):
                src = ds_comm.get_global_rank(group, root)
                got_b = full.clone() if me == root else torch.zeros_like(full)
                ds_comm.broadcast(got_b, src=src, group=group)
                view_b = (full.clone() if me == root else torch.zeros_like(full)).view(2, n).t()
                ds_comm.broadcast(view_b, src=src, group=group)
                ref_b = full.clone()
                dist.broadcast(ref_b, src=src, group=group)
                out[f"bc{root}_{key}"] = [torch.equal(got_b, ref_b), torch.equal(view_b.t().reshape(-1), ref_b)]
    # several ops in flight, waited in reverse order, mixed with gloo-only ops between them
    shards = [torch.randn(n, generator=gen) for n in (3, 4097, 1, 2000)]
    refs = []
    for s in shards:
        r = torch.empty(2 * s.numel())
        dist.all_gather_single(r, s, group=group)
        refs.append(r)
    outs = [torch.empty(2 * s.numel()) for s in shards]
    handles = []
    for o, s in zip(outs, shards, strict=True):
        handles.append(ds_comm.all_gather_into_tensor(o, s, group=group, async_op=True))
        dist.broadcast(torch.ones(3), src=ds_comm.get_global_rank(group, 0), group=group)  # gloo in between
    for h in reversed(handles):
        assert h is not None
        h.wait()
    out["in_flight"] = [torch.equal(o, r) for o, r in zip(outs, refs, strict=True)]
    # many tensors at once, and a pair exchange of mixed dtypes
    many_out = [torch.empty(2 * s.numel()) for s in shards]
    h = ds_comm.pair_all_gather_into_tensors(many_out, shards, group=group)
    assert h is not None
    h.wait()
    out["many"] = [torch.equal(o, r) for o, r in zip(many_out, refs, strict=True)]
    sends = [torch.full((n,), float(me * 100 + n)).to(dt) for n, dt in ((3, torch.float32), (5000, torch.bfloat16))]
    recvs = [torch.empty_like(s) for s in sends]
    h = ds_comm.pair_exchange(sends, recvs, group=group)
    assert h is not None
    h.wait()
    out["exchange"] = [r.float().unique().tolist() for r in recvs]
    # lists of different lengths: group rank 0 sends two tensors and receives one, rank 1 the reverse;
    # then a one-way exchange (rank 0 only sends), each landing in order
    two = [torch.arange(5.0), torch.arange(3000.0) * 2]
    one = [torch.arange(7, dtype=torch.float64)]
    sends, recvs = (
        (two, [torch.empty(7, dtype=torch.float64)]) if me == 0 else (one, [torch.empty(5), torch.empty(3000)])
    )
    h = ds_comm.pair_exchange(sends, recvs, group=group)
    assert h is not None
    h.wait()
    one_way = torch.full((4099,), 3.5) if me == 0 else torch.zeros(4099)
    h = ds_comm.pair_exchange([one_way] if me == 0 else [], [] if me == 0 else [one_way], group=group)
    assert h is not None
    h.wait()
    expect = one if me == 0 else two
    out["uneven"] = [torch.equal(r, e) for r, e in zip(recvs, expect, strict=True)] + [bool((one_way == 3.5).all())]
    out["channel"] = shm_channel(group) is not None
    out["segments"] = _mapped_segments()
    out["left_in_dev_shm"] = glob.glob(f"/dev/shm/ds_comm_pair_{os.getpid()}_*")
    return out


def _check(results: list[dict[str, object]], *, shm: bool) -> None:
    for rank, r in enumerate(results):
        for key, value in r.items():
            if key.startswith(("rs_", "ag_", "ar_", "bc")) or key in ("in_flight", "many", "uneven"):
                assert all(value), (rank, key, value)  # type: ignore[call-overload]
        peer = 1 - rank
        bf16 = torch.tensor(float(peer * 100 + 5000)).to(torch.bfloat16).item()
        assert r["exchange"] == [[float(peer * 100 + 3)], [bf16]]
        assert r["channel"] is shm
        segments = r["segments"]
        assert isinstance(segments, list) and len(segments) == (1 if shm else 0)
        assert all(s.startswith("/dev/shm/ds_comm_pair_") for s in segments)
        assert r["left_in_dev_shm"] == []  # unlinked once both ranks mapped it
    if shm:
        assert results[0]["segments"] == results[1]["segments"]


@pytest.mark.timeout(240)
def test_shared_memory_equals_gloo_bitwise() -> None:
    _check(run_ranks(2, _collectives, timeout_s=200, env=TINY_SLOT), shm=True)


@pytest.mark.timeout(240)
def test_default_slot_equals_gloo_bitwise() -> None:
    _check(run_ranks(2, _collectives, timeout_s=200), shm=True)


@pytest.mark.timeout(240)
def test_switched_off_stays_on_gloo() -> None:
    _check(run_ranks(2, _collectives, timeout_s=200, env={ENV: "0"}), shm=False)


def _one_rank_off(rank: int, world: int) -> dict[str, object]:
    if rank == 1:
        os.environ[ENV] = "off"  # only rank 1 says no: neither may use it
    return _collectives(rank, world)


@pytest.mark.timeout(240)
def test_one_rank_switched_off_keeps_both_on_gloo() -> None:
    _check(run_ranks(2, _one_rank_off, timeout_s=200), shm=False)


def _two_groups(rank: int, world: int) -> dict[str, object]:
    """Two 2-rank groups of a 4-rank world, each with its own segment, used concurrently (and the
    4-rank world group, which has none)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank // 2]
    other = cross[rank % 2]
    gen = torch.Generator().manual_seed(rank)
    ok = []
    for step in range(6):
        a, b = torch.randn(3001, generator=gen), torch.randn(257, generator=gen)
        ref_a, ref_b = a.clone(), b.clone()
        dist.all_reduce(ref_a, group=mine)
        dist.all_reduce(ref_b, group=other)
        ha = ds_comm.all_reduce(a, group=mine, async_op=True)
        hb = ds_comm.all_reduce(b, group=other, async_op=True)
        world_sum = torch.full((4,), float(rank + step))
        ds_comm.all_reduce(world_sum)
        assert ha is not None and hb is not None
        hb.wait()
        ha.wait()
        ok.append(torch.equal(a, ref_a) and torch.equal(b, ref_b) and world_sum.tolist() == [6.0 + 4 * step] * 4)
    return {
        "ok": ok,
        "channels": [shm_channel(mine) is not None, shm_channel(other) is not None, shm_channel(None) is None],
        "segments": len(_mapped_segments()),
    }


@pytest.mark.timeout(240)
def test_concurrent_groups_each_have_their_segment() -> None:
    for r in run_ranks(4, _two_groups, timeout_s=200, env=TINY_SLOT):
        assert all(r["ok"]) and all(r["channels"]) and r["segments"] == 2


def _mismatched(rank: int, world: int, what: str) -> None:
    if what == "sizes":
        ds_comm.all_reduce(torch.ones(10 + rank))
    elif rank == 0:  # the same bytes, another collective
        ds_comm.all_reduce(torch.ones(8))
    else:
        ds_comm.broadcast(torch.ones(8), src=1)


@pytest.mark.parametrize(("what", "detail"), [("sizes", "sent 4[04] bytes"), ("kinds", "of broadcast")])
def test_mismatched_collectives_raise_instead_of_mixing_data(what: str, detail: str) -> None:
    with pytest.raises(ds_comm.CollectiveError, match=f"{detail}.*the two ranks issued different collectives"):
        run_ranks(2, _mismatched, what, timeout_s=60, collective_timeout_s=10)


def _peer_absent(rank: int, world: int) -> None:
    ds_comm.all_reduce(torch.ones(4))  # sets the segment up
    if rank == 1:
        time.sleep(20)  # alive, but never joins the next all-reduce
        return
    ds_comm.all_reduce(torch.ones(4))


def test_absent_peer_times_out_with_the_op_named() -> None:
    start = time.monotonic()
    with pytest.raises(ds_comm.CollectiveTimeoutError, match=r"all_reduce on world group \(2 ranks\) did not complete"):
        run_ranks(2, _peer_absent, timeout_s=60, collective_timeout_s=3)
    assert time.monotonic() - start < 40
