"""`new_cpu_locked_tensor` buffers: 4096-aligned below one huge page, 2 MiB-aligned in huge pages from
there up (O_DIRECT reads into 4 KiB pages ran at a third of the speed here, see ds_ops.host_memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_ops.aio import AsyncIOHandle
from ds_ops.aio._buffers import ALIGNMENT, aligned_tensor
from ds_ops.host_memory import HUGE_PAGE


@pytest.mark.parametrize("nbytes", [4096, HUGE_PAGE - 4, HUGE_PAGE, 3 * HUGE_PAGE + 12, 64 << 20])
def test_alignment_by_size(nbytes: int) -> None:
    tensor = aligned_tensor(nbytes // 4, torch.float32, pin=False)
    assert tensor.numel() == nbytes // 4 and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % (HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGNMENT) == 0


def test_round_trip_through_huge_page_buffers(tmp_path: Path) -> None:
    """Zero-copy O_DIRECT both ways between huge-page buffers, sizes not multiples of a huge page."""
    handle = AsyncIOHandle(block_size=1 << 20, queue_depth=4)
    numel = (5 << 20) // 4 + 1024
    source = handle.new_cpu_locked_tensor(numel, torch.empty(0))
    source.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(3)))
    handle.sync_pwrite(source, tmp_path / "x.bin")
    back = handle.new_cpu_locked_tensor(numel, source)
    handle.sync_pread(back, tmp_path / "x.bin")
    assert torch.equal(back, source)
    if handle.uses_o_direct(tmp_path / "x.bin"):
        assert handle.num_bytes_direct == handle.num_bytes_moved == 2 * numel * 4
    handle.close()
