"""The two-rank gloo pair path of all_gather_into_tensor / reduce_scatter_tensor against torch's own collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm._gloo_pair import pair_peer
from ds_comm.testing import run_ranks


def _pair_vs_torch(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {"peer": pair_peer(None)}
    gen = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        # reduce-scatter: sync and async, against torch's reduce_scatter_single on the same inputs (bitwise)
        full = torch.randn(2 * 1000, generator=gen).to(dtype)
        ref = torch.empty(1000, dtype=dtype)
        dist.reduce_scatter_single(ref, full.clone())
        mine = torch.empty(1000, dtype=dtype)
        ds_comm.reduce_scatter_tensor(mine, full)
        handle = ds_comm.reduce_scatter_tensor(async_out := torch.empty(1000, dtype=dtype), full, async_op=True)
        assert handle is not None
        handle.wait()
        # in place: the output is this rank's own slice of the input (the pair path copies, never falls back
        # on one rank alone, which would leave the other waiting in a send)
        in_place = full.clone()
        ds_comm.reduce_scatter_tensor(in_place[1000 * rank : 1000 * (rank + 1)], in_place)
        own_slice = in_place[1000 * rank : 1000 * (rank + 1)]
        out[f"rs_{dtype}"] = (torch.equal(mine, ref), torch.equal(async_out, ref), torch.equal(own_slice, ref))
        # all-gather into a 2-D output, and in place (the input is this rank's row of the output)
        shard = torch.randn(3, 5, generator=gen).to(dtype)
        ref_g = torch.empty(6, 5, dtype=dtype)
        dist.all_gather_single(ref_g, shard)
        got = torch.empty(6, 5, dtype=dtype)
        handle = ds_comm.all_gather_into_tensor(got, shard, async_op=True)
        assert handle is not None
        done_before_wait = handle.is_completed() in (True, False)  # polling must not raise
        handle.wait()
        inplace = torch.empty(6, 5, dtype=dtype)
        inplace[3 * rank : 3 * rank + 3].copy_(shard)
        ds_comm.all_gather_into_tensor(inplace, inplace[3 * rank : 3 * rank + 3])
        out[f"ag_{dtype}"] = (torch.equal(got, ref_g), torch.equal(inplace, ref_g), done_before_wait)
    # several tensors at once, straight into their outputs
    inputs = [torch.randn(n, generator=gen) for n in (7, 1, 300)]
    refs = [torch.empty(2 * n) for n in (7, 1, 300)]
    for r, i in zip(refs, inputs, strict=True):
        dist.all_gather_single(r, i)
    outs = [torch.full((2 * n,), float("nan")) for n in (7, 1, 300)]
    handle = ds_comm.pair_all_gather_into_tensors(outs, inputs)
    assert handle is not None
    handle.wait()
    out["many"] = [torch.equal(o, r) for o, r in zip(outs, refs, strict=True)]
    # ... and in place, each input this rank's half of its output
    in_place_outs = [torch.empty(2 * n) for n in (7, 1, 300)]
    for o, i in zip(in_place_outs, inputs, strict=True):
        o[i.numel() * rank : i.numel() * (rank + 1)].copy_(i)
    halves = [o[i.numel() * rank : i.numel() * (rank + 1)] for o, i in zip(in_place_outs, inputs, strict=True)]
    handle = ds_comm.pair_all_gather_into_tensors(in_place_outs, halves)
    assert handle is not None
    handle.wait()
    out["many"] += [torch.equal(o, r) for o, r in zip(in_place_outs, refs, strict=True)]
    out["many_refused"] = ds_comm.pair_all_gather_into_tensors([torch.empty(5)], [torch.empty(2)]) is None
    # a pair exchange: the peer's sends[i] land in recvs[i]
    sends = [torch.full((n,), float(rank * 10 + n)) for n in (3, 4)]
    recvs = [torch.empty(n) for n in (3, 4)]
    handle = ds_comm.pair_exchange(sends, recvs, op="reduce_scatter_tensor")
    assert handle is not None and ds_comm.pair_ranks() == (rank, 1 - rank)
    handle.wait()
    out["exchange"] = [r.tolist() for r in recvs]
    # not eligible: MAX goes to torch; the answer is still right
    t = torch.arange(4.0) * (rank + 1)
    shard = torch.empty(2)
    ds_comm.reduce_scatter_tensor(shard, t, op=ds_comm.ReduceOp.MAX)
    out["rs_max"] = shard.tolist()
    return out


def test_pair_path_equals_torch_collectives_bitwise() -> None:
    results = run_ranks(2, _pair_vs_torch, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["peer"] == (rank, 1 - rank)
        for key, value in r.items():
            if key.startswith(("rs_torch", "ag_")):
                assert all(value), (rank, key, value)
        assert all(r["many"]) and r["many_refused"]
        assert r["exchange"] == [[float((1 - rank) * 10 + n)] * n for n in (3, 4)]
        assert r["rs_max"] == [2.0 * x for x in range(4)][2 * rank : 2 * rank + 2]


def _peer_of_world(rank: int, world: int) -> object:
    return pair_peer(None)


@pytest.mark.parametrize("world", [1, 4])
def test_no_pair_path_outside_two_rank_groups(world: int) -> None:
    assert run_ranks(world, _peer_of_world, timeout_s=120) == [None] * world


def _exchange_with_addends(rank: int, world: int) -> list[bool]:
    """`pair_exchange(..., addends=own)` is a two-rank reduce-scatter: bitwise torch's, fp32 and bf16."""
    gen = torch.Generator().manual_seed(rank)
    same = []
    for dtype in (torch.float32, torch.bfloat16):
        sizes = (5, 300, 1)
        grads = [torch.randn(2 * n, generator=gen).to(dtype) for n in sizes]
        refs = [torch.empty(n, dtype=dtype) for n in sizes]
        for ref, g in zip(refs, grads, strict=True):
            dist.reduce_scatter_single(ref, g.clone())
        rows = [g.view(2, -1) for g in grads]
        outs = [torch.empty(n, dtype=dtype) for n in sizes]
        handle = ds_comm.pair_exchange(
            [r[1 - rank] for r in rows], outs, op="reduce_scatter_tensor", addends=[r[rank] for r in rows]
        )
        assert handle is not None
        handle.wait()
        same += [torch.equal(o, r) for o, r in zip(outs, refs, strict=True)]
    # an addend of None leaves that receive a plain copy
    plain = torch.empty(3)
    handle = ds_comm.pair_exchange([torch.full((3,), float(rank))], [plain], addends=[None])
    assert handle is not None
    handle.wait()
    same.append(plain.tolist() == [float(1 - rank)] * 3)
    return same


@pytest.mark.parametrize("shm", ["1", "0"])
def test_pair_exchange_with_addends_is_a_reduce_scatter(shm: str) -> None:
    results = run_ranks(2, _exchange_with_addends, timeout_s=120, env={"DS_COMM_SHM": shm})
    assert all(all(r) for r in results), results
