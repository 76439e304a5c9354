"""`deepspeed.io.double_io_buffer`: two halves, one filled while the other is written (ds-ops' `DoubleIOBuffer`)."""

from __future__ import annotations

from ds_ops.fast_io import DoubleIOBuffer

Double_IO_Buffer = DoubleIOBuffer
"""DeepSpeed's name."""
NUM_BUFFERS = DoubleIOBuffer.parts

__all__ = ["NUM_BUFFERS", "DoubleIOBuffer", "Double_IO_Buffer"]
