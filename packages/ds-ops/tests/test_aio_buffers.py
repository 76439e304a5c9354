"""`new_cpu_locked_tensor` buffers: 4096-aligned below one huge page; from 2 MiB up, 2 MiB-aligned in a
mapping marked for transparent huge pages (O_DIRECT reads into 4 KiB pages ran at a third of the speed
here, see ds_ops/aio/_buffers.py), with memory that stays valid as long as any view of it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from ds_ops.aio import AsyncIOHandle
from ds_ops.aio._buffers import ALIGNMENT, HUGE_PAGE, aligned_tensor

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(address: int) -> bool | None:
    """The THPeligible flag of the mapping holding `address` in /proc/self/smaps (None: not reported)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's header line: "start-end perms ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


@pytest.mark.parametrize("nbytes", [4096, HUGE_PAGE - 4, HUGE_PAGE, 3 * HUGE_PAGE + 12, 64 << 20])
def test_alignment_by_size(nbytes: int) -> None:
    tensor = aligned_tensor(nbytes // 4, torch.float32, pin=False)
    assert tensor.numel() == nbytes // 4 and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % (HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGNMENT) == 0


def test_huge_page_buffer_is_marked_and_outlives_its_mapping_object() -> None:
    numel = (8 << 20) // 2
    tensor = aligned_tensor(numel, torch.bfloat16, pin=False)
    gc.collect()  # only the tensor refers to the mapping now
    tensor.copy_(torch.arange(numel, dtype=torch.float32).to(torch.bfloat16))
    assert torch.equal(tensor, torch.arange(numel, dtype=torch.float32).to(torch.bfloat16))
    mode = THP_MODE.read_text() if THP_MODE.exists() else "[never]"
    eligible = _thp_eligible(tensor.data_ptr())
    if "[never]" in mode or eligible is None:
        pytest.skip(f"transparent huge pages are off or not reported here ({mode.strip()})")
    assert eligible, "the buffer's mapping is not eligible for transparent huge pages"


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
