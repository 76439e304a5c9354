"""`deepspeed.io.base_io_buffer`: the staging buffer the others build on (ds-ops' `SingleIOBuffer`)."""

from __future__ import annotations

from ds_ops.fast_io import SingleIOBuffer

Base_IO_Buffer = SingleIOBuffer
"""DeepSpeed's name of the base staging buffer; in ds the double buffer derives from the single one."""

__all__ = ["Base_IO_Buffer"]
