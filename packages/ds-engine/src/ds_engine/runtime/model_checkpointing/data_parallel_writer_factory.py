"""`deepspeed.runtime.model_checkpointing.data_parallel_writer_factory`: which ranks write, and their shares.

Re-exports `ds_engine._checkpoint.dp_writer_config` (None and REPLICA units; SOCKET and MACHINE are refused).
"""

from __future__ import annotations

from ds_engine._checkpoint.dp_writer_config import DataParallelWriterConfig, DataParallelWriterFactory

__all__ = ["DataParallelWriterConfig", "DataParallelWriterFactory"]
