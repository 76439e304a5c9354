"""`deepspeed.nvme.perf_generate_param`: the `aio` section the sweep logs propose (ds-ops')."""

from __future__ import annotations

from ds_ops.nvme_stats import generate_aio_param
from ds_ops.nvme_tune import generate_main

__all__ = ["generate_aio_param", "generate_main"]
