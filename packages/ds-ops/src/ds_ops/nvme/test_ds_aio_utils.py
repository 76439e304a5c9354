"""`deepspeed.nvme.test_ds_aio_utils`: the helpers of DeepSpeed's multi-process `ds_io` (`io_engine`).

Per-task logging (`task_log`, task 0 only unless forced), the tasks' barrier, the summary of a run
(`report_results`: bytes of every task over the slowest task's seconds, for the I/O calls alone and end to
end), size strings (`refine_integer_value`: "64M"), the per-task file name and a file of random bytes to
read, and a page-locked buffer (`create_page_locked_tensor`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ds_ops.nvme_torch_io import create_filename

__all__ = [
    "BYTES_PER_GB",
    "BYTES_PER_KB",
    "BYTES_PER_MB",
    "LOG_TIDS",
    "create_file",
    "create_filename",
    "create_page_locked_tensor",
    "get_block_size_and_count",
    "refine_integer_value",
    "report_results",
    "task_barrier",
    "task_log",
]

BYTES_PER_GB = 1024**3
BYTES_PER_MB = 1024**2
BYTES_PER_KB = 1024
LOG_TIDS = [0]
"""Tasks whose `task_log` lines are printed without `force`."""

_UNITS = {"K": BYTES_PER_KB, "M": BYTES_PER_MB, "G": BYTES_PER_GB}


def task_log(tid: int, msg: str, force: bool = False) -> None:
    if force or tid in LOG_TIDS:
        print(f"tid {tid}: {msg}")


def task_barrier(barrier: Any, num_parties: int) -> None:
    """Wait at the tasks' `multiprocessing.Barrier` (made for `num_parties` tasks)."""
    if barrier.parties != num_parties:
        raise RuntimeError(f"ds_io: the barrier waits for {barrier.parties} tasks, {num_parties} are running")
    barrier.wait()
    if barrier.broken:
        raise RuntimeError("ds_io: a task left the barrier broken (another task failed)")


def report_results(args: Any, read_op: bool, pool_results: list[tuple[float, float, int] | None]) -> None:
    """Print the run's latency and speed: the I/O calls' seconds ("Task") and the loops' wall seconds ("E2E"),
    each the slowest task's, over every task's bytes."""
    kind = "Read" if read_op else "Write"
    if None in pool_results:
        print(f"Failure in one of {len(pool_results)} {kind} processes")
        return
    results = [r for r in pool_results if r is not None]
    total_bytes = sum(n for _, _, n in results)
    for label, seconds in (("Task", max(s for _, s, _ in results)), ("E2E", max(s for s, _, _ in results))):
        speed = 0 if seconds == 0 else total_bytes / seconds / BYTES_PER_GB
        print(f"{label} {kind} Latency = {seconds} sec")
        print(f"{label} {kind} Speed = {speed} GB/sec")


def get_block_size_and_count(io_bytes: int) -> tuple[str, int]:
    """`dd`'s block size ("1M" or "1K") and block count for a file of `io_bytes` (a multiple of 1 KiB)."""
    if io_bytes > BYTES_PER_MB and io_bytes % BYTES_PER_MB == 0:
        return "1M", io_bytes // BYTES_PER_MB
    if io_bytes % BYTES_PER_KB:
        raise ValueError(f"ds_io: io_size {io_bytes} is not a multiple of 1K")
    return "1K", io_bytes // BYTES_PER_KB


def refine_integer_value(value: str) -> int:
    """ "64M" -> 67108864 (K, M, G are powers of 1024); a plain number as it is."""
    text = str(value).strip()
    if text and text[-1].upper() in _UNITS:
        return int(text[:-1]) * _UNITS[text[-1].upper()]
    return int(text)


def create_file(filename: str, num_bytes: int) -> None:
    """A file of `num_bytes` random bytes to read (DeepSpeed runs `dd if=/dev/urandom`), written in 64 MiB pieces."""
    print(f"[Start] Create {filename} of {num_bytes} bytes")
    with open(filename, "wb") as f:
        left = num_bytes
        while left:
            piece = min(left, 64 * BYTES_PER_MB)
            f.write(os.urandom(piece))
            left -= piece
    print(f"[Done] Create read file of {num_bytes} bytes")


def create_page_locked_tensor(num_elem: int, use_accelerator: bool, aio_handle: Any = None) -> torch.Tensor:
    """`num_elem` random bytes in page-locked host memory: the accelerator's pinned memory, or `aio_handle`'s."""
    data = torch.randint(high=128, size=(num_elem,), dtype=torch.uint8)
    if use_accelerator:
        import ds_comm  # noqa: PLC0415 - the accelerator only for this choice

        return ds_comm.get_accelerator().pin_memory(data)
    if aio_handle is None:
        raise ValueError("create_page_locked_tensor: pass aio_handle= (or use_accelerator=True)")
    locked = aio_handle.new_cpu_locked_tensor(num_elem, torch.empty(0, dtype=torch.uint8))
    locked.copy_(data)
    return locked
