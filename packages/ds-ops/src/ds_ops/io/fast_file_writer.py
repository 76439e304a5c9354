"""`deepspeed.io.fast_file_writer`: `FastFileWriter` and its config (ds-ops' `ds_ops.fast_io`)."""

from __future__ import annotations

from ds_ops.fast_io import FastFileWriter, FastFileWriterConfig
from ds_ops.fast_io.constants import FASTIO_STAT_KEYS

__all__ = ["FASTIO_STAT_KEYS", "FastFileWriter", "FastFileWriterConfig"]
