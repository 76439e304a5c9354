"""gather, scatter, batch_isend_irecv/P2POp, monitored_barrier and the comms logger's profiling switches on gloo."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import ds_comm
from ds_comm.testing import run_ranks


def _rooted(rank: int, world: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    root = world - 1
    mine = torch.arange(3, dtype=torch.float32) + 10 * rank
    gathered = [torch.empty(3) for _ in range(world)] if rank == root else None
    ds_comm.gather(mine, gathered, dst=root)
    if rank == root:
        out["gather"] = torch.stack(gathered)
    pieces = [torch.full((2,), float(100 + r)) for r in range(world)] if rank == 0 else None
    received = torch.empty(2)
    ds_comm.scatter(received, pieces, src=0)
    out["scatter"] = received
    handle = ds_comm.scatter(received * 0, pieces, src=0, async_op=True)
    handle.wait()
    # A ring: send to the right, receive from the left, all issued at once.
    send_buf, recv_buf = torch.full((4,), float(rank)), torch.empty(4)
    ops = [
        ds_comm.P2POp(ds_comm.isend, send_buf, (rank + 1) % world),
        ds_comm.P2POp(torch.distributed.irecv, recv_buf, (rank - 1) % world),
    ]
    for h in ds_comm.batch_isend_irecv(ops):
        h.wait()
    out["ring"] = recv_buf
    ds_comm.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_rooted_collectives_and_ring_match_the_local_reference(world: int) -> None:
    results = run_ranks(world, _rooted, timeout_s=90)
    expected_gather = torch.stack([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world)])
    torch.testing.assert_close(results[world - 1]["gather"], expected_gather)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["scatter"], torch.full((2,), float(100 + rank)))
        torch.testing.assert_close(res["ring"], torch.full((4,), float((rank - 1) % world)))
        assert "gather" not in res or rank == world - 1


def _bad_root_list(rank: int, world: int) -> str:
    try:
        ds_comm.gather(torch.zeros(1), [torch.zeros(1)], dst=0)  # one slot for two ranks
    except ValueError as err:
        return str(err)
    finally:
        ds_comm.barrier()
    return "no error"


def test_root_list_of_the_wrong_length_is_named() -> None:
    message = run_ranks(2, _bad_root_list, timeout_s=60)[0]
    assert "gather_list" in message and "one tensor per rank (2)" in message


def _late_rank(rank: int, world: int) -> str:
    import time

    if rank == 1:
        time.sleep(4)  # misses rank 0's window
        return "late"
    try:
        ds_comm.monitored_barrier(timeout=timedelta(seconds=1))
    except ds_comm.CollectiveError as err:
        return str(err)
    return "no error"


def test_monitored_barrier_names_the_missing_rank() -> None:
    message = run_ranks(2, _late_rank, timeout_s=60)[0]
    assert message.startswith("monitored_barrier on world group (2 ranks)") and "Rank 1 failed" in message


def _profiling(rank: int, world: int) -> dict:
    logger = ds_comm.comms_logger
    ds_comm.configure(enabled=True, prof_all=False, prof_ops=[])
    ds_comm.all_reduce(torch.ones(256))
    before = ds_comm.has_comm_data()
    logger.start_profiling_comms()
    for _ in range(3):
        ds_comm.all_reduce(torch.ones(256))
    ds_comm.broadcast(torch.ones(64), src=0)
    logger.stop_profiling_comms()
    ds_comm.all_reduce(torch.ones(256))  # not recorded again
    logger.start_profiling_op(["gather"])
    ds_comm.gather(torch.ones(8), [torch.empty(8) for _ in range(world)] if rank == 0 else None, dst=0)
    logger.stop_profiling_op(["gather"])
    ds_comm.gather(torch.ones(8), [torch.empty(8) for _ in range(world)] if rank == 0 else None, dst=0)
    result = {
        "before": before,
        "names": sorted(ds_comm.get_logged_comm_ops()),
        "count": ds_comm.get_comm_operation_count(),
        "all_reduce": logger.get_operation_summary("all_reduce"),
        "missing": logger.get_operation_summary("all_to_all_single"),
    }
    ds_comm.reset_log()
    result["after_reset"] = ds_comm.has_comm_data()
    ds_comm.configure(enabled=False)
    return result


def test_profiling_switches_and_operation_summary() -> None:
    res = run_ranks(2, _profiling, timeout_s=60)[0]
    assert res["before"] is False and res["after_reset"] is False
    assert res["names"] == ["all_reduce", "broadcast", "gather"]
    assert res["count"] == 3 + 1 + 1
    summary = res["all_reduce"][1024]
    assert summary["count"] == 3 and summary["msg_size_bytes"] == 1024 and summary["msg_size_str"] == "1.00 KB"
    assert summary["avg_latency_ms"] == pytest.approx(summary["total_latency_ms"] / 3)
    # all_reduce bus bandwidth on 2 ranks is the algorithmic one times 2(n-1)/n = 1.
    assert summary["busbw_avg_gbps"] == pytest.approx(summary["tput_avg_gbps"])
    assert res["missing"] is None


def test_p2pop_refuses_other_ops() -> None:
    with pytest.raises(ValueError, match="isend or irecv"):
        ds_comm.P2POp(ds_comm.all_reduce, torch.zeros(1), 0)
    with pytest.raises(ValueError, match="at least one P2POp"):
        ds_comm.batch_isend_irecv([])
