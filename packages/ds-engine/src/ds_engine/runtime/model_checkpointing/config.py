"""`deepspeed.runtime.model_checkpointing.config`: the `checkpoint` section as DeepSpeed's dicts.

Re-exports `ds_engine._checkpoint.writer_settings` (validated by ds's `CheckpointConfig`) and the key constants.
"""

from __future__ import annotations

from ds_engine._checkpoint.writer_constants import *  # noqa: F403
from ds_engine._checkpoint.writer_settings import (
    CHECKPOINT_DEFAULT_DICT,
    VALID_VALUES,
    get_checkpoint_config,
    get_checkpoint_writer_config,
)

__all__ = ["CHECKPOINT_DEFAULT_DICT", "VALID_VALUES", "get_checkpoint_config", "get_checkpoint_writer_config"]
