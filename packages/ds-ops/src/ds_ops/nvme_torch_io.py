"""`ds_io --engine torch_io | torch_fastio`: time `torch.save` of the buffer, plain or through the FastPersist writer.

DeepSpeed's `ds_io` has engines beside the aio handle: `torch_io` times `torch.save(buffer, path)` (write
only: DeepSpeed refuses reads), `torch_fastio` times `torch.save` into a `FastFileWriter` over an aio handle and
a `--fast_io_size` pinned buffer, closed (flushed) inside the timed part (write only, as in DeepSpeed). Each
loop removes the previous file first, so no write overwrites one in place. The file holds torch's
serialization of the buffer, so it is a little larger than `io_size`; `--validate` loads it back and compares.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from ds_ops.aio import AsyncIOHandle
from ds_ops.fast_io import FastFileWriter, FastFileWriterConfig

__all__ = ["TORCH_ENGINES", "time_torch_writes"]

TORCH_ENGINES = ("torch_io", "torch_fastio")


def time_torch_writes(
    engine: str,
    path: str,
    buffer: torch.Tensor,
    handle: AsyncIOHandle,
    *,
    loops: int,
    warmup_loops: int,
    fast_io_size: int,
    zipfile_serialization: bool = True,
) -> list[float]:
    """Seconds of each timed `torch.save` of `buffer` to `path` by `engine` (after `warmup_loops` untimed ones).

    Raises:
        ValueError: an engine other than `torch_io` / `torch_fastio`.
    """
    if engine not in TORCH_ENGINES:
        raise ValueError(f"--engine {engine!r} is not one of {TORCH_ENGINES}")
    staging = (
        handle.new_cpu_locked_tensor(fast_io_size, torch.empty(0, dtype=torch.uint8)) if engine != "torch_io" else None
    )
    save: Callable[[], None]
    if staging is None:

        def save() -> None:
            torch.save(buffer, path, _use_new_zipfile_serialization=zipfile_serialization)

    else:

        def save() -> None:
            config = FastFileWriterConfig(
                dnvme_handle=handle,
                pinned_tensor=staging,
                double_buffer=True,
                num_parallel_writers=1,
                writer_rank=0,
                global_rank=0,
            )
            writer = FastFileWriter(path, config)
            try:
                torch.save(buffer, writer, _use_new_zipfile_serialization=zipfile_serialization)  # type: ignore[arg-type]
            finally:
                writer.close()

    seconds = []
    try:
        for i in range(warmup_loops + loops):
            if os.path.exists(path):
                os.remove(path)
            start = time.perf_counter()
            save()
            if i >= warmup_loops:
                seconds.append(time.perf_counter() - start)
    finally:
        if staging is not None:
            handle.free_cpu_locked_tensor(staging)
    return seconds
