"""With a CUDA device, `new_cpu_locked_tensor` buffers are page-locked and still 4096-aligned, and a
GPU tensor swapped out through one (device -> pinned host -> file -> pinned host -> device) comes back
bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_ops.aio import AsyncIOHandle


@pytest.mark.cuda
def test_pinned_buffers_round_trip_a_gpu_tensor(tmp_path: Path) -> None:
    handle = AsyncIOHandle(intra_op_parallelism=2)
    gpu = torch.randn(3_000_001, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    buffer = handle.new_cpu_locked_tensor(gpu.numel(), gpu)
    assert buffer.is_pinned() and buffer.data_ptr() % 4096 == 0 and buffer.dtype == gpu.dtype
    buffer.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    handle.sync_pwrite(buffer, tmp_path / "swap.bin")
    back = handle.new_cpu_locked_tensor(gpu.numel(), gpu)
    handle.sync_pread(back, tmp_path / "swap.bin")
    restored = back.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(restored, gpu)
    if handle.uses_o_direct(tmp_path / "swap.bin"):  # aligned buffers: all but the sub-4 KiB tail go direct
        assert handle.num_bytes_direct == 2 * (gpu.numel() * 4 - gpu.numel() * 4 % 4096)
