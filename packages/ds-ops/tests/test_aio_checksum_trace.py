"""What a request reports besides its bytes: the workers' checksum (`checksum=True`) and when it ran (`IoTrace`).

The checksum must equal a plain torch computation of the same definition for every size (a tail shorter than a
word), block size (slices that start off word boundaries when buffered), worker count and buffer alignment:
the NVMe swappers compare it with what they recorded when the file was written.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _aio_helpers import ENGINES, random_bytes, unaligned_empty

from ds_ops.aio import AsyncIOHandle, IoTrace


def reference_checksum(data: torch.Tensor) -> int:
    """Wrapping 64-bit sum of little-endian 8-byte words from the first byte; trailing bytes add as themselves."""
    raw = data.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8 * 8
    bulk = raw[:words].clone()  # aligned for the int64 view
    total = int(bulk.view(torch.int64).sum()) if words else 0
    total += int(raw[words:].sum(dtype=torch.int64))
    return total & ((1 << 64) - 1)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("block_size", "threads"), [(1 << 20, 1), (4096, 3), (1000, 2)])
def test_the_workers_checksum_equals_the_definition(tmp_path: Path, engine: str, block_size: int, threads: int) -> None:
    handle = AsyncIOHandle(block_size=block_size, intra_op_parallelism=threads, engine=engine)
    path = tmp_path / "f.bin"
    for n in (1, 7, 8, 4096, 1_000_003, 3 * (1 << 20) + 5):
        data = random_bytes(n, seed=n)
        wrote = handle.async_pwrite(data, path, checksum=True)
        handle.wait()
        back = torch.empty(n, dtype=torch.uint8)
        read = handle.async_pread(back, path, checksum=True)
        handle.wait()
        assert torch.equal(back, data)
        assert wrote.result.checksum == reference_checksum(data) == read.result.checksum, n
    shifted = unaligned_empty(70_001)  # bounce-buffered: the sum still starts at the tensor's first byte
    shifted.copy_(random_bytes(70_001, seed=1))
    request = handle.async_pwrite(shifted, path, checksum=True)
    handle.wait()
    assert request.result.checksum == reference_checksum(shifted)
    changed = shifted.clone()
    changed[12_345] ^= 1
    assert reference_checksum(changed) != reference_checksum(shifted)


def test_io_trace_records_each_request_inside_the_callers_window(tmp_path: Path) -> None:
    handle = AsyncIOHandle(block_size=1 << 20, intra_op_parallelism=2)
    data = random_bytes(3 << 20, seed=3)
    outside = handle.async_pwrite(data, tmp_path / "before.bin")  # settled before the trace: not recorded
    handle.wait()
    assert outside.result.end_ns >= outside.result.start_ns > 0
    with IoTrace() as trace:
        start = time.monotonic_ns()
        handle.async_pwrite(data, tmp_path / "a.bin")
        handle.async_pwrite(data[: 1 << 20], tmp_path / "b.bin")
        handle.wait()
        handle.async_pread(torch.empty(3 << 20, dtype=torch.uint8), tmp_path / "a.bin")
        handle.wait()
        end = time.monotonic_ns()
    records = trace.take()
    assert [(r.op, r.nbytes) for r in records] == [("write", 3 << 20), ("write", 1 << 20), ("read", 3 << 20)]
    assert all(start <= r.start_ns <= r.end_ns <= end for r in records)
    assert records[2].start_ns >= max(r.end_ns for r in records[:2])  # the read was queued after the writes settled
    assert trace.take() == []
    handle.async_pwrite(data, tmp_path / "c.bin")  # after the trace: not recorded
    handle.wait()
    assert trace.records == []
