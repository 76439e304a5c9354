"""The statistics a file writer keeps, under DeepSpeed's key names (`deepspeed.io.constants`).

A writer counts its calls and bytes as it goes; `FastFileWriter` adds what the aligned I/O path did
(bytes moved by the async I/O op, buffer fills, time in each). `rates` derives the GB/s entries, in
DeepSpeed's unit (bytes / seconds / 1024**3).
"""

from __future__ import annotations

INVALID_FD = -1
"""What `fileno()` returns: torch must not treat a writer as an OS file (it would bypass `write`)."""

FILE_PATH_KEY = "path"
FLUSH_COUNT_KEY = "flush"
WRITE_COUNT_KEY = "write"
CLOSE_COUNT_KEY = "close"
FILENO_COUNT_KEY = "fileno"
WRITE_BYTES_KEY = "bytes"
WRITE_SEC_KEY = "write_secs"
WRITE_SPEED_KEY = "write_GB/s"

AIO_WRITE_SEC_KEY = "aio_write_secs"
AIO_WRITE_BYTES_KEY = "aio_bytes"
AIO_SPEED_KEY = "aio_GB/s"
SLOW_WRITE_BYTES_KEY = "slow_bytes"
SLOW_WRITE_SEC_KEY = "slow_write_secs"
AIO_FILL_BUFFER_SEC_KEY = "fill_buffer_secs"
AIO_FILL_BUFFER_COUNT_KEY = "fill_buffer_count"
AIO_FILL_BUFFER_SPEED_KEY = "fill_buffer_GB/s"

SAVE_STORAGE_KEY = "save_storage"
SAVE_STORAGE_BYTES_KEY = "save_storage_bytes"
SAVE_STORAGE_SEC_KEY = "save_storage_secs"
STORAGE_OBJ_SIZE = 8
"""Bytes of the size field torch's legacy format writes before each storage."""

RANK_KEY = "rank"

BASE_STAT_KEYS = (
    CLOSE_COUNT_KEY,
    FILENO_COUNT_KEY,
    FLUSH_COUNT_KEY,
    WRITE_COUNT_KEY,
    WRITE_BYTES_KEY,
    WRITE_SEC_KEY,
    WRITE_SPEED_KEY,
)
FASTIO_STAT_KEYS = (
    AIO_WRITE_SEC_KEY,
    AIO_WRITE_BYTES_KEY,
    AIO_SPEED_KEY,
    SLOW_WRITE_BYTES_KEY,
    SLOW_WRITE_SEC_KEY,
    AIO_FILL_BUFFER_COUNT_KEY,
    AIO_FILL_BUFFER_SEC_KEY,
    AIO_FILL_BUFFER_SPEED_KEY,
    SAVE_STORAGE_KEY,
    SAVE_STORAGE_BYTES_KEY,
)

_GIB = 1024**3


def speed(num_bytes: float, seconds: float) -> float:
    """GB/s as DeepSpeed reports it (GiB, in fact); 0 when no time was measured."""
    return num_bytes / seconds / _GIB if seconds > 0 else 0.0
