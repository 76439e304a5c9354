"""`deepspeed.nvme.perf_run_sweep`: run the aio settings sweep and write its logs (ds-ops' `ds_ops.nvme_tune`)."""

from __future__ import annotations

from ds_ops.nvme_tune import DEFAULT_SWEEP_CONFIG, parse_sweep_arguments, sweep_main

__all__ = ["DEFAULT_SWEEP_CONFIG", "parse_sweep_arguments", "sweep_main"]
