"""`deepspeed.io.single_io_buffer`: one staging buffer, filled then written (ds-ops' `SingleIOBuffer`)."""

from __future__ import annotations

from ds_ops.fast_io import SingleIOBuffer

Single_IO_Buffer = SingleIOBuffer
"""DeepSpeed's name."""

__all__ = ["SingleIOBuffer", "Single_IO_Buffer"]
