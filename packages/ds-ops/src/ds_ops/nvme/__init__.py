"""`deepspeed.nvme`: DeepNVMe's benchmark and tuning tools over ds-ops'
`nvme_bench` (`ds_io`), `nvme_tune` (`ds_nvme_tune`) and `nvme_stats`; see `ds_ops.io` for why the path.

ds_io --folder /nvme/scratch --io_size 400M            # one transfer size, timed
ds_nvme_tune --nvme_dir /nvme/scratch                   # sweep the aio settings, propose an `aio` section
"""

from __future__ import annotations

from ds_ops.nvme_bench import ds_io_main
from ds_ops.nvme_tune import generate_main, parse_sweep_arguments, sweep_main

__all__ = ["ds_io_main", "generate_main", "parse_sweep_arguments", "sweep_main"]
