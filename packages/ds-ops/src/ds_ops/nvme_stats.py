"""The DeepNVMe sweep's log files: their names, the speed lines `ds_io` prints, and reading them back.

A sweep (`ds_nvme_tune`) writes one log per setting and direction under
`<log_dir>/_aio_bench_{read,write}_logs/`, named from the setting as DeepSpeed's sweep names them:

    write_block_overlap_ftd1_d32_bs1M_p1.txt      (single_submit: single|block, sequential_requests:
                                                   sequential|overlap, folders, queue depth, block size, io_parallel)

and holding `ds_io`'s report, whose lines `parse_nvme_stats` reads:

    E2E Write Latency = 0.0316 sec
    E2E Write Speed = 12.32 GB/sec          (bytes / seconds / 1024**3, DeepSpeed's unit)

`generate_aio_param` picks the setting with the largest read + write speed from such logs and proposes
the ds_config `aio` section.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BENCH_LOG_DIR",
    "METRIC_SEARCH",
    "PERF_METRICS",
    "READ_LOG_DIR",
    "READ_SPEED",
    "WRITE_LOG_DIR",
    "WRITE_SPEED",
    "extract_value",
    "generate_aio_param",
    "get_file_key",
    "get_metric",
    "get_results",
    "get_sorted_results",
    "get_thread_count",
    "log_file_name",
    "parse_nvme_stats_main",
    "report_lines",
]

SCRIPT_PREFIX = "_aio_bench"
WRITE_OP_DESC = "write"
READ_OP_DESC = "read"
READ_IO_DIR = f"{SCRIPT_PREFIX}_{READ_OP_DESC}_io"
WRITE_IO_DIR = f"{SCRIPT_PREFIX}_{WRITE_OP_DESC}_io"
BENCH_LOG_DIR = f"{SCRIPT_PREFIX}_logs"
READ_LOG_DIR = f"{SCRIPT_PREFIX}_{READ_OP_DESC}_logs"
WRITE_LOG_DIR = f"{SCRIPT_PREFIX}_{WRITE_OP_DESC}_logs"

READ_SPEED = "read_speed"
WRITE_SPEED = "write_speed"
PERF_METRICS = [READ_SPEED, WRITE_SPEED]
METRIC_SEARCH = {READ_SPEED: "E2E Read Speed", WRITE_SPEED: "E2E Write Speed"}
BYTES_PER_GB = 1024**3


def log_file_name(
    op: str,
    *,
    block_size: str | int,
    queue_depth: int,
    single_submit: bool,
    sequential_requests: bool,
    io_parallel: int,
    num_folders: int = 1,
) -> str:
    """The log name of one sweep setting (`op` is "read" or "write")."""
    return (
        f"{op}_{'single' if single_submit else 'block'}_{'sequential' if sequential_requests else 'overlap'}_"
        f"ftd{num_folders}_d{queue_depth}_bs{block_size}_p{io_parallel}.txt"
    )


def report_lines(read: bool, num_bytes: int, seconds: float) -> list[str]:
    """`ds_io`'s task and end-to-end latency and speed lines for one timed transfer."""
    what = "Read" if read else "Write"
    speed = num_bytes / seconds / BYTES_PER_GB if seconds > 0 else 0.0
    return [
        f"Task {what} Latency = {seconds} sec",
        f"Task {what} Speed = {speed} GB/sec",
        f"E2E {what} Latency = {seconds} sec",
        f"E2E {what} Speed = {speed} GB/sec",
    ]


def extract_value(key: str, file: str) -> Any:
    """One field of a log name as a value: `t4`/`d32`/`p2` -> 4/32/2, `bs1M` -> 1048576, words stay words."""
    if key.startswith("ds"):
        return key
    try:
        if key[0] in "tdp" and key[1:].isdigit():
            return int(key[1:])
        if key.startswith("bs"):
            size = key[2:]
            scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(size[-1:].upper(), 1)
            return int(size[:-1] if scale > 1 else size) * scale
    except (ValueError, IndexError):
        return None
    return key


def get_file_key(file: str) -> tuple[Any, ...]:
    """A log's setting as a tuple of values, from its file name."""
    stem = os.path.splitext(os.path.basename(file))[0]
    return tuple(extract_value(field, file) for field in stem.split("_"))


def get_thread_count(file: str) -> int:
    """The `t<N>` field of a log name (1 when absent)."""
    stem = os.path.splitext(os.path.basename(file))[0]
    return next((int(f[1:]) for f in stem.split("_") if f[:1] == "t" and f[1:].isdigit()), 1)


def get_metric(file: str, metric: str) -> float | None:
    """The `metric` ("read_speed" or "write_speed") a log reports, in GB/sec; None if it has none."""
    if metric not in METRIC_SEARCH:
        raise ValueError(f"metric {metric!r} is not one of {PERF_METRICS}")
    with open(file) as f:
        for line in f:
            if line.startswith(METRIC_SEARCH[metric]):
                return float(line.split()[-2])
    return None


def get_results(log_files: Sequence[str], metric: str) -> dict[tuple[Any, ...], float | None]:
    return {get_file_key(f): get_metric(f, metric) for f in log_files}


def get_sorted_results(log_dir: str, metric: str) -> tuple[list[tuple[Any, ...]], dict[tuple[Any, ...], Any]]:
    """Every log of `log_dir` as {setting: metric}, and the settings in sorted order."""
    files = [os.path.join(log_dir, f) for f in sorted(os.listdir(log_dir))]
    results = get_results([f for f in files if os.path.isfile(f)], metric)
    try:
        return sorted(results), results
    except TypeError:  # names of another shape side by side: order them as text
        return sorted(results, key=lambda key: tuple(map(str, key))), results


def generate_aio_param(read_log_dir: str, write_log_dir: str) -> tuple[dict[str, Any], float, float]:
    """The `{"aio": {...}}` section of the setting with the largest read + write speed, and those speeds.

    Raises:
        ValueError: the folders hold different settings, or no log reports a speed.
    """
    _, reads = get_sorted_results(read_log_dir, READ_SPEED)
    _, writes = get_sorted_results(write_log_dir, WRITE_SPEED)
    read_by, write_by = ({key[1:]: v for key, v in r.items()} for r in (reads, writes))
    if set(read_by) != set(write_by):
        raise ValueError(f"{read_log_dir} and {write_log_dir} hold logs of different settings")
    combined = {k: (read_by[k] or 0.0) + (write_by[k] or 0.0) for k in read_by}
    if not combined or max(combined.values()) <= 0:
        raise ValueError(f"no speed reported in the logs of {read_log_dir} and {write_log_dir}")
    best = max(combined, key=lambda k: combined[k])
    single, sequential, _folders, queue_depth, block_size, io_parallel = best
    section = {
        "aio": {
            "block_size": int(block_size),
            "queue_depth": int(queue_depth),
            "intra_op_parallelism": int(io_parallel),
            "single_submit": single == "single",
            "overlap_events": sequential == "overlap",
        }
    }
    return section, float(read_by[best] or 0.0), float(write_by[best] or 0.0)


def parse_nvme_stats_main(argv: Sequence[str] | None = None) -> int:
    """`python -m ds_ops.nvme_stats --log_dir DIR --metric read_speed|write_speed`: one line per log."""
    parser = argparse.ArgumentParser(prog="parse_nvme_stats", description="Report a metric of every sweep log.")
    parser.add_argument("--log_dir", required=True, help="folder of sweep logs")
    parser.add_argument("--metric", required=True, choices=PERF_METRICS, help="metric to report")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.log_dir):
        print(f"parse_nvme_stats: --log_dir {args.log_dir!r} is not a directory", file=sys.stderr)
        return 2
    keys, results = get_sorted_results(args.log_dir, args.metric)
    for key in keys:
        print(f"{key} = {results[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(parse_nvme_stats_main())
