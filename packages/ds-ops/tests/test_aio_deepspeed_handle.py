"""`aio_handle` (what `AsyncIOBuilder().load().aio_handle(...)` builds): DeepSpeed's status counts, keyword
names, defaults and process-wide locked buffers over ds's `AsyncIOHandle`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ds_ops.aio import AsyncIOHandle, aio_handle
from ds_ops.op_builder import AsyncIOBuilder, PinMemoryBuilder


def test_builder_idiom_and_defaults() -> None:
    h = AsyncIOBuilder().load(verbose=False).aio_handle(1024, 2, True, False, 2)
    assert isinstance(h, aio_handle) and isinstance(h, AsyncIOHandle)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_intra_op_parallelism()) == (
        1024,
        2,
        True,
        2,
    )
    d = aio_handle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_overlap_events()) == (1 << 20, 128, False)
    assert d.get_alignment() == 4096


def test_status_counts_and_keywords(tmp_path: Path) -> None:
    h = aio_handle(1024, 2, False, False, 1)
    data = torch.randint(0, 256, (3 * 4096 + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "f.bin"
    assert h.async_pwrite(buffer=data, filename=str(path), file_offset=0) == 0
    assert h.wait() == 1
    assert path.read_bytes() == bytes(data.numpy())
    back = torch.zeros_like(data)
    assert h.sync_pread(back, str(path)) == 1 and torch.equal(back, data)
    assert h.async_pread(back, str(path), 0) == 0 and h.async_pread(back, str(path), 0) == 0 and h.wait() == 2
    assert h.write(data, str(tmp_path / "g.bin"), True) == 1 and h.read(back, str(tmp_path / "g.bin"), True) == 1
    assert h.pwrite(data, str(path), False, True) == 0 and h.wait() == 1
    fd = os.open(tmp_path / "h.bin", os.O_CREAT | os.O_WRONLY)
    try:
        assert h.async_pwrite(buffer=data, fd=fd, file_offset=0) == 0 and h.wait() == 1
    finally:
        os.close(fd)
    assert (tmp_path / "h.bin").read_bytes() == bytes(data.numpy())
    with pytest.raises(TypeError, match="exactly one of filename= and fd="):
        h.async_pwrite(data)


def test_locked_buffers_are_process_wide() -> None:
    a, b = aio_handle(1024, 2, False, False, 1), aio_handle(1024, 2, False, False, 1)
    buffer = a.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.float))
    try:
        assert a.is_pinned(buffer) and b.is_pinned(buffer) and a.is_pinned(buffer.narrow(0, 1024, 1024))
        assert PinMemoryBuilder().load().pin_handle().is_pinned(buffer)
    finally:
        assert a.free_cpu_locked_tensor(buffer)
    assert not a.is_pinned(torch.empty(4096))
