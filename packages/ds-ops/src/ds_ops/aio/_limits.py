"""Upper bounds of the aio settings, shared by `AioConfig` and `AsyncIOHandle` (no pydantic here)."""

from __future__ import annotations

#: Largest block one kernel request moves (io_uring takes a 32-bit length; 1 GiB leaves headroom).
MAX_BLOCK_SIZE = 1 << 30
#: io_uring's limit on ring entries.
MAX_QUEUE_DEPTH = 32768
#: Worker threads per handle.
MAX_INTRA_OP_PARALLELISM = 1024
