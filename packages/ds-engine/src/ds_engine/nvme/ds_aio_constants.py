"""`deepspeed.nvme.ds_aio_constants`: the I/O engine names of DeepSpeed's `ds_io --engine` (ds's `ds_io` runs
`aio_handle`, `torch_io` and `torch_fastio`; not `aio_basic`)."""

from __future__ import annotations

AIO_HANDLE = "aio_handle"
AIO_BASIC = "aio_basic"
TORCH_IO = "torch_io"
TORCH_FAST_IO = "torch_fastio"
VALID_ENGINES = [AIO_HANDLE, AIO_BASIC, TORCH_IO, TORCH_FAST_IO]

__all__ = ["AIO_BASIC", "AIO_HANDLE", "TORCH_FAST_IO", "TORCH_IO", "VALID_ENGINES"]
