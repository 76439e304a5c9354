"""`CheckpointWriterFactory`: DeepSpeed's maker of one checkpoint file writer at a time, over `ds_ops.fast_io`.

A script (or a checkpoint engine of its own) asks it for a writer per file: FAST gives a `FastFileWriter`
over one async I/O handle and one staging buffer made at construction (the `aio` settings), PYTHON a
`PyFileWriter`, MOCK a `MockFileWriter` (counts the bytes, writes none: serialization timing). One writer
is out at a time; `release_writer` closes it (and logs its statistics under `show_statistics`). The files it
writes are not published atomically: the engine's own saves go through `CheckpointFileWriter`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ds_engine._checkpoint import writer_constants as c
from ds_ops.aio import AsyncIOHandle
from ds_ops.fast_io import BaseFileWriter, FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter

logger = logging.getLogger(__name__)

__all__ = ["CheckpointWriterFactory"]

_AIO_KEYS = ("block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism")


class CheckpointWriterFactory:
    """Makes the writer of each checkpoint file (DeepSpeed's class and arguments).

    Args:
        writer_config: the writer dict (`model_checkpointing.config.get_checkpoint_writer_config`).
        aio_config: the `aio` section's dict (FAST only; DeepSpeed's key names).
        dp_writer_config: a `DataParallelWriterConfig` (this rank's share of parallel writes), or None.
    """

    def __init__(self, writer_config: dict[str, Any], aio_config: dict[str, Any], dp_writer_config: Any) -> None:
        self._type = str(writer_config[c.CHECKPOINT_WRITER_TYPE]).upper()
        self._io_buffer_size = int(writer_config[c.CHECKPOINT_IO_BUFFER_SIZE])
        self._io_buffer_double = bool(writer_config[c.CHECKPOINT_IO_BUFFER_DOUBLE])
        self._io_multiplier = int(writer_config[c.CHECKPOINT_IO_MULTIPLIER])
        self._data_parallel_writer = dp_writer_config
        self._show_statistics = bool(writer_config[c.CHECKPOINT_IO_STATISTICS]) and dp_writer_config is not None
        self._writer: BaseFileWriter | None = None
        self._dnvme_handle: AsyncIOHandle | None = None
        self._io_buffer: torch.Tensor | None = None
        if self._type not in c.CHECKPOINT_WRITER_TYPES:
            raise ValueError(
                f"checkpoint.writer.type: {self._type!r} is not one of {c.CHECKPOINT_WRITER_TYPES} (case-insensitive)"
            )
        if self._type == c.CheckpointWriterType.FAST:
            if (aio_config or {}).get("use_gds"):
                raise ValueError("aio.use_gds: GPUDirect Storage is not implemented; set it false")
            settings = {k: aio_config[k] for k in _AIO_KEYS if aio_config and k in aio_config}
            self._dnvme_handle = AsyncIOHandle.from_config(settings)
            self._io_buffer = self._dnvme_handle.new_cpu_locked_tensor(
                self._io_buffer_size, torch.empty(0, dtype=torch.uint8)
            )

    def create_writer(self, file_path: str | os.PathLike[str], optimize_dp_state: bool) -> BaseFileWriter:
        """The writer of `file_path`; with `optimize_dp_state` (FAST) this rank writes its share of a file
        split among the data-parallel writers, under `<file_path>-<rank>.<writers>` as DeepSpeed names it.

        Raises:
            RuntimeError: the previous writer was not released.
        """
        if self._writer is not None:
            raise RuntimeError(
                f"CheckpointWriterFactory: a writer for {self._writer.file_path()} is still out; call "
                "release_writer() before creating the next one"
            )
        if self._type == c.CheckpointWriterType.MOCK:
            self._writer = MockFileWriter(file_path)
        elif self._type == c.CheckpointWriterType.PYTHON:
            self._writer = PyFileWriter(file_path)
        else:
            dp = self._data_parallel_writer
            writers, rank = 1, 0
            if optimize_dp_state:
                if dp is None:
                    raise ValueError("create_writer(optimize_dp_state=True) needs a data-parallel writer config")
                writers, rank = dp.world_size * self._io_multiplier, dp.rank
                file_path = f"{os.fspath(file_path)}-{rank}.{writers}"
            assert self._io_buffer is not None  # made with the handle for FAST
            config = FastFileWriterConfig(
                dnvme_handle=self._dnvme_handle,
                pinned_tensor=self._io_buffer,
                double_buffer=self._io_buffer_double,
                num_parallel_writers=writers,
                writer_rank=rank,
                global_rank=dp.global_rank if dp is not None else 0,
            )
            self._writer = FastFileWriter(file_path, config)
        return self._writer

    def release_writer(self) -> None:
        """Close the writer that is out (its file is complete on return)."""
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        writer.close()
        if self._show_statistics:
            logger.info("checkpoint writer statistics: %s", writer.stats())
