"""The comms logger's records in DeepSpeed's layout, capped, and the summaries read from them.

`comms_dict[op][size] = [count, [latency_ms], [algbw_gbps], [busbw_gbps]]`, index i = the i-th kept call;
the lists keep the most recent `max_samples` calls while `count` and the total latency stay exact;
summaries are 10%-trimmed means over the kept calls (checked against a plain sorted-slice mean) and never
reorder the lists. Records are fed through `record()` with chosen latencies, so every figure is exact.
"""

from __future__ import annotations

import logging

import pytest

import ds_comm
from ds_comm import CommsLogger, trim_mean

LATENCIES_S = [0.004, 0.001, 0.003, 0.010, 0.002, 0.006, 0.005, 0.0015, 0.008, 0.007, 0.009, 0.0025]


def _logger(max_samples: int = ds_comm.DEFAULT_MAX_SAMPLES, **settings: object) -> CommsLogger:
    log = CommsLogger(max_samples=max_samples)
    log.configure(ds_comm.CommsLoggerConfig(enabled=True, **settings))
    return log


def _reference_trim_mean(values: list[float], trim: float = 0.1) -> float:
    ordered = sorted(values)
    cut = int(round(len(ordered) * trim))
    kept = ordered[cut : len(ordered) - cut]
    return sum(kept) / len(kept)


def test_records_are_deepspeeds_parallel_lists() -> None:
    log = _logger()
    for lat in LATENCIES_S[:3]:
        log.record("all_reduce", 1 << 20, lat, world_size=4)
    log.record("broadcast", 256, 0.001, world_size=4)
    count, lats, algbws, busbws = log.comms_dict["all_reduce"][1 << 20]
    assert count == 3
    assert lats == pytest.approx([lat * 1e3 for lat in LATENCIES_S[:3]])
    assert algbws == pytest.approx([(1 << 20) / lat * 8 / 1e9 for lat in LATENCIES_S[:3]])
    assert busbws == pytest.approx([a * 2 * 3 / 4 for a in algbws])  # nccl-tests' all_reduce factor
    assert log.comms_dict["broadcast"][256][0] == 1
    assert log.get_operation_names() == ["all_reduce", "broadcast"] and log.get_total_operations() == 4
    raw = log.get_raw_data()
    assert raw == log.comms_dict
    raw["all_reduce"][1 << 20][1].sort(reverse=True)  # a copy: the logger's lists keep their order
    assert log.comms_dict["all_reduce"][1 << 20][1] == lats


def test_lists_are_capped_to_the_most_recent_calls_while_count_and_total_stay_exact() -> None:
    log = _logger(max_samples=5)
    for lat in LATENCIES_S:
        log.record("all_gather", 4096, lat, world_size=2)
    count, lats, algbws, busbws = log.comms_dict["all_gather"][4096]
    assert count == len(LATENCIES_S)
    assert lats == pytest.approx([lat * 1e3 for lat in LATENCIES_S[-5:]])
    assert len(algbws) == len(busbws) == 5
    assert algbws == pytest.approx([4096 / lat * 8 / 1e9 for lat in LATENCIES_S[-5:]])
    summary = log.get_operation_summary("all_gather")[4096]
    assert summary["count"] == len(LATENCIES_S)
    assert summary["total_latency_ms"] == pytest.approx(sum(LATENCIES_S) * 1e3)
    assert summary["avg_latency_ms"] == pytest.approx(_reference_trim_mean(lats))
    assert summary["tput_avg_gbps"] == pytest.approx(_reference_trim_mean(algbws))
    assert summary["busbw_avg_gbps"] == pytest.approx(_reference_trim_mean(busbws))
    assert (summary["msg_size_bytes"], summary["msg_size_str"]) == (4096, "4.00 KB")


def test_summaries_trim_ten_percent_and_never_reorder_the_records() -> None:
    log = _logger()
    for lat in LATENCIES_S:  # 12 calls: one trimmed from each end
        log.record("reduce_scatter", 1000, lat, world_size=2)
    before = [list(v) for v in log.comms_dict["reduce_scatter"][1000][1:]]
    summary = log.get_operation_summary("reduce_scatter")[1000]
    assert summary["avg_latency_ms"] == pytest.approx(_reference_trim_mean([lat * 1e3 for lat in LATENCIES_S]))
    assert summary["avg_latency_ms"] != pytest.approx(sum(LATENCIES_S) / len(LATENCIES_S) * 1e3)  # trimmed
    log.log_all(print_log=False)
    log.summary()
    assert [list(v) for v in log.comms_dict["reduce_scatter"][1000][1:]] == before
    assert log.get_operation_summary("never_seen") is None


def test_log_all_logs_deepspeeds_table_and_returns_its_dictionary(caplog: pytest.LogCaptureFixture) -> None:
    log = _logger()
    for lat in (0.002, 0.004):
        log.record("all_reduce", 2 << 20, lat, world_size=1)
    with caplog.at_level(logging.INFO, logger="ds_comm"):
        result = log.log_all(print_log=True, return_dict=True)
    assert result is not None
    assert set(result) == {"summary", "straggler_analysis", "metadata"}
    assert result["straggler_analysis"] is None
    assert result["summary"]["all_reduce"][2 << 20]["avg_latency_ms"] == pytest.approx(3.0)
    assert result["summary"]["all_reduce"][2 << 20]["total_latency_ms"] == pytest.approx(6.0)
    assert (result["metadata"]["world_size"], result["metadata"]["rank"]) == (1, 0)
    table = caplog.records[-1].getMessage().splitlines()
    assert table[1].split()[:5] == ["Comm.", "Op", "Message", "Size", "Count"]
    assert table[2] == "all_reduce"
    # 2 MiB in 2 and 4 ms: 8.39 and 4.19 Gbps, mean 6.29 (one rank: busbw = algbw)
    assert table[3].split() == ["2.00", "MB", "2", "6.00", "3.00", "6.29", "6.29"]
    assert log.log_all(print_log=False) is None


def test_assigned_records_reset_and_bad_arguments() -> None:
    log = _logger(max_samples=2)
    for lat in (0.001, 0.002, 0.003):
        log.record("send", 10, lat, world_size=2)
    log.comms_dict = {"recv": {10: [2, [1.0, 3.0], [5.0, 6.0], [5.0, 6.0]]}}  # as DeepSpeed's test does
    assert log.get_operation_summary("recv")[10]["total_latency_ms"] == 4.0  # no stale dropped total
    log.reset_data()
    assert not log.has_data() and log.get_total_operations() == 0
    with pytest.raises(ValueError, match="max_samples must be >= 1, got 0"):
        CommsLogger(max_samples=0)


def test_trim_mean_leaves_its_argument_alone() -> None:
    data = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 0.0, 2.5, 3.5, 1.5]
    copy = list(data)
    assert trim_mean(data, 0.1) == pytest.approx(_reference_trim_mean(copy))
    assert data == copy
    assert trim_mean([], 0.1) == 0
    with pytest.raises(ValueError, match=r"trim_percent must be in \[0, 1\], got 1.5"):
        trim_mean(data, 1.5)
