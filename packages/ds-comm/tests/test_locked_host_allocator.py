"""The libc allocator behind native pinned memory: page-aligned mlocked regions, range checks, frees."""

from __future__ import annotations

import mmap
import os
import resource

import pytest
import torch

from ds_comm import LockedHostAllocator, locked_host_allocator


def test_regions_are_aligned_tracked_and_freed() -> None:
    allocator = LockedHostAllocator()
    buffer = allocator.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float64))
    assert buffer.shape == (1000,) and buffer.dtype == torch.float64 and buffer.data_ptr() % mmap.PAGESIZE == 0
    buffer.copy_(torch.arange(1000, dtype=torch.float64))  # the memory is writable and ours
    assert float(buffer.sum()) == 999 * 1000 / 2
    assert allocator.num_regions == 1
    assert allocator.is_pinned(buffer) and allocator.is_pinned(buffer[100:200])
    assert not allocator.is_pinned(torch.zeros(1000, dtype=torch.float64))
    assert allocator.free_cpu_locked_tensor(buffer) is True
    assert allocator.num_regions == 0
    assert allocator.free_cpu_locked_tensor_by_ptr(12345) is False


def test_an_empty_buffer_is_refused() -> None:
    # an empty tensor reports data_ptr() 0, so it could never be freed by address
    with pytest.raises(ValueError, match="numel must be >= 1, got 0"):
        LockedHostAllocator().new_cpu_locked_tensor(0, torch.empty(0))


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="numel must be >= 1, got -1"):
        LockedHostAllocator().new_cpu_locked_tensor(-1, torch.empty(0))


def test_the_process_allocator_is_one_object() -> None:
    assert locked_host_allocator() is locked_host_allocator()


def test_a_refused_mlock_names_the_memlock_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
    try:
        allocator = LockedHostAllocator()
        try:
            buffer = allocator.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
        except MemoryError as err:
            assert "mlock of 1048576 bytes failed" in str(err) and "ulimit -l" in str(err)
            assert "64 KiB" in str(err) and "DS_PIN_MEMORY_BACKEND=torch" in str(err)
            assert allocator.num_regions == 0
        else:
            allocator.free_cpu_locked_tensor(buffer)
            assert os.geteuid() == 0, "only a privileged process may lock past RLIMIT_MEMLOCK"
            pytest.skip("running as root (CAP_IPC_LOCK): the memlock limit does not apply")
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
