"""`deepspeed.nvme.test_ds_aio`: `ds_io`'s entry point (ds-ops' `ds_ops.nvme_bench`)."""

from __future__ import annotations

from ds_ops.nvme_bench import ds_io_main

__all__ = ["ds_io_main"]
