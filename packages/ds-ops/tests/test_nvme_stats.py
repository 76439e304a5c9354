"""Sweep logs: `ds_nvme_tune` writes DeepSpeed's per-setting logs, `parse_nvme_stats` reads them back, and
`generate_aio_param` proposes the `aio` section of the fastest setting (a 2-setting sweep on a temp dir)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_ops import nvme_stats, nvme_tune

SWEEP = {"block_size": ["256K", "1M"], "queue_depth": [4], "sequential_requests": [False], "single_submit": [False]}


def test_log_names_and_their_keys() -> None:
    name = nvme_stats.log_file_name(
        "write", block_size="1M", queue_depth=32, single_submit=False, sequential_requests=True, io_parallel=2
    )
    assert name == "write_block_sequential_ftd1_d32_bs1M_p2.txt"
    assert nvme_stats.get_file_key(name) == ("write", "block", "sequential", "ftd1", 32, 1 << 20, 2)
    assert nvme_stats.extract_value("bs256K", name) == 256 * 1024 and nvme_stats.extract_value("t8", name) == 8
    assert nvme_stats.get_thread_count("read_t4_d8.txt") == 4 and nvme_stats.get_thread_count(name) == 1


def test_sweep_logs_parse_and_propose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scratch, logs = tmp_path / "nvme", tmp_path / "logs"
    scratch.mkdir()
    (tmp_path / "sweep.json").write_text(json.dumps({**SWEEP, "io_parallel": [1]}))
    args = nvme_tune.parse_sweep_arguments(
        ["--nvme_dir", str(scratch), "--sweep_config", str(tmp_path / "sweep.json"), "--io_size", "1M"]
        + ["--log_dir", str(logs)]
    )
    records = nvme_tune.sweep_main(args)
    assert len(records) == 2
    write_logs = sorted(p.name for p in (logs / nvme_stats.WRITE_LOG_DIR).iterdir())
    assert write_logs == ["write_block_overlap_ftd1_d4_bs1M_p1.txt", "write_block_overlap_ftd1_d4_bs256K_p1.txt"]
    keys, results = nvme_stats.get_sorted_results(str(logs / nvme_stats.READ_LOG_DIR), nvme_stats.READ_SPEED)
    assert len(keys) == 2 and all(v is not None and v > 0 for v in results.values())
    # The logged speed is the record's (GB/s of 1e9 bytes there, 1024**3 in the DeepSpeed-format log).
    by_block = {r["block_size"]: r["write_gbps"] for r in records}
    logged = nvme_stats.get_metric(str(logs / nvme_stats.WRITE_LOG_DIR / write_logs[0]), nvme_stats.WRITE_SPEED)
    assert logged == pytest.approx(by_block["1M"] * 1e9 / 1024**3)
    capsys.readouterr()
    section = nvme_tune.generate_main(str(logs))
    out = capsys.readouterr().out
    assert out.startswith("Best performance (GB/sec): read = ") and json.loads(out.split("\n", 1)[1]) == section
    best = max(records, key=lambda r: r["read_gbps"] + r["write_gbps"])
    assert section["aio"]["block_size"] == nvme_tune.best_aio_config(records)[0]["aio"]["block_size"]
    assert section["aio"]["block_size"] == {"1M": 1 << 20, "256K": 256 << 10}[best["block_size"]]
    assert section["aio"]["overlap_events"] is True and section["aio"]["queue_depth"] == 4

    assert (
        nvme_stats.parse_nvme_stats_main(
            ["--log_dir", str(logs / nvme_stats.WRITE_LOG_DIR)] + ["--metric", "write_speed"]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("('write', 'block', 'overlap', 'ftd1', 4, ")


def test_parse_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        nvme_stats.parse_nvme_stats_main(["--log_dir", str(tmp_path), "--metric", "latency"])
    assert nvme_stats.parse_nvme_stats_main(["--log_dir", str(tmp_path / "none"), "--metric", "read_speed"]) == 2
    with pytest.raises(ValueError, match="different settings"):
        (tmp_path / "r").mkdir()
        (tmp_path / "w").mkdir()
        (tmp_path / "r" / "read_block_overlap_ftd1_d4_bs1M_p1.txt").write_text("E2E Read Speed = 1.0 GB/sec\n")
        nvme_stats.generate_aio_param(str(tmp_path / "r"), str(tmp_path / "w"))
