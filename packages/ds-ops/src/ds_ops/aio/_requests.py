"""In-flight requests of an `AsyncIOHandle`, their outcome as the op reports it, and `AioError`."""

from __future__ import annotations

import ctypes
import enum
import errno
import os
from dataclasses import dataclass

import torch


class Stage(enum.IntEnum):
    """Where a request failed (mirrors ds_aio::Stage in csrc/aio/ds_aio_request.h)."""

    NONE = 0
    OPEN = 1
    IO = 2
    SHORT_READ = 3
    DIRECT_REFUSED = 4
    CLOSE = 5


class Result(ctypes.Structure):
    """What the op writes back when a request settles (mirrors ds_aio::Result)."""

    _fields_ = [
        ("bytes_done", ctypes.c_int64),
        ("direct_bytes", ctypes.c_int64),
        ("error", ctypes.c_int32),
        ("stage", ctypes.c_int32),
        ("direct_refused", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("start_ns", ctypes.c_int64),  # time.monotonic_ns() when a worker took the request up
        ("end_ns", ctypes.c_int64),  # ... and when it settled
        ("checksum", ctypes.c_uint64),  # asked for with checksum=True: see AsyncIOHandle.async_pread
    ]


@dataclass
class PendingRequest:
    """One submitted request; holds the tensor and the encoded path alive until it settles."""

    op: str  # "read" or "write"
    path: str
    path_bytes: bytes
    tensor: torch.Tensor
    file_offset: int
    nbytes: int
    result: Result

    @property
    def failed(self) -> bool:
        return self.result.error != 0


_HINTS = {
    errno.ENOSPC: "the file system is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file size limit was reached (RLIMIT_FSIZE, `ulimit -f`, or the file system's maximum)",
    errno.EROFS: "the file system is mounted read-only",
    errno.ENOENT: "the file or its directory does not exist",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EACCES: "permission denied",
    errno.EISDIR: "the path is a directory",
    errno.EIO: "the device reported an I/O error",
}


def _errno_text(code: int) -> str:
    name = errno.errorcode.get(code, str(code))
    hint = _HINTS.get(code)
    return f"{os.strerror(code)} ({name}{'; ' + hint if hint else ''})"


def _short_read(request: PendingRequest) -> str:
    """What the file holds for a short read: the bytes it has from the offset, and its size."""
    try:
        size = os.stat(request.path).st_size
    except OSError as err:
        return f"got {request.result.bytes_done} (the file is gone: {err.strerror})"
    available = max(0, min(size - request.file_offset, request.nbytes))
    return (
        f"got {available} (the file has {size} bytes: truncated, or written with another size or offset?; "
        f"{request.result.bytes_done} bytes were read before the request stopped)"
    )


def describe(request: PendingRequest) -> str:
    """One sentence: the op, the file, the offset, the bytes expected and done, and the cause."""
    r = request.result
    head = (
        f"aio {request.op} of {request.nbytes} bytes at offset {request.file_offset} of {request.path!r} "
        f"failed after {r.bytes_done} bytes"
    )
    stage = Stage(r.stage)
    if stage is Stage.OPEN:
        return (
            f"{head}: cannot open the file for {'writing' if request.op == 'write' else 'reading'}: "
            f"{_errno_text(r.error)}"
        )
    if stage is Stage.SHORT_READ:
        return f"{head}: short read: expected {request.nbytes} bytes, {_short_read(request)}"
    if stage is Stage.DIRECT_REFUSED:
        return (
            f"{head}: the file system refuses O_DIRECT (open with O_DIRECT failed with EINVAL); create "
            f"the handle with use_o_direct=False, or use_o_direct=None to fall back to buffered I/O there"
        )
    if stage is Stage.CLOSE:
        return f"{head}: closing the written file reported a deferred write error: {_errno_text(r.error)}"
    text = f"{head}: {_errno_text(r.error)}"
    if r.error == errno.EINVAL:
        text += "; if the file system mishandles O_DIRECT, create the handle with use_o_direct=False"
    return text


class AioError(OSError):
    """A read or write of the async I/O op failed; the message names the file and what happened.

    Raised by `AsyncIOHandle.wait()` (and `sync_pread`/`sync_pwrite`) once every in-flight request
    has settled. For several failures, the message describes the first and counts the others;
    `failures` holds one sentence per failed request.

    Attributes:
        errno: the first failure's errno (ENODATA for a short read).
        filename: the first failed request's file.
        op: "read" or "write".
        file_offset: where in the file the request started.
        nbytes: the bytes the request was for.
        bytes_done: the bytes read or written before it failed.
        failures: one sentence per failed request.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int = 0,
        filename: str | None = None,
        op: str = "",
        file_offset: int = 0,
        nbytes: int = 0,
        bytes_done: int = 0,
        failures: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.errno = code
        self.strerror = os.strerror(code) if code else message
        self.filename = filename
        self.op = op
        self.file_offset = file_offset
        self.nbytes = nbytes
        self.bytes_done = bytes_done
        self.failures = failures or (message,)

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def from_requests(cls, failed: list[PendingRequest]) -> AioError:
        """The error for a batch of settled requests of which `failed` (non-empty) did not succeed."""
        sentences = tuple(describe(request) for request in failed)
        first = failed[0]
        message = sentences[0]
        if len(failed) > 1:
            others = ", ".join(repr(r.path) for r in failed[1:4]) + (", ..." if len(failed) > 4 else "")
            message += f" (and {len(failed) - 1} more failed request(s): {others}; see .failures)"
        return cls(
            message,
            code=first.result.error,
            filename=first.path,
            op=first.op,
            file_offset=first.file_offset,
            nbytes=first.nbytes,
            bytes_done=first.result.bytes_done,
            failures=sentences,
        )
