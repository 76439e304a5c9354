"""Host staging buffers handed back after use and handed out again: ZeRO-3's per-step gathers and reductions.

[Note: why pool host buffers] Every ZeRO-3 step all-gathers each block's parameters into a receive
buffer and reduce-scatters its gradients from a send buffer, block after block, forward and backward:
the same few sizes over and over. On the host, a fresh `torch.empty` of megabytes comes from glibc
as new pages (the heap is trimmed or the block is mmapped), so every step pays a page fault and the
kernel's zero-fill per 4 KiB of each buffer before a byte is used: on the 21M GPT of
benchmarks/zero.py at 2 ranks, ~12k faults per rank per step, ~8% of the step's CPU time. A pool
keeps the last few buffers of each size (`keep` per size, `max_bytes` in all) and hands them out
again. Device buffers are not pooled: the accelerator's caching allocator already reuses them.
A buffer goes back only once nothing reads or writes it any more (its collective has been waited).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Free 1-D host buffers by (numel, dtype), oldest dropped first beyond `keep` per size or `max_bytes`."""

    __slots__ = ("keep", "max_bytes", "_free", "_bytes")

    def __init__(self, keep: int = 2, max_bytes: int = 256 * 2**20) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._free: OrderedDict[tuple[int, torch.dtype], list[torch.Tensor]] = OrderedDict()
        self._bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of `numel` elements (uninitialised contents): a pooled one when there is one."""
        if device.type == "cpu":
            free = self._free.get((numel, dtype))
            if free:
                buf = free.pop()
                self._bytes -= buf.numel() * buf.element_size()
                return buf
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Hand back a buffer from `take` that nothing uses any more (views of it must be dead too)."""
        nbytes = buf.numel() * buf.element_size()
        if buf.device.type != "cpu" or buf.dim() != 1 or nbytes > self.max_bytes:
            return
        key = (buf.numel(), buf.dtype)
        free = self._free.setdefault(key, [])
        self._free.move_to_end(key)
        if len(free) >= self.keep:
            return
        free.append(buf)
        self._bytes += nbytes
        while self._bytes > self.max_bytes:  # drop from the sizes used longest ago
            old_key, old = next(iter(self._free.items()))
            if old:
                dropped = old.pop(0)
                self._bytes -= dropped.numel() * dropped.element_size()
            if not old:
                del self._free[old_key]

    def clear(self) -> None:
        """Drop every pooled buffer."""
        self._free.clear()
        self._bytes = 0
