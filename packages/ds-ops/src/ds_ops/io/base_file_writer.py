"""`deepspeed.io.base_file_writer`: the file-object face every writer shares (`ds_ops.fast_io`)."""

from __future__ import annotations

from ds_ops.fast_io import BaseFileWriter
from ds_ops.fast_io.constants import BASE_STAT_KEYS

__all__ = ["BASE_STAT_KEYS", "BaseFileWriter"]
