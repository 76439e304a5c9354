"""`deepspeed.nvme.ds_aio_constants`: the I/O engine names of DeepSpeed's `ds_io --engine` (ds's `ds_io` runs
all four)."""

from __future__ import annotations

AIO_HANDLE = "aio_handle"
AIO_BASIC = "aio_basic"
TORCH_IO = "torch_io"
TORCH_FAST_IO = "torch_fastio"
VALID_ENGINES = [AIO_HANDLE, AIO_BASIC, TORCH_IO, TORCH_FAST_IO]

# The keys of an engine's `ctxt` dict (`deepspeed.nvme.torch_io`, `torch_fastio_engine`).
BUFFER = "buffer"
BOUNCE_BUFFER = "bounce_buffer"
NUM_BYTES = "num_bytes"
FILE = "file"
HANDLE = "handle"
ELAPSED_SEC = "elapsed_sec"
FAST_IO_BUFFER = "fast_io_buffer"
USE_CPU_LOCKED_TENSOR = "cpu_locked_tensor"
USE_GDS = "gds"

__all__ = [
    "AIO_BASIC",
    "AIO_HANDLE",
    "BOUNCE_BUFFER",
    "BUFFER",
    "ELAPSED_SEC",
    "FAST_IO_BUFFER",
    "FILE",
    "HANDLE",
    "NUM_BYTES",
    "TORCH_FAST_IO",
    "TORCH_IO",
    "USE_CPU_LOCKED_TENSOR",
    "USE_GDS",
    "VALID_ENGINES",
]
