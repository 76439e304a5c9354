"""`deepspeed.nvme.perf_sweep_utils`: the sweep's folder names (ds-ops' `ds_ops.nvme_stats`)."""

from __future__ import annotations

from ds_ops.nvme_stats import (
    BENCH_LOG_DIR,
    READ_IO_DIR,
    READ_LOG_DIR,
    READ_OP_DESC,
    SCRIPT_PREFIX,
    WRITE_IO_DIR,
    WRITE_LOG_DIR,
    WRITE_OP_DESC,
)

__all__ = [
    "BENCH_LOG_DIR",
    "READ_IO_DIR",
    "READ_LOG_DIR",
    "READ_OP_DESC",
    "SCRIPT_PREFIX",
    "WRITE_IO_DIR",
    "WRITE_LOG_DIR",
    "WRITE_OP_DESC",
]
