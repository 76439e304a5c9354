"""The comms logger's straggler analysis on 2 ranks: each kept call against the fastest rank's latency.

Both ranks record the same calls with chosen latencies (rank 1 slower on some), so the fastest-rank
latency is the element-wise minimum and the straggler effect this rank's excess over it; the analysis
is reported through `log_summary(show_straggler=True, return_dict=True)`, and the MIN all-reduce it
issues is not recorded itself.
"""

from __future__ import annotations

from typing import Any

import pytest

import ds_comm
from ds_comm.testing import run_ranks

LATENCIES_MS = {0: [2.0, 5.0, 1.0, 4.0], 1: [3.0, 4.0, 1.5, 4.0]}


def _straggler(rank: int, world: int) -> dict[str, Any]:
    ds_comm.reset_log()
    ds_comm.configure(enabled=True, prof_all=True)
    for lat in LATENCIES_MS[rank]:
        ds_comm.comms_logger.record("all_reduce", 4096, lat / 1e3, world_size=world)
    result = ds_comm.log_summary(show_straggler=True, return_dict=True)
    calls_after = ds_comm.get_comm_operation_count()
    ds_comm.configure(enabled=False)
    return {"result": result, "calls_after": calls_after}


def test_straggler_analysis_against_the_fastest_rank() -> None:
    fastest = [min(a, b) for a, b in zip(LATENCIES_MS[0], LATENCIES_MS[1], strict=True)]
    for rank, out in enumerate(run_ranks(2, _straggler, timeout_s=60)):
        entry = out["result"]["straggler_analysis"]["all_reduce"][4096]
        waited = [mine - low for mine, low in zip(LATENCIES_MS[rank], fastest, strict=True)]
        assert entry["count"] == 4
        assert entry["total_comm_lat_ms"] == pytest.approx(sum(fastest))
        assert entry["total_straggler_ms"] == pytest.approx(sum(waited))
        assert entry["avg_comm_lat_ms"] == pytest.approx(sum(fastest) / 4)  # 4 calls: nothing trimmed
        assert entry["avg_straggler_ms"] == pytest.approx(sum(waited) / 4)
        assert out["result"]["summary"]["all_reduce"][4096]["total_latency_ms"] == pytest.approx(
            sum(LATENCIES_MS[rank])
        )
        assert out["calls_after"] == 4  # the analysis' own all-reduce is not a record
