"""The comms logger's summaries, as DeepSpeed reports them: trimmed means over the kept calls.

Each (op, message size) record gives DeepSpeed's summary entry: `count` (every call), `total_latency_ms`
(every call), and the 10%-trimmed means of the kept latencies and bandwidths (`trim_mean` sorts a copy, so
the stored lists keep their order). The straggler analysis compares each kept call's latency with the
fastest rank's (a MIN all-reduce of the latency lists over the world, through torch.distributed, so
it is not recorded itself); every rank must call it, with the same calls recorded.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ds_comm._byte_units import format_bytes
from ds_comm._trim_mean import trim_mean
from ds_comm.accelerator import get_accelerator

if TYPE_CHECKING:
    from ds_comm._comms_logger_queries import CommsLoggerQueries

__all__ = ["TRIM_PERCENT", "format_summary", "metadata", "size_summary", "straggler_analysis", "summarize"]

TRIM_PERCENT = 0.1
"""Share of the kept calls dropped from each end before averaging (DeepSpeed's 10%)."""

_COLUMNS = ("Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)", "busbw_avg (Gbps)")
_STRAGGLER_COLUMNS = (
    "Message Size",
    "Count",
    "Total comm lat(ms)",
    "Total straggler(ms)",
    "Avg comm lat(ms)",
    "Avg straggler(ms)",
)


def size_summary(log: CommsLoggerQueries, name: str, size_bytes: int) -> dict[str, Any]:
    """DeepSpeed's summary entry for one (op, message size) record of `log`."""
    entry = log.comms_dict[name][size_bytes]
    return {
        "count": entry[0],
        "total_latency_ms": log.total_latency_ms(name, size_bytes),
        "avg_latency_ms": trim_mean(entry[1], TRIM_PERCENT),
        "tput_avg_gbps": trim_mean(entry[2], TRIM_PERCENT),
        "busbw_avg_gbps": trim_mean(entry[3], TRIM_PERCENT),
        "msg_size_bytes": size_bytes,
        "msg_size_str": format_bytes(size_bytes),
    }


def summarize(log: CommsLoggerQueries) -> dict[str, dict[int, dict[str, Any]]]:
    """`{op_name: {msg_size: summary entry}}` for every record, sizes in ascending order."""
    return {
        name: {size: size_summary(log, name, size) for size in sorted(sizes)} for name, sizes in log.comms_dict.items()
    }


def straggler_analysis(log: CommsLoggerQueries) -> dict[str, dict[int, dict[str, Any]]]:
    """Per record: the latency of the fastest rank summed and trimmed-averaged, and the time this rank
    waited beyond it (the straggler effect). A collective over the world, one all-reduce per record."""
    device = torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() == "nccl":
        device = get_accelerator().device()
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, sizes in log.comms_dict.items():
        out[name] = {}
        for size in sorted(sizes):
            count, latencies = sizes[size][0], sizes[size][1]
            mine = torch.tensor(latencies, dtype=torch.float64, device=device)
            fastest = mine.clone()
            if dist.is_initialized():
                dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
            waited = (mine - fastest).tolist()
            out[name][size] = {
                "count": count,
                "total_comm_lat_ms": float(fastest.sum()),
                "total_straggler_ms": float(sum(waited)),
                "avg_comm_lat_ms": trim_mean(fastest.tolist(), TRIM_PERCENT),
                "avg_straggler_ms": trim_mean(waited, TRIM_PERCENT),
                "msg_size_bytes": size,
                "msg_size_str": format_bytes(size),
            }
    return out


def format_summary(summary: Mapping[str, Mapping[int, Mapping[str, Any]]], *, straggler: bool = False) -> str:
    """DeepSpeed's table: a header, then each op's name on its own line followed by one row per size."""
    columns = _STRAGGLER_COLUMNS if straggler else _COLUMNS
    keys = (
        ("total_comm_lat_ms", "total_straggler_ms", "avg_comm_lat_ms", "avg_straggler_ms")
        if straggler
        else ("total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps")
    )
    lines = ["".join(f"{c:<20}" for c in ("Comm. Op", *columns)).rstrip()]
    for name, sizes in summary.items():
        lines.append(name)
        for size, row in sizes.items():
            figures = "".join(f"{row[k]:<20.2f}" for k in keys)
            lines.append(f"{'':<20}{format_bytes(size):<20}{row['count']:<20}{figures}".rstrip())
    return "\n".join(lines)


def metadata() -> dict[str, Any]:
    """World size, rank and the time of the summary, as DeepSpeed's `log_all` reports them."""
    initialized = dist.is_initialized()
    return {
        "world_size": dist.get_world_size() if initialized else 1,
        "rank": dist.get_rank() if initialized else 0,
        "timestamp": datetime.datetime.now().isoformat(),
    }
