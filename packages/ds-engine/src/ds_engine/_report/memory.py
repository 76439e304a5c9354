"""`see_memory_usage` and `empty_cache`: DeepSpeed's memory-debugging helpers (`deepspeed.runtime.utils`).

`see_memory_usage(message, force=True)` prints, on global rank 0 only, the accelerator's allocated and
reserved memory (current and peak, GB) and the host's used memory, then resets the peak counters; without
`force` it does nothing (DeepSpeed's scripts leave such calls in with `force=False`). It prints to stdout,
as DeepSpeed does, since it is called for its output.
"""

from __future__ import annotations

import gc

import ds_comm
from ds_comm import get_accelerator

__all__ = ["empty_cache", "host_memory_used", "see_memory_usage"]

_GB = 1024**3


def host_memory_used() -> tuple[float, float] | None:
    """(used GB, used percent) of the host's memory from /proc/meminfo; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        total, available = info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None
    used = total - available
    return used / _GB, 100.0 * used / total


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print `message` and the memory in use (rank 0 only; nothing unless `force`)."""
    if not force or (ds_comm.is_initialized() and ds_comm.get_rank() != 0):
        return
    gc.collect()
    acc = get_accelerator()
    print(message)
    print(
        f"MA {acc.memory_allocated() / _GB:.2f} GB  Max_MA {acc.max_memory_allocated() / _GB:.2f} GB  "
        f"CA {acc.memory_reserved() / _GB:.2f} GB  Max_CA {acc.max_memory_reserved() / _GB:.2f} GB"
    )
    host = host_memory_used()
    if host is not None:
        print(f"CPU Virtual Memory:  used = {host[0]:.2f} GB, percent = {host[1]:.1f}%")
    acc.reset_peak_memory_stats()


def empty_cache() -> None:
    """Release the accelerator's cached memory and reset its peak counters."""
    acc = get_accelerator()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
