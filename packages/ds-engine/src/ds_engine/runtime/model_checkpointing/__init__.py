"""`deepspeed.runtime.model_checkpointing`: the `checkpoint.writer` key names (`constants`), the section as
DeepSpeed's dicts (`config`), the writer factory (`writer_factory`) and which ranks write (`utils`,
`data_parallel_writer_factory`).

ds validates the section with `ds_engine.config.CheckpointWriterConfig`; the engine's own files go through
`ds_engine._checkpoint.file_writer.CheckpointFileWriter` (atomic publish), the factory serves scripts.
"""

from __future__ import annotations

from ds_engine.runtime.model_checkpointing import constants
from ds_engine.runtime.model_checkpointing.constants import *  # noqa: F403
from ds_engine.runtime.model_checkpointing.writer_factory import CheckpointWriterFactory

__all__ = [
    "CheckpointWriterFactory",
    "constants",
    *(name for name in vars(constants) if not name.startswith("_") and name != "annotations"),
]
