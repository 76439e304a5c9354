"""BufferPool: a handed-back host buffer is handed out again for the same size and dtype, within its limits."""

from __future__ import annotations

import torch

from ds_zero._buffer_pool import BufferPool

CPU = torch.device("cpu")


def test_same_size_reuses_the_storage() -> None:
    pool = BufferPool()
    a = pool.take(1000, torch.float32, CPU)
    ptr = a.data_ptr()
    pool.give(a)
    assert pool.take(1000, torch.float32, CPU).data_ptr() == ptr
    assert pool.take(1000, torch.float32, CPU).data_ptr() != ptr  # the pool is empty again: a fresh one


def test_other_size_or_dtype_is_fresh() -> None:
    pool = BufferPool()
    a = pool.take(1000, torch.float32, CPU)
    pool.give(a)
    assert pool.take(999, torch.float32, CPU).data_ptr() != a.data_ptr()
    b = pool.take(1000, torch.bfloat16, CPU)
    assert b.dtype == torch.bfloat16 and b.numel() == 1000 and b.data_ptr() != a.data_ptr()


def test_keep_and_max_bytes_bound_what_is_held() -> None:
    pool = BufferPool(keep=2, max_bytes=3 * 4000)
    bufs = [pool.take(1000, torch.float32, CPU) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool._bytes == 2 * 4000  # keep=2 per size
    other = pool.take(1000, torch.float64, CPU)  # 8000 bytes: over max_bytes with the two above
    pool.give(other)
    assert pool._bytes <= 3 * 4000
    assert pool.take(1000, torch.float64, CPU).data_ptr() == other.data_ptr()  # the newest size stays
    pool.give(torch.empty(2, 3))  # not 1-D: not pooled
    pool.clear()
    assert pool._bytes == 0
