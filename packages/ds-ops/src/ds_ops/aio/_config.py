"""`AioConfig`: the top-level `aio` section of a ds_config (DeepSpeed 0.19.8 keys and defaults)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from ds_comm import ConfigModel
from ds_ops.aio._limits import MAX_BLOCK_SIZE, MAX_INTRA_OP_PARALLELISM, MAX_QUEUE_DEPTH


class AioConfig(ConfigModel):
    """How the async I/O op moves swapped tensors between host memory and NVMe files.

    ds-engine reads it from the `aio` section and ds-zero's NVMe swapper builds its
    `AsyncIOHandle` from it (`AsyncIOHandle.from_config`). `thread_count` is DeepSpeed's old name
    of `intra_op_parallelism` (accepted with a deprecation warning).
    """

    deprecated_keys: ClassVar[dict[str, str]] = {"thread_count": "intra_op_parallelism"}
    inert_keys: ClassVar[dict[str, str]] = {
        "use_gds": "GPUDirect Storage is not supported; tensors are read and written through host memory",
    }

    block_size: int = Field(1048576, gt=0, le=MAX_BLOCK_SIZE)
    """Bytes per read or write handed to the kernel; a request is cut into blocks of this size
    (rounded down to a multiple of 4096 for O_DIRECT)."""
    queue_depth: int = Field(8, gt=0, le=MAX_QUEUE_DEPTH)
    """Blocks each worker keeps in flight (io_uring engine)."""
    intra_op_parallelism: int = Field(1, gt=0, le=MAX_INTRA_OP_PARALLELISM)
    """Worker threads per handle; each request is split across them."""
    single_submit: bool = False
    """Submit blocks to the kernel one at a time instead of in batches."""
    overlap_events: bool = True
    """Refill the queue as each block completes instead of waiting for the whole batch."""
    use_gds: bool = False
    """GPUDirect Storage (NVIDIA cuFile); only False is accepted."""
