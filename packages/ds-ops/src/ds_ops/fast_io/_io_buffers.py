"""The staging buffers of `FastFileWriter`: one buffer (fill, write, wait) or two (fill one while the other writes).

A buffer collects the serialized bytes until it holds `capacity` of them, then hands that span to the
async I/O op as one request at a file offset. `SingleIOBuffer` waits for the request before it is
filled again; `DoubleIOBuffer` splits the memory in two halves and fills the second while the first
is on its way to the file, waiting only when it comes back to a half still in flight: the copy into
the buffer and the device write overlap.

The file offsets a writer drains at are multiples of `capacity`, itself a multiple of the op's
alignment, so every request but the file's last short one takes the op's O_DIRECT path.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ds_ops.aio._buffers import ALIGNMENT

if TYPE_CHECKING:
    from ds_ops.aio._handle import AsyncIOHandle

__all__ = ["DoubleIOBuffer", "SingleIOBuffer", "handle_alignment"]


def handle_alignment(handle: object) -> int:
    """The alignment the I/O handle needs (DeepSpeed's handles answer `get_alignment()`)."""
    get = getattr(handle, "get_alignment", None)
    return int(get()) if callable(get) else ALIGNMENT


def _check_pinned(pinned_tensor: object, parts: int, alignment: int) -> torch.Tensor:
    if not isinstance(pinned_tensor, torch.Tensor):
        raise TypeError(
            f"FastFileWriterConfig.pinned_tensor must be a torch.Tensor, got {type(pinned_tensor).__name__}"
        )
    if pinned_tensor.dtype != torch.uint8 or pinned_tensor.dim() != 1 or not pinned_tensor.is_contiguous():
        raise ValueError(
            "FastFileWriterConfig.pinned_tensor must be a contiguous 1-D torch.uint8 tensor, got "
            f"{pinned_tensor.dtype} of shape {tuple(pinned_tensor.shape)}"
        )
    if pinned_tensor.device.type != "cpu":
        raise ValueError(
            f"FastFileWriterConfig.pinned_tensor must be host memory, got a tensor on {pinned_tensor.device}"
        )
    unit = parts * alignment
    if pinned_tensor.numel() == 0 or pinned_tensor.numel() % unit:
        kind = "double_buffer=True" if parts == 2 else "double_buffer=False"
        raise ValueError(
            f"FastFileWriterConfig.pinned_tensor has {pinned_tensor.numel()} bytes; with {kind} it must be a "
            f"positive multiple of {unit} ({parts} x the I/O alignment {alignment})"
        )
    return pinned_tensor


class SingleIOBuffer:
    """One staging buffer: a drain writes it and waits before the next fill.

    Args:
        pinned_tensor: the buffer memory (1-D uint8, a multiple of the alignment; page-aligned memory
            from `AsyncIOHandle.new_cpu_locked_tensor` takes the op's zero-copy path).
        handle: the `AsyncIOHandle` that writes it.
    """

    parts = 1

    def __init__(self, pinned_tensor: torch.Tensor, handle: AsyncIOHandle) -> None:
        self._handle = handle
        alignment = handle_alignment(handle)
        memory = _check_pinned(pinned_tensor, self.parts, alignment)
        size = memory.numel() // self.parts
        self._halves = [memory.narrow(0, i * size, size) for i in range(self.parts)]
        self._fill_index = 0
        self._in_flight: int | None = None
        self._offset = 0

    @property
    def capacity(self) -> int:
        """Bytes one fill holds: what one request writes."""
        return self._halves[0].numel()

    def get_buffer(self) -> torch.Tensor:
        """The buffer being filled."""
        return self._halves[self._fill_index]

    def get_offset(self) -> int:
        """Bytes filled so far."""
        return self._offset

    def fill(self, src: torch.Tensor, src_offset: int) -> int:
        """Copy bytes of the 1-D uint8 `src` from `src_offset` until the buffer is full; returns the count."""
        count = min(src.numel() - src_offset, self.capacity - self._offset)
        if count > 0:
            self.get_buffer().narrow(0, self._offset, count).copy_(src.narrow(0, src_offset, count))
            self._offset += count
        return max(count, 0)

    def is_full(self) -> bool:
        return self._offset == self.capacity

    def is_empty(self) -> bool:
        return self._offset == 0 and self._in_flight is None

    def reset(self) -> None:
        self._offset = 0

    def drain(self, path: str | os.PathLike[str], file_offset: int) -> int:
        """Write the filled bytes to `path` at `file_offset`; returns how many. The buffer is empty after."""
        num_bytes = self._offset
        if num_bytes:
            self._handle.async_pwrite(self.get_buffer().narrow(0, 0, num_bytes), os.fspath(path), file_offset)
            self._in_flight = self._fill_index
            self._after_submit()
        self._offset = 0
        return num_bytes

    def _after_submit(self) -> None:
        self.complete_ongoing_drain()

    def complete_ongoing_drain(self) -> None:
        """Wait for the request in flight, if any (raises the op's `AioError` if it failed)."""
        if self._in_flight is not None:
            self._in_flight = None
            self._handle.wait()


class DoubleIOBuffer(SingleIOBuffer):
    """Two halves: one is filled while the other is written; a half is reused only once its write is done."""

    parts = 2

    def _after_submit(self) -> None:
        self._fill_index = (
            1 - self._fill_index
        )  # fill the other half; its previous write finished before this one began

    def drain(self, path: str | os.PathLike[str], file_offset: int) -> int:
        # One request in flight at a time: the half being drained now may only go once the other's is done.
        if self._offset:
            self.complete_ongoing_drain()
        return super().drain(path, file_offset)
