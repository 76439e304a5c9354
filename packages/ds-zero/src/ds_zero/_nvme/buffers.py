"""A pool of page-aligned host buffers, allocated once, from which swapped-in shards take aligned slices.

`offload_param.buffer_count` buffers of up to `offload_param.buffer_size` elements each. A shard swapped
in takes a slice of one buffer (first fit, starting at a 4 KiB-aligned offset so O_DIRECT reads land
straight in it); releasing the shard returns the slice. The buffers themselves are never reallocated
while training runs.
"""

from __future__ import annotations

import logging

import torch

from ds_ops.aio import AsyncIOHandle

logger = logging.getLogger(__name__)

__all__ = ["BufferPool", "Slot", "aligned_numel"]

_ALIGN_BYTES = 4096

Slot = tuple[int, int, int]  # (buffer index, offset, elements reserved)


def aligned_numel(n: int, dtype: torch.dtype) -> int:
    """Elements a slice of `n` elements occupies in a pool (rounded up to 4 KiB)."""
    align = max(1, _ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    return -(-max(n, 1) // align) * align


class BufferPool:
    """`count` buffers of `numel` elements of `dtype`, handing out aligned slices.

    Args:
        handle: the async I/O handle that allocates page-aligned (pinned where possible) tensors.
        count: number of buffers.
        numel: elements per buffer.
        dtype: element type (the shards' dtype).
    """

    def __init__(self, handle: AsyncIOHandle, *, count: int, numel: int, dtype: torch.dtype) -> None:
        self.handle = handle
        self.dtype = dtype
        self.numel = numel
        self.count = count
        example = torch.empty(0, dtype=dtype)
        self.buffers = [handle.new_cpu_locked_tensor(numel, example) for _ in range(count)]
        self._free: list[list[tuple[int, int]]] = [[(0, numel)] for _ in range(count)]
        self.used_numel = 0

    @property
    def capacity(self) -> int:
        return self.count * self.numel

    def reserved(self, n: int) -> int:
        """Elements a request for `n` occupies (rounded up to the alignment)."""
        return aligned_numel(n, self.dtype)

    def alloc(self, n: int) -> Slot | None:
        """An aligned slice of `n` elements, or None when no buffer has room."""
        need = min(self.reserved(n), self.numel)
        if n > self.numel:
            return None
        for index, free in enumerate(self._free):
            for k, (start, length) in enumerate(free):
                if length >= need:
                    if length == need:
                        del free[k]
                    else:
                        free[k] = (start + need, length - need)
                    self.used_numel += need
                    return (index, start, need)
        return None

    def view(self, slot: Slot, n: int) -> torch.Tensor:
        index, start, _ = slot
        return self.buffers[index][start : start + n]

    def free(self, slot: Slot) -> None:
        index, start, need = slot
        free = self._free[index]
        free.append((start, need))
        free.sort()
        merged: list[tuple[int, int]] = []
        for s, length in free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self._free[index] = merged
        self.used_numel -= need

    def close(self) -> None:
        for buffer in self.buffers:
            self.handle.free_cpu_locked_tensor(buffer)
        self.buffers = []
