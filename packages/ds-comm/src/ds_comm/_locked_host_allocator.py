"""Page-locked host allocations straight from libc (posix_memalign + mlock), handed out as CPU tensors.

[Note: why libc through ctypes] DeepSpeed's `pin_memory` op is a torch C++ extension around four libc
calls (posix_memalign, mlock, munlock, free); its first use JIT-compiles against torch's headers, which
is the ~2 minutes its native-backend test spends. The calls need no compiler, so ds makes them through
`ctypes` on the C library the interpreter already runs on: nothing to build, nothing to cache, and the
memory is the same page-aligned, mlocked memory. `torch.frombuffer` views it without a copy.

The allocator only knows addresses and sizes; lifetimes (who frees, when) are `NativePinnedMemory`'s.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import resource
import threading

import torch

__all__ = ["LockedHostAllocator", "locked_host_allocator"]


class _LibC:
    """The four libc functions, bound once with their C types."""

    def __init__(self) -> None:
        if os.name != "posix":
            raise RuntimeError(f"the pin_memory allocator needs a POSIX host (mlock); this is {os.name!r}")
        libc = ctypes.CDLL(None, use_errno=True)
        self.posix_memalign = libc.posix_memalign
        self.posix_memalign.restype = ctypes.c_int
        self.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        self.mlock = libc.mlock
        self.mlock.restype = ctypes.c_int
        self.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.munlock = libc.munlock
        self.munlock.restype = ctypes.c_int
        self.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.free = libc.free
        self.free.restype = None
        self.free.argtypes = [ctypes.c_void_p]


def _memlock_limit_text() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"


class LockedHostAllocator:
    """Page-aligned, mlocked host buffers, tracked by base address.

    DeepSpeed's pin handle (`PinMemoryBuilder().load().pin_handle()`) has this interface:
    `new_cpu_locked_tensor`, `free_cpu_locked_tensor`, `free_cpu_locked_tensor_by_ptr`, `is_pinned`.
    Thread-safe: one lock guards the table of live regions.
    """

    def __init__(self) -> None:
        self._libc = _LibC()
        self._page_bytes = mmap.PAGESIZE
        self._regions: dict[int, int] = {}  # base address -> bytes locked
        # Reentrant: a garbage-collection finalizer (NativePinnedMemory's) may free a region from inside
        # a locked section of this same thread.
        self._lock = threading.RLock()

    @property
    def num_regions(self) -> int:
        """How many locked regions are live."""
        return len(self._regions)

    def new_cpu_locked_tensor(self, numel: int, example: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor of `numel` elements of `example.dtype` in fresh page-locked memory (uninitialized).

        The memory stays locked until `free_cpu_locked_tensor(_by_ptr)` is called; the tensor does not own it.

        Raises:
            ValueError: `numel` is below 1.
            MemoryError: the allocation or the mlock failed (the message names the memlock limit).
        """
        if numel < 1:
            # an empty tensor reports data_ptr() 0: it could not be freed by its address
            raise ValueError(f"new_cpu_locked_tensor: numel must be >= 1, got {numel}")
        num_bytes = locked_bytes = numel * example.element_size()
        address = ctypes.c_void_p()
        code = self._libc.posix_memalign(ctypes.byref(address), self._page_bytes, locked_bytes)
        if code != 0 or not address.value:
            raise MemoryError(f"pin_memory: posix_memalign of {num_bytes} bytes failed ({os.strerror(code)})")
        base = address.value
        if self._libc.mlock(base, locked_bytes) != 0:
            code = ctypes.get_errno()
            self._libc.free(base)
            hint = ""
            if code in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
                hint = (
                    f"; the memlock limit (ulimit -l) is {_memlock_limit_text()}: raise it, or use "
                    "DS_PIN_MEMORY_BACKEND=torch"
                )
            raise MemoryError(f"pin_memory: mlock of {num_bytes} bytes failed ({os.strerror(code)}){hint}")
        with self._lock:
            self._regions[base] = locked_bytes
        raw = torch.frombuffer((ctypes.c_uint8 * locked_bytes).from_address(base), dtype=torch.uint8)
        return raw.view(example.dtype)

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Unlock and free the region based at `address`; False when no live region starts there.

        Any tensor still viewing the region points at freed memory afterwards.
        """
        with self._lock:
            num_bytes = self._regions.pop(address, None)
        if num_bytes is None:
            return False
        self._libc.munlock(address, num_bytes)
        self._libc.free(address)
        return True

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """`free_cpu_locked_tensor_by_ptr(tensor.data_ptr())`: `tensor` must start at a region's base."""
        return self.free_cpu_locked_tensor_by_ptr(tensor.data_ptr())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether all of `tensor`'s bytes lie inside one live region (views and slices count)."""
        if tensor.device.type != "cpu":
            return False
        begin = tensor.data_ptr()
        end = begin + tensor.nbytes
        with self._lock:
            regions = self._regions.copy()  # a finalizer run mid-iteration would change the dict under us
        return any(base <= begin and end <= base + size for base, size in regions.items())


@functools.cache
def locked_host_allocator() -> LockedHostAllocator:
    """The process-wide allocator (one table of regions per process).

    Raises:
        RuntimeError: the host is not POSIX.
    """
    return LockedHostAllocator()
