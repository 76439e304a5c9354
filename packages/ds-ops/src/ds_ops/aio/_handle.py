"""`AsyncIOHandle` (DeepSpeed's `aio_handle`): queue reads and writes of host tensors to files, wait for them."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ds_ops.aio._buffers import ALIGNMENT, aligned_tensor, direct_io_allowed
from ds_ops.aio._limits import MAX_BLOCK_SIZE, MAX_INTRA_OP_PARALLELISM, MAX_QUEUE_DEPTH
from ds_ops.aio._requests import AioError, PendingRequest, Result
from ds_ops.aio._trace import record_settled
from ds_ops.op_builder import AsyncIOBuilder

if TYPE_CHECKING:
    from ds_ops.aio._config import AioConfig

logger = logging.getLogger(__name__)

ENGINES = {"auto": 0, "psync": 1, "io_uring": 2}
_ENGINE_NAMES = {1: "psync", 2: "io_uring"}
# direct_mode codes of ds_aio_submit: buffered, O_DIRECT or fail, O_DIRECT where the file system allows it.
_DIRECT_OFF, _DIRECT_ON, _DIRECT_WHERE_ALLOWED = 0, 1, 2
_WANT_CHECKSUM = 1  # ds_aio_submit flag (kWantChecksum in csrc/aio/ds_aio_request.h)

# Directories whose buffered fallback was already logged (log once per directory per process).
_FALLBACK_LOGGED: set[str] = set()
_FALLBACK_LOCK = threading.Lock()


def _check_int(name: str, value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"AsyncIOHandle: {name}={value!r} must be an int in [1, {high}]")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"AsyncIOHandle: {name}={value!r} must be True or False")
    return value


class AsyncIOHandle:
    """Asynchronous reads and writes between contiguous CPU tensors and files (ZeRO-Infinity swapping).

    A request moves a whole tensor to or from the byte range `[file_offset, file_offset + nbytes)`
    of a file. `async_pwrite`/`async_pread` queue it and return at once; worker threads cut it into
    blocks of `block_size` bytes and keep up to `queue_depth` blocks per worker in flight (io_uring),
    or move them with pread/pwrite where io_uring is unavailable. `wait()` blocks until every queued
    request has settled and raises `AioError` if any failed. Requests may complete in any order;
    a handle is for one Python thread at a time.

    With O_DIRECT (the default where the file system allows it) data bypasses the page cache.
    Tensors need no special alignment: memory that is not 4096-aligned is copied through the op's
    aligned buffers, a tail shorter than 4096 bytes and requests at unaligned offsets are moved
    buffered; tensors from `new_cpu_locked_tensor` take the zero-copy path.

    Args:
        block_size: bytes per kernel request (default 1 MiB; rounded down to a multiple of 4096
            for O_DIRECT).
        queue_depth: blocks in flight per worker (default 8; io_uring engine).
        single_submit: submit blocks one at a time instead of in batches (default False).
        overlap_events: refill the queue as blocks complete rather than per batch (default True).
        intra_op_parallelism: worker threads; each request is split across them (default 1).
        use_o_direct: True: always O_DIRECT, and a file system that refuses it is an `AioError`;
            False: buffered; None (default): O_DIRECT where allowed, else buffered (logged once).
        thread_count: DeepSpeed's old name of `intra_op_parallelism`.
        engine: "auto" (io_uring where this process may use it, else psync), "io_uring" or "psync".

    Raises:
        ValueError, TypeError: an argument is out of range or of the wrong type (before any work).
        OpNotCompatibleError, OpBuildError: the op cannot be built here.
        AioError: engine="io_uring" and the kernel refuses io_uring, or the workers cannot start.
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        intra_op_parallelism: int = 1,
        use_o_direct: bool | None = None,
        *,
        thread_count: int | None = None,
        engine: str = "auto",
    ) -> None:
        if thread_count is not None:
            if intra_op_parallelism not in (1, thread_count):
                raise ValueError(
                    f"AsyncIOHandle: thread_count={thread_count!r} and intra_op_parallelism="
                    f"{intra_op_parallelism!r} disagree; pass only intra_op_parallelism"
                )
            intra_op_parallelism = thread_count
        self._block_size = _check_int("block_size", block_size, MAX_BLOCK_SIZE)
        self._queue_depth = _check_int("queue_depth", queue_depth, MAX_QUEUE_DEPTH)
        self._intra_op_parallelism = _check_int("intra_op_parallelism", intra_op_parallelism, MAX_INTRA_OP_PARALLELISM)
        self._single_submit = _check_bool("single_submit", single_submit)
        self._overlap_events = _check_bool("overlap_events", overlap_events)
        if use_o_direct is not None:
            _check_bool("use_o_direct", use_o_direct)
        self._use_o_direct = use_o_direct
        if engine not in ENGINES:
            raise ValueError(f"AsyncIOHandle: engine={engine!r} must be one of {', '.join(map(repr, ENGINES))}")
        self._direct_mode = {None: _DIRECT_WHERE_ALLOWED, True: _DIRECT_ON, False: _DIRECT_OFF}[use_o_direct]
        self._pending: list[PendingRequest] = []
        self._locked: dict[int, torch.Tensor] = {}
        self._direct_by_dir: dict[str, bool] = {}
        self._handle: int | None = None
        self._pid = os.getpid()  # the workers are threads of this process: a forked child has none
        self.num_bytes_moved = 0
        """Bytes read or written by settled requests of this handle (failed ones count what they moved)."""
        self.num_bytes_direct = 0
        """Of `num_bytes_moved`, the bytes that went through O_DIRECT."""
        self._lib = AsyncIOBuilder().load(verbose=False)
        self.engine: str = self._start(engine)
        """The engine the workers run: "io_uring" or "psync"."""

    def _start(self, engine: str) -> str:
        used, setup_error = ctypes.c_int32(0), ctypes.c_int32(0)
        handle = self._lib.ds_aio_create(
            self._block_size,
            self._queue_depth,
            int(self._single_submit),
            int(self._overlap_events),
            self._intra_op_parallelism,
            ENGINES[engine],
            ctypes.byref(used),
            ctypes.byref(setup_error),
        )
        if not handle:
            code = setup_error.value
            what = "io_uring_setup" if engine == "io_uring" else "starting the worker threads"
            raise AioError(
                f"AsyncIOHandle(engine={engine!r}): {what} failed: {os.strerror(code)} "
                f"({code}); use engine='auto' to fall back to psync",
                code=code,
            )
        self._handle = handle
        name = _ENGINE_NAMES[used.value]
        if engine == "auto" and name == "psync":
            logger.info("aio: io_uring unavailable (%s); using the pread/pwrite engine", os.strerror(setup_error.value))
        return name

    @classmethod
    def from_config(
        cls, config: AioConfig | Mapping[str, Any], *, use_o_direct: bool | None = None, engine: str = "auto"
    ) -> AsyncIOHandle:
        """A handle from the `aio` section (an `AioConfig` or its dict).

        Raises:
            ConfigError: the section is invalid; the message names the key path (`aio.<key>`).
        """
        from ds_comm import validate_section  # noqa: PLC0415 - pydantic loads on first use, not at import
        from ds_ops.aio._config import AioConfig  # noqa: PLC0415

        section = validate_section(AioConfig, config, path="aio")
        return cls(
            section.block_size,
            section.queue_depth,
            section.single_submit,
            section.overlap_events,
            section.intra_op_parallelism,
            use_o_direct,
            engine=engine,
        )

    # ---- requests -------------------------------------------------------------------------------
    def async_pwrite(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], file_offset: int = 0, *, checksum: bool = False
    ) -> PendingRequest:
        """Queue a write of `tensor`'s bytes to `path` at `file_offset` (the file is created if
        missing, never truncated). The tensor must not change until `wait()` returns.

        With `checksum`, the worker threads also sum the bytes as they go (see `async_pread`)."""
        return self._submit("write", tensor, path, file_offset, checksum)

    def async_pread(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], file_offset: int = 0, *, checksum: bool = False
    ) -> PendingRequest:
        """Queue a read of `tensor.nbytes` bytes of `path` from `file_offset` into `tensor`; its
        contents are undefined until `wait()` returns. A file that ends first is a short-read error.

        With `checksum`, after `wait()` the returned request's `result.checksum` is the wrapping 64-bit
        sum of the bytes moved, read as little-endian 8-byte words from the tensor's first byte (bytes past
        the last whole word add as themselves): computed by the worker threads as each piece lands, so the
        caller's thread does not pass over the data again to check it."""
        return self._submit("read", tensor, path, file_offset, checksum)

    def sync_pwrite(self, tensor: torch.Tensor, path: str | os.PathLike[str], file_offset: int = 0) -> None:
        """`async_pwrite` then `wait()`."""
        self.async_pwrite(tensor, path, file_offset)
        self.wait()

    def sync_pread(self, tensor: torch.Tensor, path: str | os.PathLike[str], file_offset: int = 0) -> None:
        """`async_pread` then `wait()`."""
        self.async_pread(tensor, path, file_offset)
        self.wait()

    def wait(self) -> int:
        """Block until every queued request has settled; returns how many settled.

        Raises:
            AioError: a request failed (open, I/O error, full disk, file size limit, short read,
                O_DIRECT refused). Raised after all requests settled; it names the first failure's
                operation, file, offset, bytes expected and done, and the cause.
        """
        if self._handle is None or os.getpid() != self._pid:
            return 0  # a forked child has no requests of this handle in flight
        count = int(self._lib.ds_aio_wait(self._handle))  # releases the GIL while it blocks
        settled, self._pending = self._pending, []
        record_settled(settled)
        for request in settled:
            self.num_bytes_moved += request.result.bytes_done
            self.num_bytes_direct += request.result.direct_bytes
            if request.result.direct_refused:
                self._log_fallback(request.path)
        failed = [request for request in settled if request.failed]
        if failed:
            raise AioError.from_requests(failed)
        return count

    def _submit(
        self, op: str, tensor: torch.Tensor, path: str | os.PathLike[str], file_offset: int, checksum: bool = False
    ) -> PendingRequest:
        where = f"AsyncIOHandle.{'async_pwrite' if op == 'write' else 'async_pread'}"
        if self._handle is None:
            raise ValueError(f"{where}: the handle is closed")
        if os.getpid() != self._pid:
            raise ValueError(
                f"{where}: this handle was created in process {self._pid} and its worker threads "
                f"do not exist in this forked process {os.getpid()}; create a handle per process"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{where}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(
                f"{where}: tensor has layout {tensor.layout}; the op moves dense (strided) tensors "
                f"(pass tensor.to_dense())"
            )
        if tensor.device.type != "cpu":
            raise ValueError(
                f"{where}: tensor is on {tensor.device}; the op moves host memory only "
                f"(copy it to a CPU tensor, e.g. from new_cpu_locked_tensor)"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"{where}: tensor of shape {tuple(tensor.shape)} is not contiguous; pass "
                f"tensor.contiguous() (and copy back after a read)"
            )
        if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"{where}: file_offset={file_offset!r} must be an int >= 0")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{where}: path must be a str or os.PathLike, got {type(path).__name__}")
        text = os.fspath(path)
        if not isinstance(text, str):
            raise TypeError(f"{where}: path must be a str or os.PathLike of str, got {text!r}")
        if "\0" in text:
            raise ValueError(f"{where}: path {text!r} contains a NUL character")
        request = PendingRequest(
            op=op,
            path=text,
            path_bytes=os.fsencode(text),
            tensor=tensor,
            file_offset=file_offset,
            nbytes=tensor.numel() * tensor.element_size(),
            result=Result(),
        )
        self._pending.append(request)  # before submitting: the op may write the result at once
        self._lib.ds_aio_submit(
            self._handle,
            int(op == "write"),
            tensor.data_ptr(),
            request.nbytes,
            request.path_bytes,
            file_offset,
            self._direct_mode,
            ctypes.addressof(request.result),
            _WANT_CHECKSUM if checksum else 0,
        )
        return request

    def _log_fallback(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        with _FALLBACK_LOCK:
            if directory in _FALLBACK_LOGGED:
                return
            _FALLBACK_LOGGED.add(directory)
        logger.warning(
            "aio: the file system of %s refuses O_DIRECT; using buffered I/O there "
            "(pass use_o_direct=False to silence this)",
            directory,
        )

    # ---- buffers --------------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, numel: int, example: torch.Tensor) -> torch.Tensor:
        """A 1-D host tensor of `numel` elements of `example.dtype`, 4096-byte aligned, page-locked
        when a CUDA device is present; reads and writes of it take the zero-copy O_DIRECT path.

        Raises:
            ValueError: numel is not an int >= 1.
            TypeError: example is not a tensor.
        """
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"AsyncIOHandle.new_cpu_locked_tensor: numel={numel!r} must be an int >= 1")
        if not isinstance(example, torch.Tensor):
            raise TypeError(
                f"AsyncIOHandle.new_cpu_locked_tensor: example must be a torch.Tensor "
                f"(its dtype is used), got {type(example).__name__}"
            )
        tensor = aligned_tensor(numel, example.dtype, pin=torch.cuda.is_available())
        self._locked[tensor.data_ptr()] = tensor
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        """Release a tensor from `new_cpu_locked_tensor` (its memory goes once no reference is left).

        Raises:
            ValueError: the tensor was not allocated by this handle (or was already freed).
        """
        if self._locked.pop(tensor.data_ptr(), None) is None:
            raise ValueError(
                "AsyncIOHandle.free_cpu_locked_tensor: this tensor was not allocated by this "
                "handle's new_cpu_locked_tensor, or was freed already"
            )

    # ---- settings -------------------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        """Bytes that O_DIRECT requests' memory, offsets and sizes are multiples of (4096)."""
        return ALIGNMENT

    def get_thread_count(self) -> int:
        """DeepSpeed's old name of `get_intra_op_parallelism`."""
        return self._intra_op_parallelism

    def uses_o_direct(self, path: str | os.PathLike[str]) -> bool:
        """Whether requests on `path` go through O_DIRECT (its file system allows it and it is not off).

        Raises:
            AioError: the directory of `path` cannot be probed (missing, not a directory, read-only).
        """
        if self._use_o_direct is False:
            return False
        text = os.fspath(path)
        directory = text if os.path.isdir(text) else os.path.dirname(os.path.abspath(text))
        if directory not in self._direct_by_dir:
            try:
                self._direct_by_dir[directory] = direct_io_allowed(text)
            except OSError as err:
                raise AioError(
                    f"aio: cannot probe O_DIRECT support for {text!r}: {err.strerror} ({err.filename})",
                    code=err.errno or 0,
                    filename=text,
                ) from None
        return self._direct_by_dir[directory]

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for queued requests (raising `AioError` if one failed), then stop the workers."""
        if self._handle is None or os.getpid() != self._pid:
            self._handle = None
            return
        try:
            self.wait()
        finally:
            handle, self._handle = self._handle, None
            self._lib.ds_aio_destroy(handle)

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and os.getpid() == self._pid:
            self._handle = None
            self._lib.ds_aio_destroy(handle)  # waits for in-flight requests: their memory is still ours

    def __repr__(self) -> str:
        return (
            f"AsyncIOHandle(block_size={self._block_size}, queue_depth={self._queue_depth}, "
            f"single_submit={self._single_submit}, overlap_events={self._overlap_events}, "
            f"intra_op_parallelism={self._intra_op_parallelism}, use_o_direct={self._use_o_direct}, "
            f"engine={self.engine!r})"
        )
