"""The file-like face `torch.save` writes through, and the two simple writers (Python file, mock).

`torch.save(obj, writer)` streams the archive through `writer.write(bytes)` and ends with
`writer.flush()`; `fileno()` answers -1 so torch never bypasses `write` with the OS descriptor. Every
writer counts calls, bytes and seconds under DeepSpeed's statistic names (see `constants`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from ds_ops.fast_io import constants as s

logger = logging.getLogger(__name__)

__all__ = ["BaseFileWriter", "MockFileWriter", "PyFileWriter", "storage_bytes"]


def storage_bytes(storage_obj: Any) -> torch.Tensor:
    """The bytes of one storage as torch serializes it: `(untyped_storage, dtype)` pairs or a typed storage."""
    if isinstance(storage_obj, tuple):
        storage = storage_obj[0]
    elif isinstance(storage_obj, torch.storage.TypedStorage):
        storage = storage_obj._untyped_storage
    else:
        storage = storage_obj
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).cpu()


class BaseFileWriter:
    """What every writer shares: the target path and the call/byte/time statistics."""

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        if not isinstance(file_path, (str, os.PathLike)):
            raise TypeError(f"{type(self).__name__}: file_path must be a str or os.PathLike, got {file_path!r}")
        self._file_path = os.fspath(file_path)
        self._stats: dict[str, Any] = dict.fromkeys(s.BASE_STAT_KEYS, 0)

    def file_path(self) -> str:
        return self._file_path

    def fileno(self) -> int:
        """-1: not an OS file (torch then writes through `write`)."""
        self._incr_stats(s.FILENO_COUNT_KEY)
        return s.INVALID_FD

    def flush(self) -> None:
        self._incr_stats(s.FLUSH_COUNT_KEY)

    def write(self, buffer: bytes | bytearray | memoryview) -> int:  # pragma: no cover - every writer overrides
        raise NotImplementedError

    def close(self) -> None:
        self._incr_stats(s.CLOSE_COUNT_KEY)

    def stats(self) -> dict[str, Any]:
        """A copy of the statistics, with the derived GB/s entries and the file's path."""
        out = dict(self._stats)
        out[s.WRITE_SPEED_KEY] = s.speed(out[s.WRITE_BYTES_KEY], out[s.WRITE_SEC_KEY])
        out[s.FILE_PATH_KEY] = self._file_path
        return out

    def _dump_state(self) -> dict[str, Any]:
        """Log the statistics (DeepSpeed's `checkpoint.writer.show_statistics`) and return them."""
        state = self.stats()
        logger.info("file writer stats = %s", state)
        return state

    def _incr_stats(self, key: str, incr: float = 1) -> None:
        self._stats[key] += incr

    def _count_write(self, num_bytes: int, seconds: float) -> None:
        self._incr_stats(s.WRITE_COUNT_KEY)
        self._incr_stats(s.WRITE_BYTES_KEY, num_bytes)
        self._incr_stats(s.WRITE_SEC_KEY, seconds)


class PyFileWriter(BaseFileWriter):
    """Writes through a buffered Python file (the baseline the fast writer is measured against)."""

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        super().__init__(file_path)
        self._fp = open(self._file_path, "wb")  # noqa: SIM115 - closed by close()

    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        start = time.perf_counter()
        self._fp.write(buffer)
        num_bytes = memoryview(buffer).nbytes
        self._count_write(num_bytes, time.perf_counter() - start)
        return num_bytes

    def flush(self) -> None:
        super().flush()
        self._fp.flush()

    def close(self) -> None:
        if not self._fp.closed:
            self._fp.close()
        super().close()


class MockFileWriter(BaseFileWriter):
    """Counts what would be written and writes nothing (the file is created empty): measures serialization alone."""

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        super().__init__(file_path)
        with open(self._file_path, "wb"):
            pass
        self._stats[s.SAVE_STORAGE_KEY] = 0
        self._stats[s.SAVE_STORAGE_BYTES_KEY] = 0

    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        num_bytes = memoryview(buffer).nbytes
        self._count_write(num_bytes, 0.0)
        return num_bytes

    def save_torch_storage_object_list(self, storage_obj_list: list[Any], save_size: bool) -> int:
        """Count the storages (and their size fields with `save_size`) as written."""
        total = 0
        for storage_obj in storage_obj_list:
            nbytes = storage_bytes(storage_obj).numel()
            self._incr_stats(s.SAVE_STORAGE_KEY)
            self._incr_stats(s.SAVE_STORAGE_BYTES_KEY, nbytes)
            total += self.write(b"\0" * s.STORAGE_OBJ_SIZE) if save_size else 0
            self._count_write(nbytes, 0.0)
            total += nbytes
        return total
