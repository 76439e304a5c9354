"""Where a ZeRO-Infinity step's seconds go: phases, NVMe traffic, CPU Adam, and their overlap.

Input: one step of `_infinity_job.py`'s output: phase boundaries `t` (monotonic ns: forward start, backward
start, step start, end), `io` (aio requests: op, bytes, start ns, end ns) and `adam` (the base optimizer's
step intervals). Times are unions of intervals, so two requests in flight at once count once.
"""

from __future__ import annotations

from typing import Any

Interval = tuple[int, int]


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged into disjoint ones, sorted."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length_s(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in union(intervals)) / 1e9


def clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of time covered by both `a` and `b`."""
    out: list[Interval] = []
    ua, ub = union(a), union(b)
    i = j = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if lo < hi:
            out.append((lo, hi))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def step_breakdown(step: dict[str, Any]) -> dict[str, Any]:
    """Seconds per phase, and per phase the NVMe busy time, bytes and the CPU Adam time."""
    a, b, c, d = step["t"]
    phases = {"forward": (a, b), "backward": (b, c), "optimizer": (c, d)}
    io = step.get("io") or []
    reads = [(s, e) for op, _n, s, e in io if op == "read"]
    writes = [(s, e) for op, _n, s, e in io if op == "write"]
    adam = [tuple(x) for x in step.get("adam") or []]
    out: dict[str, Any] = {"total_s": (d - a) / 1e9, "peak_rss_gib": step["peak_rss_gib"], "loss": step["loss"]}
    for name, window in phases.items():
        io_busy = clip(reads + writes, window)
        row = {
            "s": (window[1] - window[0]) / 1e9,
            "read_busy_s": length_s(clip(reads, window)),
            "write_busy_s": length_s(clip(writes, window)),
            "io_busy_s": length_s(io_busy),
        }
        adam_in = clip(adam, window)  # type: ignore[arg-type]
        row["adam_s"] = length_s(adam_in)  # in backward too when sub-groups are updated there (eager steps)
        row["adam_with_io_s"] = length_s(intersect(adam_in, io_busy))
        if name == "optimizer":
            row["idle_s"] = row["s"] - length_s(adam_in + io_busy)  # neither Adam nor I/O: copies, bookkeeping
        out[name] = row
    out["read_bytes"] = sum(n for op, n, _s, _e in io if op == "read")
    out["write_bytes"] = sum(n for op, n, _s, _e in io if op == "write")
    out["read_busy_s"] = length_s(reads)
    out["write_busy_s"] = length_s(writes)
    out["io_busy_s"] = length_s(reads + writes)
    out["read_and_write_s"] = length_s(intersect(reads, writes))
    return out


def floor_s(
    params: int, read_gbps: float, write_gbps: float, both_gbps: float | None = None, pool_bytes: int = 0
) -> dict[str, float]:
    """The NVMe-traffic floor of one step: optimizer state (fp32 master + 2 Adam moments) read and written
    once, bf16 parameters read twice (forward, backward) except what the parameter swap buffers
    (`pool_bytes`, `offload_param.buffer_count` x `buffer_size`) keep from one use to the next (the layers a
    pass ends with are the ones the next pass starts with), and written once unless the buffers hold them all
    (then ds writes them back only when a buffer is given up). `serial_s`: reads then writes;
    `ideal_s`: the larger of the two, as if reading and writing at once each kept its own rate;
    `overlapped_s`: at once, at the disk's measured rate for a read and a write together (`both_gbps`; a disk
    that shares one bandwidth between them gets no faster by overlapping), never below `ideal_s`."""
    read = params * 12 + 2 * max(0, params * 2 - pool_bytes)
    write = params * 12 + (0 if pool_bytes >= params * 2 else params * 2)
    ideal = max(read / (read_gbps * 1e9), write / (write_gbps * 1e9))
    serial = read / (read_gbps * 1e9) + write / (write_gbps * 1e9)
    overlapped = ideal if both_gbps is None else min(serial, max(ideal, (read + write) / (both_gbps * 1e9)))
    return {
        "read_bytes": read,
        "write_bytes": write,
        "ideal_s": ideal,
        "overlapped_s": overlapped,
        "serial_s": serial,
    }
