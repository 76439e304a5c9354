"""Every collective wrapper on 1, 2 and 4 gloo ranks against a reference computed locally; async; sub-groups."""

from __future__ import annotations

import warnings

import pytest
import torch

import ds_comm
from ds_comm.testing import run_ranks


def _rank_tensor(rank: int, numel: int = 6) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 10 * rank


def _all_collectives(rank: int, world: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    t = _rank_tensor(rank)
    ds_comm.all_reduce(t)
    out["all_reduce"] = t

    t = _rank_tensor(rank)
    ds_comm.all_reduce(t, op=ds_comm.ReduceOp.MAX)
    out["all_reduce_max"] = t

    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # DeepSpeed's test covers all three
        t = _rank_tensor(rank).to(dtype)
        assert ds_comm.inference_all_reduce(t) is t
        out[f"inference_all_reduce_{dtype}"] = t.float()

    t = _rank_tensor(rank)
    ds_comm.reduce(t, dst=world - 1)
    if rank == world - 1:
        out["reduce"] = t

    t = _rank_tensor(rank)
    ds_comm.broadcast(t, src=world - 1)
    out["broadcast"] = t

    parts = [torch.empty(6) for _ in range(world)]
    ds_comm.all_gather(parts, _rank_tensor(rank))
    out["all_gather"] = torch.cat(parts)

    gathered = torch.empty(6 * world)
    ds_comm.all_gather_into_tensor(gathered, _rank_tensor(rank))
    out["all_gather_into_tensor"] = gathered

    full = torch.arange(4 * world, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(4)
    ds_comm.reduce_scatter_tensor(shard, full)
    out["reduce_scatter_tensor"] = shard

    shard2 = torch.empty(4)
    ds_comm.reduce_scatter(shard2, list(full.chunk(world)))
    out["reduce_scatter"] = shard2

    src = torch.arange(2 * world, dtype=torch.float32) + 100 * rank
    dst = torch.empty(2 * world)
    ds_comm.all_to_all_single(dst, src)
    out["all_to_all_single"] = dst

    # async: issue two, wait both
    a, b = _rank_tensor(rank), _rank_tensor(rank) * 2
    h1 = ds_comm.all_reduce(a, async_op=True)
    h2 = ds_comm.all_reduce(b, async_op=True)
    assert h1 is not None and h2 is not None
    h1.wait()
    h2.wait()
    assert h1.is_completed() and h2.is_completed()
    out["async_sum"] = a + b

    # ring send/recv
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        recv_buf = torch.empty(3)
        if rank % 2 == 0:
            ds_comm.send(torch.full((3,), float(rank)), nxt)
            ds_comm.recv(recv_buf, prv)
        else:
            ds_comm.recv(recv_buf, prv)
            ds_comm.send(torch.full((3,), float(rank)), nxt)
        out["ring"] = recv_buf
        h = ds_comm.isend(torch.full((2,), float(rank)), nxt)
        r = torch.empty(2)
        ds_comm.irecv(r, prv).wait()
        h.wait()
        out["iring"] = r

    objs = [None] * world
    ds_comm.all_gather_object(objs, {"rank": rank})
    out["objects"] = torch.tensor([o["rank"] for o in objs])
    ds_comm.barrier()
    out["ranks"] = torch.tensor([ds_comm.get_rank(), ds_comm.get_world_size(), ds_comm.get_local_rank()])
    return out


def _expected(world: int) -> list[dict[str, torch.Tensor]]:
    ranks = range(world)
    total = sum(_rank_tensor(r) for r in ranks)
    full_sum = sum(torch.arange(4 * world, dtype=torch.float32) * (r + 1) for r in ranks)
    per_rank = []
    for rank in ranks:
        e = {
            "all_reduce": total,
            "all_reduce_max": _rank_tensor(world - 1),
            **{f"inference_all_reduce_{dtype}": total for dtype in (torch.float32, torch.bfloat16, torch.float16)},
            "broadcast": _rank_tensor(world - 1),
            "all_gather": torch.cat([_rank_tensor(r) for r in ranks]),
            "all_gather_into_tensor": torch.cat([_rank_tensor(r) for r in ranks]),
            "reduce_scatter_tensor": full_sum[4 * rank : 4 * rank + 4],
            "reduce_scatter": full_sum[4 * rank : 4 * rank + 4],
            "all_to_all_single": torch.cat(
                [torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in ranks]
            ),
            "async_sum": total * 3,
            "objects": torch.arange(world),
            "ranks": torch.tensor([rank, world, rank]),
        }
        if rank == world - 1:
            e["reduce"] = total
        if world > 1:
            e["ring"] = torch.full((3,), float((rank - 1) % world))
            e["iring"] = torch.full((2,), float((rank - 1) % world))
        per_rank.append(e)
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_collective_matches_local_reference(world: int) -> None:
    results = run_ranks(world, _all_collectives, timeout_s=90)
    for rank, (got, want) in enumerate(zip(results, _expected(world), strict=True)):
        assert set(got) == set(want), f"rank {rank}"
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"rank {rank} {key}")


def _flat_collective_warnings(rank: int, world: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds_comm.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))
        ds_comm.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
    return [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]


def test_flat_collectives_do_not_warn_about_deprecated_torch_names() -> None:
    """torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor (a warning per rank and call);
    the wrappers call the `*_single` names where torch has them."""
    assert run_ranks(2, _flat_collective_warnings, timeout_s=60) == [[], []]


def _subgroups(rank: int, world: int) -> dict[str, object]:
    evens = ds_comm.new_group([0, 2])
    odds = ds_comm.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    ds_comm.all_reduce(t, group=mine)
    parts = [torch.empty(1) for _ in range(2)]
    ds_comm.all_gather(parts, torch.tensor([float(rank)]), group=mine)
    b = torch.tensor([float(rank)])
    ds_comm.broadcast(b, src=ds_comm.get_global_rank(mine, 1), group=mine)
    h = ds_comm.all_reduce(torch.ones(1), group=mine, async_op=True)
    assert h is not None
    h.wait()
    return {
        "sum": t,
        "gathered": torch.cat(parts),
        "bcast": b,
        "group_rank": ds_comm.get_rank(mine),
        "group_size": ds_comm.get_world_size(mine),
    }


def test_subgroups_on_four_ranks() -> None:
    results = run_ranks(4, _subgroups, timeout_s=90)
    for rank, r in enumerate(results):
        peers = [0, 2] if rank % 2 == 0 else [1, 3]
        assert r["sum"].item() == sum(peers)
        assert r["gathered"].tolist() == [float(p) for p in peers]
        assert r["bcast"].item() == float(peers[1])
        assert (r["group_rank"], r["group_size"]) == (peers.index(rank), 2)


def _logged(rank: int, world: int) -> str:
    ds_comm.configure({"enabled": True, "prof_all": True})
    for _ in range(3):
        ds_comm.all_reduce(torch.ones(256))  # 1 KiB
    ds_comm.all_gather_into_tensor(torch.empty(512 * world), torch.ones(512))
    h = ds_comm.all_reduce(torch.ones(256), async_op=True)
    assert h is not None
    h.wait()
    ds_comm.configure(enabled=False)
    ds_comm.all_reduce(torch.ones(256))  # not recorded
    from ds_comm._comms_logger import comms_logger

    busbw = list(comms_logger.comms_dict["all_reduce"][1024][3])
    return {"table": ds_comm.log_summary(), "dict": ds_comm.log_summary(return_dict=True), "busbw": busbw}


def test_comms_logger_counts_bytes_and_bandwidth() -> None:
    result = run_ranks(2, _logged, timeout_s=60)[0]
    lines = result["table"].splitlines()
    # DeepSpeed's table: each op's name on its own line, then a row per message size
    rows = {lines[i - 1]: lines[i].split() for i in range(2, len(lines)) if lines[i].startswith(" ")}
    # all_reduce: 4 recorded calls (3 sync + 1 async) of 1 KiB each
    assert rows["all_reduce"][:3] == ["1.00", "KB", "4"]
    assert rows["all_gather_into_tensor"][:3] == ["4.00", "KB", "1"]
    # busbw: positive in the records; the table rounds to 2 decimals of Gbps, which a 1 KiB all-reduce on a
    # loaded host can fall under, so the table only has to show a number there.
    assert len(result["busbw"]) == 4 and all(bw > 0 for bw in result["busbw"])
    assert float(rows["all_reduce"][-1]) >= 0
    summary = result["dict"]["summary"]
    assert summary["all_reduce"][1024]["count"] == 4 and summary["all_gather_into_tensor"][4096]["count"] == 1
    assert result["dict"]["straggler_analysis"] is None and result["dict"]["metadata"]["world_size"] == 2
