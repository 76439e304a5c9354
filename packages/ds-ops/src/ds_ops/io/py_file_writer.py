"""`deepspeed.io.py_file_writer`: `torch.save` through a plain Python file, with statistics (ds-ops')."""

from __future__ import annotations

from ds_ops.fast_io import PyFileWriter

__all__ = ["PyFileWriter"]
