"""`FastFileWriter`: a file object for `torch.save` that writes through aligned staging buffers with the async I/O op.

    handle = AsyncIOHandle(block_size=1 << 20, queue_depth=8)
    buffer = handle.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))
    writer = FastFileWriter("model.pt", FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=buffer))
    torch.save(state, writer)
    writer.close()

The file holds exactly the bytes `torch.save(state, open("model.pt", "wb"))` would: the writer only changes
how they reach the disk (large aligned O_DIRECT requests from a staging buffer instead of the page cache).

[Note: parallel writers] With `num_parallel_writers=N`, N processes that serialize the same object write
one file together: the byte stream is cut into stripes of one buffer's capacity and writer `r` writes
the stripes `r, r+N, r+2N, ...` at their offsets, skipping the rest. Stripes need no knowledge of the
total size, so each writer streams as torch produces the bytes, and together the N writers leave the
same file one writer would. The file is neither created nor truncated by a parallel writer (the caller
hands them one fresh file), and `stream_num_bytes`/`stream_tail` let the caller check that every writer
saw the same stream before it trusts the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
import warnings
from typing import Any

import torch

from ds_ops.fast_io import constants as s
from ds_ops.fast_io._base import BaseFileWriter, storage_bytes
from ds_ops.fast_io._io_buffers import DoubleIOBuffer, SingleIOBuffer

logger = logging.getLogger(__name__)

__all__ = ["FastFileWriter", "FastFileWriterConfig"]

#: Bytes of the stream's end each writer keeps: with torch's zipfile format it holds the central
#: directory, whose CRC-32 of every record makes its digest a fingerprint of the whole file.
TAIL_BYTES = 1 << 16


@dataclasses.dataclass
class FastFileWriterConfig:
    """How a `FastFileWriter` writes (DeepSpeed's fields).

    Attributes:
        dnvme_handle: the `AsyncIOHandle` (DeepSpeed's `aio_handle`) that moves the buffers to the file.
        pinned_tensor: staging memory, 1-D uint8, a multiple of the handle's alignment (twice it when
            double-buffered); `handle.new_cpu_locked_tensor` gives memory the op writes without a copy.
        double_buffer: split the memory in two halves and fill one while the other is written.
        num_parallel_writers: writers of one file (see the module note); 1 for a writer of its own.
        writer_rank: this writer's index among them, in [0, num_parallel_writers).
        global_rank: the process's rank, recorded in the statistics.
    """

    dnvme_handle: Any
    pinned_tensor: torch.Tensor
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0


def _check_config(config: object) -> FastFileWriterConfig:
    if not isinstance(config, FastFileWriterConfig):
        raise TypeError(f"FastFileWriter: config must be a FastFileWriterConfig, got {type(config).__name__}")
    for name in ("num_parallel_writers", "writer_rank", "global_rank"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"FastFileWriterConfig.{name}={value!r} must be an int >= 0")
    if config.num_parallel_writers < 1 or config.writer_rank >= config.num_parallel_writers:
        raise ValueError(
            f"FastFileWriterConfig: writer_rank={config.writer_rank} must be in [0, num_parallel_writers="
            f"{config.num_parallel_writers})"
        )
    if not callable(getattr(config.dnvme_handle, "async_pwrite", None)):
        raise TypeError(
            "FastFileWriterConfig.dnvme_handle must be an async I/O handle (AsyncIOHandle / aio_handle), "
            f"got {type(config.dnvme_handle).__name__}"
        )
    return config


class FastFileWriter(BaseFileWriter):
    """Streams `torch.save`'s bytes into aligned staging buffers and writes them with the async I/O op.

    Raises (from `write` or `close`): the op's `AioError` naming the file when a write fails; the file
    is then incomplete, and a later `close()` releases the writer without writing or raising again.
    """

    def __init__(self, file_path: str | os.PathLike[str], config: FastFileWriterConfig) -> None:
        super().__init__(file_path)
        self._config = _check_config(config)
        buffer_type = DoubleIOBuffer if config.double_buffer else SingleIOBuffer
        self._io_buffer = buffer_type(config.pinned_tensor, config.dnvme_handle)
        self._writers = config.num_parallel_writers
        self._rank = config.writer_rank
        if self._writers == 1:
            with open(self._file_path, "wb"):  # a writer of its own starts from an empty file
                pass
        elif not os.path.exists(self._file_path):
            raise FileNotFoundError(
                f"FastFileWriter: {self._file_path!r} does not exist; parallel writers "
                f"(num_parallel_writers={self._writers}) write into one file their caller created"
            )
        self._stream_offset = 0
        self._stripe_start: int | None = None  # file offset of the stripe the buffer holds
        self._tail = bytearray()
        self._closed = False
        self.failure: BaseException | None = None
        """The error a write to the file raised, if any (torch.save may report its own error on top of it)."""
        self._stats.update(dict.fromkeys(s.FASTIO_STAT_KEYS, 0))
        self._stats[s.RANK_KEY] = config.global_rank

    # -- the file-object face torch.save uses -------------------------------------------------------------
    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        """Take the next bytes of the stream; full buffers go to the file as they fill. Returns the count."""
        if self._closed:
            raise ValueError(f"FastFileWriter: write to {self._file_path!r} after close()")
        view = memoryview(buffer).cast("B")
        start = time.perf_counter()
        num_bytes = view.nbytes
        if num_bytes:
            self._keep_tail(view)
            self._write_stream(_as_tensor(view))
        self._count_write(num_bytes, time.perf_counter() - start)
        return num_bytes

    def save_torch_storage_object_list(self, storage_obj_list: list[Any], save_size: bool) -> int:
        """Write storages' bytes in order (each after its 8-byte little-endian element count with `save_size`),
        as torch's legacy format lays them out; returns the bytes taken."""
        start = time.perf_counter()
        total = 0
        for storage_obj in storage_obj_list:
            data = storage_bytes(storage_obj)
            if save_size:
                itemsize = storage_obj[1].itemsize if isinstance(storage_obj, tuple) else 1
                total += self.write(int(data.numel() // itemsize).to_bytes(s.STORAGE_OBJ_SIZE, "little"))
            total += self.write(data.numpy().data)  # the array's memoryview
            self._incr_stats(s.SAVE_STORAGE_KEY)
            self._incr_stats(s.SAVE_STORAGE_BYTES_KEY, data.numel())
        self._stats.setdefault(s.SAVE_STORAGE_SEC_KEY, 0.0)
        self._incr_stats(s.SAVE_STORAGE_SEC_KEY, time.perf_counter() - start)
        return total

    def flush(self) -> None:
        """Counted only: a partly filled buffer waits for more bytes (`close` writes it)."""
        super().flush()

    def close(self) -> None:
        """Write what the buffer holds, wait for every request, fsync. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # After a failed write the error was raised where it happened; the file is incomplete: write no more.
        if self.failure is not None:
            self._io_buffer.reset()
            super().close()
            return
        start = time.perf_counter()
        try:
            self._drain()
            self._io_buffer.complete_ongoing_drain()
            if self._stream_offset:
                fd = os.open(self._file_path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            self._io_buffer.reset()
            self._incr_stats(s.AIO_WRITE_SEC_KEY, time.perf_counter() - start)
            super().close()

    def __del__(self) -> None:
        # Requests still in flight read the buffer memory: wait for them before it can go.
        if not getattr(self, "_closed", True):
            try:
                self._io_buffer.complete_ongoing_drain()
            except Exception as err:  # noqa: BLE001 - a finalizer must not raise; the caller skipped close()
                logger.debug("FastFileWriter(%s) dropped without close(): %s", self._file_path, err)

    # -- what the caller checks ------------------------------------------------------------------------------
    @property
    def stream_num_bytes(self) -> int:
        """Bytes of the whole stream this writer saw (the file's size once every writer closed)."""
        return self._stream_offset

    def stream_tail_digest(self) -> str:
        """SHA-1 of the stream's last bytes (up to 64 KiB): equal across writers that saw the same stream."""
        return hashlib.sha1(bytes(self._tail)).hexdigest()

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out[s.AIO_SPEED_KEY] = s.speed(out[s.AIO_WRITE_BYTES_KEY], out[s.AIO_WRITE_SEC_KEY])
        out[s.AIO_FILL_BUFFER_SPEED_KEY] = s.speed(out[s.AIO_WRITE_BYTES_KEY], out[s.AIO_FILL_BUFFER_SEC_KEY])
        return out

    # -- stripes ---------------------------------------------------------------------------------------------
    def _keep_tail(self, view: memoryview) -> None:
        self._tail += view[-TAIL_BYTES:]
        if len(self._tail) > TAIL_BYTES:
            del self._tail[: len(self._tail) - TAIL_BYTES]

    def _write_stream(self, src: torch.Tensor) -> None:
        stripe = self._io_buffer.capacity
        position = 0
        while position < src.numel():
            index, within = divmod(self._stream_offset, stripe)
            room = min(stripe - within, src.numel() - position)
            if index % self._writers == self._rank:
                if self._stripe_start is None:
                    self._stripe_start = index * stripe
                start = time.perf_counter()
                copied = self._io_buffer.fill(src, position)
                self._incr_stats(s.AIO_FILL_BUFFER_SEC_KEY, time.perf_counter() - start)
                self._incr_stats(s.AIO_FILL_BUFFER_COUNT_KEY)
                room = min(room, copied)
                if self._io_buffer.is_full():
                    self._drain()
            position += room
            self._stream_offset += room

    def _drain(self) -> None:
        if self._stripe_start is None:
            return
        start = time.perf_counter()
        try:
            num_bytes = self._io_buffer.drain(self._file_path, self._stripe_start)
        except BaseException as err:
            self.failure = err
            raise
        self._incr_stats(s.AIO_WRITE_SEC_KEY, time.perf_counter() - start)
        self._incr_stats(s.AIO_WRITE_BYTES_KEY, num_bytes)
        self._stripe_start = None


def _as_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over the bytes, no copy (read-only input is only read: torch's warning about it is moot)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)
