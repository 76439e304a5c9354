"""Asynchronous file I/O for ZeRO-Infinity: the async_io op behind DeepSpeed's `aio_handle` API.

from ds_ops.aio import AsyncIOHandle
handle = AsyncIOHandle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)
buffer = handle.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.float32))
handle.async_pwrite(buffer, "/nvme/swap/param_0.bin")
handle.wait()              # raises AioError naming the file if anything failed
handle.sync_pread(buffer, "/nvme/swap/param_0.bin")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_ops.aio._deepspeed_handle import aio_handle
from ds_ops.aio._functional import aio_read, aio_write
from ds_ops.aio._handle import AsyncIOHandle
from ds_ops.aio._requests import AioError
from ds_ops.aio._trace import IoRecord, IoTrace
from ds_ops.op_builder import AsyncIOBuilder

AsyncIOBuilder.handle_class = aio_handle  # `AsyncIOBuilder().load().aio_handle(...)`, DeepSpeed's idiom
AsyncIOBuilder.functional = {"aio_read": aio_read, "aio_write": aio_write}  # `.load().aio_read(...)`

if TYPE_CHECKING:  # type checkers see the lazy name's real type
    from ds_ops.aio._config import AioConfig


def __getattr__(name: str) -> object:
    # AioConfig imports pydantic (~0.3 s); it loads when first asked for, like ds_comm's config names.
    if name == "AioConfig":
        return importlib.import_module("ds_ops.aio._config").AioConfig
    raise AttributeError(f"module 'ds_ops.aio' has no attribute {name!r}")


__all__ = [
    "AioConfig",
    "AioError",
    "AsyncIOBuilder",
    "AsyncIOHandle",
    "IoRecord",
    "IoTrace",
    "aio_handle",
    "aio_read",
    "aio_write",
]
