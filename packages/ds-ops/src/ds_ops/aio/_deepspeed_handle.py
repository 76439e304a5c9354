"""`aio_handle`: DeepSpeed's face of `AsyncIOHandle` (what `AsyncIOBuilder().load().aio_handle(...)` builds).

DeepSpeed's handle is a pybind11 object whose calls return status counts: `async_pread`/`async_pwrite`
return 0 once queued, `sync_*`, `read`/`write`, `pread`/`pwrite` and `wait()` the number of requests
completed; its keyword names are `buffer`, `filename` (or `fd`, an open descriptor) and `file_offset`, and
its defaults are queue_depth 128 and overlap_events False. Locked buffers come from the process-wide
pinned-tensor manager (`ds_comm.locked_host_allocator`, the `pin_memory` op's), so `is_pinned` recognises
a buffer locked by any handle or by the pin op, and views of one. `AsyncIOHandle` is ds's own face (it
returns the request, which carries its checksum); both move bytes the same way.
"""

from __future__ import annotations

import logging
import os

import torch

from ds_comm import locked_host_allocator
from ds_ops.aio._handle import AsyncIOHandle

logger = logging.getLogger(__name__)

__all__ = ["aio_handle"]


def _target(filename: str | os.PathLike[str] | None, fd: int | None, where: str) -> str:
    if (filename is None) == (fd is None):
        raise TypeError(f"aio_handle.{where}: pass exactly one of filename= and fd=")
    if fd is not None:
        return os.readlink(f"/proc/self/fd/{int(fd)}")  # the op opens files by path
    return os.fspath(filename)  # type: ignore[arg-type]


class aio_handle(AsyncIOHandle):  # noqa: N801 - DeepSpeed's name
    """`AsyncIOHandle` with DeepSpeed's return values, keyword names and defaults (module docstring)."""

    def __init__(
        self,
        block_size: int = 1024 * 1024,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)

    # -- requests: DeepSpeed's status counts ------------------------------------------------------------
    def async_pread(  # type: ignore[override]
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike[str] | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Queue a read; 0 once queued (`wait()` then returns how many completed)."""
        super().async_pread(buffer, _target(filename, fd, "async_pread"), file_offset)
        return 0

    def async_pwrite(  # type: ignore[override]
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike[str] | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Queue a write; 0 once queued (`wait()` then returns how many completed)."""
        super().async_pwrite(buffer, _target(filename, fd, "async_pwrite"), file_offset)
        return 0

    def sync_pread(  # type: ignore[override]
        self, buffer: torch.Tensor, filename: str | os.PathLike[str], file_offset: int = 0
    ) -> int:
        """Read and wait; the number of requests completed (1)."""
        self.async_pread(buffer, filename, file_offset)
        return self.wait()

    def sync_pwrite(  # type: ignore[override]
        self, buffer: torch.Tensor, filename: str | os.PathLike[str], file_offset: int = 0
    ) -> int:
        """Write and wait; the number of requests completed (1)."""
        self.async_pwrite(buffer, filename, file_offset)
        return self.wait()

    def pread(self, buffer: torch.Tensor, filename: str, validate: bool, async_op: bool, file_offset: int = 0) -> int:
        """DeepSpeed's `pread(buffer, filename, validate, async)`: 0 when queued, else the completed count."""
        if async_op:
            return self.async_pread(buffer, filename, file_offset)
        return self.read(buffer, filename, validate, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: str, validate: bool, async_op: bool, file_offset: int = 0) -> int:
        """DeepSpeed's `pwrite(buffer, filename, validate, async)`: 0 when queued, else the completed count."""
        if async_op:
            return self.async_pwrite(buffer, filename, file_offset)
        return self.write(buffer, filename, validate, file_offset)

    def read(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Read and wait; with `validate`, compare with the file read through Python (ValueError if not equal)."""
        count = self.sync_pread(buffer, filename, file_offset)
        if validate:
            self._validate(buffer, filename, file_offset)
        return count

    def write(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Write and wait; with `validate`, compare the file's bytes with the buffer (ValueError if not equal)."""
        count = self.sync_pwrite(buffer, filename, file_offset)
        if validate:
            self._validate(buffer, filename, file_offset)
        return count

    @staticmethod
    def _validate(buffer: torch.Tensor, filename: str, file_offset: int) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        with open(filename, "rb") as f:
            f.seek(file_offset)
            on_disk = f.read(nbytes)
        if on_disk != bytes(buffer.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()):
            raise ValueError(
                f"aio_handle: validation failed: {filename} at offset {file_offset} differs from the buffer"
            )

    # -- locked buffers: the process-wide manager --------------------------------------------------------
    def new_cpu_locked_tensor(self, numel: int, example: torch.Tensor) -> torch.Tensor:
        """A page-locked tensor from the process-wide manager (this handle's aligned memory where mlock is refused)."""
        try:
            return locked_host_allocator().new_cpu_locked_tensor(numel, example)
        except (OSError, MemoryError, RuntimeError) as err:
            logger.info("aio_handle: page-locking %d elements failed (%s); using aligned unlocked memory", numel, err)
            return super().new_cpu_locked_tensor(numel, example)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:  # type: ignore[override]
        """Release a tensor from `new_cpu_locked_tensor` (of any handle or the pin op); True if it was one."""
        if locked_host_allocator().free_cpu_locked_tensor(tensor):
            return True
        try:
            super().free_cpu_locked_tensor(tensor)
        except ValueError:
            return False
        return True

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether `buffer` (or the region it views) is page-locked by the manager, or pinned by torch."""
        if locked_host_allocator().is_pinned(buffer):
            return True
        return buffer.device.type == "cpu" and torch.cuda.is_available() and buffer.is_pinned()
