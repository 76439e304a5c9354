"""`deepspeed.runtime.model_checkpointing`: the `checkpoint.writer` key names (`constants`).

ds validates the section with `ds_engine.config.CheckpointWriterConfig` and writes through
`ds_engine._checkpoint.file_writer.CheckpointFileWriter`; DeepSpeed's writer factories are not reproduced.
"""

from __future__ import annotations

from ds_engine.runtime.model_checkpointing import constants
from ds_engine.runtime.model_checkpointing.constants import *  # noqa: F403

__all__ = ["constants", *(name for name in vars(constants) if not name.startswith("_") and name != "annotations")]
