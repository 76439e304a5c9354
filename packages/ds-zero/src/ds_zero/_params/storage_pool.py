"""Host memory of released full storages, handed to the next gather of the same size instead of freed.

[Note: why released full storages are pooled]
A release shrinks a parameter's full storage to 0 bytes and the next gather grows it again (see [Note: a
release never frees memory another tensor holds] in `partitioned_param`). On the host a large block comes
back from glibc as freshly mapped pages: every 4 KiB (or 2 MiB huge page) is faulted in and zero-filled by
the kernel before the gather's copy writes it. On ZeRO-Infinity's 0.6B job (`benchmarks/infinity.py
--layers 9`, 134 MB per layer, one rank) that is most of the forward: 0.6-0.7 s against 0.35-0.4 s when the
pages are reused. The pool keeps a released storage's bytes (moved out with torch's
`UntypedStorage._swap_data_ptr_`, so the parameter's storage object stays the same and its views stay
valid) and moves them into the next parameter of the same byte size that grows its storage.

The same goes for a large weight's gradient at one rank: `_construct.linear` computes it into a pooled block
and the stage-3 reducer hands the block back once the gradient has been added where it goes.

Bounds: only host storages of at least `MIN_POOLED_BYTES` (smaller blocks come from glibc's heap, which
already reuses them), at most `capacity` bytes in all (each coordinator raises it to three of its model's
largest full storages: a weight gathered ahead, one in use, and a gradient), the oldest block freed first.
So between steps the pool holds at most those three blocks more than ds held without it. `clear()` frees
them all (`empty_partition_cache`, the optimizer's `destroy`). A torch without `_swap_data_ptr_` grows and
frees storages as before.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

__all__ = ["MIN_POOLED_BYTES", "ReleasedStoragePool", "released_storages"]

MIN_POOLED_BYTES = 8 * 2**20
"""Smaller storages are left to the allocator (glibc serves them from its heap without new pages)."""

_swap_bytes = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
"""`a._swap_data_ptr_(b)`: `a` and `b` exchange their memory and sizes (one may be empty); None before torch had it."""
_CAN_SWAP = _swap_bytes is not None


class ReleasedStoragePool:
    """Blocks of released host storages by byte size, oldest freed first beyond `capacity` bytes."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, list[torch.UntypedStorage]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # releases can come from autograd's threads
        self.hits = 0
        """Grows served from the pool (a diagnostic, and what the tests read)."""

    @property
    def pooled_bytes(self) -> int:
        """Bytes the pool holds now."""
        return self._bytes

    def reserve(self, nbytes: int) -> None:
        """Let the pool hold at least `nbytes` (what a coordinator's model needs); never lowers it."""
        self.capacity = max(self.capacity, nbytes)

    def take_from(self, storage: torch.UntypedStorage) -> bool:
        """Move `storage`'s bytes into the pool, leaving it 0 bytes; False (nothing done) if not pooled."""
        nbytes = storage.nbytes()
        if not _CAN_SWAP or storage.device.type != "cpu" or nbytes < MIN_POOLED_BYTES or nbytes > self.capacity:
            return False
        block = torch.UntypedStorage(0)
        _swap_bytes(block, storage)  # type: ignore[misc]
        with self._lock:
            self._blocks.setdefault(nbytes, []).append(block)
            self._blocks.move_to_end(nbytes)
            self._bytes += nbytes
            dropped = self._trim()
        del dropped  # freed outside the lock
        return True

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the 0-byte `storage` a pooled block of `nbytes` (contents undefined); False if none."""
        if not _CAN_SWAP or storage.nbytes() != 0 or storage.device.type != "cpu":
            return False
        with self._lock:
            blocks = self._blocks.get(nbytes)
            if not blocks:
                return False
            block = blocks.pop()
            if not blocks:
                del self._blocks[nbytes]
            self._bytes -= nbytes
            self.hits += 1
        _swap_bytes(storage, block)  # type: ignore[misc]
        return True

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous host tensor of `shape`/`dtype` on a pooled block of exactly its bytes (contents
        undefined); None when the pool has none (the caller allocates as usual)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES:
            return None
        storage = torch.UntypedStorage(0)
        if not self.fill(storage, nbytes):
            return None
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)

    def clear(self) -> None:
        """Free every pooled block."""
        with self._lock:
            blocks, self._blocks, self._bytes = self._blocks, OrderedDict(), 0
        blocks.clear()

    def _trim(self) -> list[torch.UntypedStorage]:
        dropped: list[torch.UntypedStorage] = []
        while self._bytes > self.capacity and self._blocks:
            nbytes, blocks = next(iter(self._blocks.items()))
            dropped.append(blocks.pop(0))
            if not blocks:
                del self._blocks[nbytes]
            self._bytes -= nbytes
        return dropped


released_storages = ReleasedStoragePool()
"""The process's pool: the host allocator is per process, and so is the memory it saves."""
